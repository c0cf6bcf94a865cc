"""`attngrad.patch_flex_attention`: torch's flex_attention runs attngrad inside the block, and only there.

Routing
-------
The attribute of ``torch.nn.attention.flex_attention``, names bound earlier by
``from torch.nn.attention.flex_attention import flex_attention`` (in modules
written here), transformers' ``compile_friendly_flex_attention`` (and a name
bound to it, as Doge's modeling file does): rebound inside, restored after,
also when the block raises, when blocks nest, as a decorator.

Hugging Face models
-------------------
Tiny random-init models built from configs (never downloaded weights),
``initializer_range`` 0.2 so the attention is far from uniform, 24 tokens:

* Llama with GQA and left padding (padded query rows attend nothing);
* Gemma 2 with ``attn_logit_softcapping`` 1.0 (the score_mod's tanh cap)
  and a sliding window of 8 on every other layer;
* Mistral with a sliding window of 8 < 24 on every layer;
* Qwen 2 with packed documents: position_ids restart (10 + 14 tokens in a
  row), no attention_mask, so transformers adds a document mask.

Each takes a training step (train mode, loss of the labels, backward) with
``attn_implementation="flex_attention"`` under the patch, and with the
reference on the same weights: ``sdpa``, or for Gemma 2 (which refuses sdpa:
no softcap) ``flexref-eager64`` below, transformers' eager math with the
softmax in the model's dtype (Gemma 2's own eager rounds P to float32).  A
"bites" check shows each feature (padding, cap, window, packing) changes the
result, so agreement is not agreement of two runs that both ignore it.

transformers builds the BlockMask with ``create_block_mask(_compile=True)``:
unpatched, on CPU, an Inductor compile of the mask function per new shape,
tens of seconds cold (conftest gives Inductor a fresh cache).  The patch
routes it to `attngrad.create_block_mask` (the same BlockMask, no compiler):
`test_hf_steps_compile_nothing` fails if any step of the patched model calls
``torch.compile`` or lets Dynamo compile a frame.

Tolerances
----------
float64: the loss and each parameter's gradient agree within ``RTOL64``
(1e-10) of their largest magnitude, plus 1e-12 of the largest gradient of
the model (for gradients that are mathematically zero, which are rounding
alone).  Measured: <= 1.5e-15 relative (u = 1.1e-16; two layers of sums of
<= 128 products of O(1) numbers), so 1e-10 leaves 10**5 of margin, while
removing the padding, cap, window or packing moves the logits by 0.4..1.4 of
their largest magnitude (`test_the_features_bite`).

float32: the 2x rule of `attngrad.verify.rule` at model level, for the loss
and each parameter's gradient x: ``max|x_flex32 - x_ref64| <= 2 max|x_ref32 -
x_ref64| + 8 eps32 M``: the reference run in float32 on the same weights
sets the scale of float32 error a correct implementation may have (both
reduce over the same 64-wide hidden and 16-wide heads), and the floor, a few
roundings of the quantity's largest magnitude M (for a gradient at least
1e-2 of the model's largest), covers where the reference happens to be exact.
Measured: 1.2e-6..4.5e-6 relative for the patched flex run, within 1.1x of the
reference's own float32 error; a fixed 1e-4 would pass too, with less reason.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import math
import sys
import types
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.attention import flex_attention as torch_flex

import attngrad
from attngrad.strategies import unavailable_reason
from helpers import autograd_nodes

# In a dict, not as a global: the patch rebinds every module global that is torch's function,
# this test module's too (a global ``ORIGINAL = flex_attention`` would read the patched one inside).
KEPT = {"torch": torch_flex.flex_attention}
# torch's own flex on CPU runs eagerly, materialising the scores, and says so once
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> str:
    """A fresh importable module holding ``source``; its name (removed from sys.modules after)."""
    name = f"flexuser_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(source, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, name, types.ModuleType(name))  # undone: the name is dropped
    del sys.modules[name]  # the test's import loads the file
    return name


USER = """
import torch
from torch.nn.attention.flex_attention import flex_attention
from torch.nn.attention.flex_attention import flex_attention as fa


def run(q: torch.Tensor) -> torch.Tensor:
    # with a score_mod: torch's eager forward and attngrad's run the same function; k and v
    # are copies, not q again: torch's eager flex recompiles on aliased inputs after distinct
    # ones, and its guard report then fails (a TypeError inside torch._dynamo)
    return flex_attention(q, q.clone(), q.clone(), score_mod=lambda s, b, h, i, j: s - 0.1 * (i - j).abs())
"""


# -- routing ---------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["explicit", "recompute", "flash"])
def test_module_attribute_runs_attngrad_inside(strategy: str) -> None:
    q, k, v = (torch.randn(2, 4, 20, 8, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(4, dtype=torch.float64, requires_grad=True)

    def score_mod(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return s + bias[h] * (i - j)

    expected = KEPT["torch"](q, k, v, score_mod)  # torch's eager forward (no backward on CPU)
    q.requires_grad_()
    with attngrad.patch_flex_attention(strategy):
        assert torch_flex.flex_attention is not KEPT["torch"]
        got = torch_flex.flex_attention(q, k, v, score_mod)
    assert torch_flex.flex_attention is KEPT["torch"]
    assert f"{strategy.capitalize()}AttentionBackward" in autograd_nodes(got)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    dq, dbias = torch.autograd.grad(got.sum(), (q, bias))
    assert dq.isfinite().all() and dbias.abs().sum() > 0


def test_name_bound_at_import_is_rebound_and_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    user = importlib.import_module(_module(tmp_path, monkeypatch, USER))
    assert user.flex_attention is KEPT["torch"] and user.fa is KEPT["torch"]
    q = torch.randn(1, 2, 12, 8, dtype=torch.float64)
    expected = user.run(q)
    q.requires_grad_()
    with attngrad.patch_flex_attention("recompute"):
        assert user.flex_attention is torch_flex.flex_attention is not KEPT["torch"]
        assert user.fa is torch_flex.flex_attention  # an alias too
        got = user.run(q)
    assert user.flex_attention is KEPT["torch"] and user.fa is KEPT["torch"]
    assert "RecomputeAttentionBackward" in autograd_nodes(got)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_module_imported_inside_the_block_is_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = _module(tmp_path, monkeypatch, USER)
    with attngrad.patch_flex_attention("explicit"):
        user = importlib.import_module(name)  # binds the patched function
        assert user.flex_attention is not KEPT["torch"]
    assert user.flex_attention is KEPT["torch"] and user.fa is KEPT["torch"]


def test_restored_when_the_block_raises_and_when_nested(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    user = importlib.import_module(_module(tmp_path, monkeypatch, USER))
    with pytest.raises(RuntimeError, match="boom"), attngrad.patch_flex_attention("flash"):
        raise RuntimeError("boom")
    assert torch_flex.flex_attention is KEPT["torch"] and user.flex_attention is KEPT["torch"]
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    with attngrad.patch_flex_attention("flash"):
        outer = torch_flex.flex_attention
        assert user.flex_attention is outer is not KEPT["torch"]
        with attngrad.patch_flex_attention("explicit"):
            assert user.flex_attention is torch_flex.flex_attention is not outer
            assert "ExplicitAttentionBackward" in autograd_nodes(user.run(q))
        assert user.flex_attention is torch_flex.flex_attention is outer
        assert "FlashAttentionBackward" in autograd_nodes(user.run(q))
    assert torch_flex.flex_attention is KEPT["torch"] and user.flex_attention is KEPT["torch"]


def test_as_a_decorator() -> None:
    @attngrad.patch_flex_attention("explicit")
    def run(q: torch.Tensor) -> torch.Tensor:
        return torch_flex.flex_attention(q, q, q)

    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    assert "ExplicitAttentionBackward" in autograd_nodes(run(q))
    assert torch_flex.flex_attention is KEPT["torch"]
    assert "ExplicitAttentionBackward" in autograd_nodes(run(q))  # each call patches anew
    assert torch_flex.flex_attention is KEPT["torch"]


def test_unknown_strategy_is_refused_before_patching() -> None:
    with pytest.raises(ValueError, match="unknown strategy 'fast'"):
        attngrad.patch_flex_attention("fast")
    assert torch_flex.flex_attention is KEPT["torch"]


@pytest.mark.filterwarnings("ignore:return_lse is deprecated")  # torch's; Doge still passes it
def test_returns_lse_and_aux_as_torch_does() -> None:
    q = torch.randn(1, 2, 10, 4, dtype=torch.float64)
    out, lse = KEPT["torch"](q, q.clone(), q.clone(), return_lse=True)  # no aliasing: see USER
    aux_request = torch_flex.AuxRequest(lse=True)
    with attngrad.patch_flex_attention("flash"):
        got, got_lse = torch_flex.flex_attention(q, q, q, return_lse=True)
        got_aux_out, aux = torch_flex.flex_attention(q, q, q, return_aux=aux_request)
    for a, b in ((got, out), (got_lse, lse), (got_aux_out, out), (aux.lse, lse)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# -- transformers ----------------------------------------------------------------------

transformers = pytest.importorskip("transformers")

import transformers.integrations.flex_attention as hf_flex  # noqa: E402
import transformers.masking_utils as masking_utils  # noqa: E402

import hf_eager  # noqa: E402

KEPT["hf"] = hf_flex.compile_friendly_flex_attention

DOGE_STYLE = """
from transformers.integrations.flex_attention import compile_friendly_flex_attention
"""


def test_transformers_wrapper_is_patched_and_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doge = importlib.import_module(_module(tmp_path, monkeypatch, DOGE_STYLE))
    compiled_before = hf_flex.WrappedFlexAttention._compiled_flex_attention
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    with attngrad.patch_flex_attention("recompute"):
        assert hf_flex.flex_attention is torch_flex.flex_attention is not KEPT["torch"]
        assert hf_flex.compile_friendly_flex_attention is not KEPT["hf"]
        assert doge.compile_friendly_flex_attention is hf_flex.compile_friendly_flex_attention
        out, lse = doge.compile_friendly_flex_attention(q, q, q, training=True, return_lse=True)
    assert "RecomputeAttentionBackward" in autograd_nodes(out) and lse.shape == (1, 2, 8)
    assert hf_flex.WrappedFlexAttention._compiled_flex_attention is compiled_before  # untouched
    assert hf_flex.flex_attention is KEPT["torch"]
    assert hf_flex.compile_friendly_flex_attention is KEPT["hf"]
    assert doge.compile_friendly_flex_attention is KEPT["hf"]


KEPT["mask"] = torch_flex.create_block_mask


def test_block_mask_builder_is_patched_and_restored() -> None:
    """torch's create_block_mask, and the names transformers bound to it, build attngrad's
    BlockMask inside the block (nested blocks too), torch's after."""
    names = (torch_flex, masking_utils, hf_flex)
    assert all(m.create_block_mask is KEPT["mask"] for m in names)
    with attngrad.patch_flex_attention():
        outer = torch_flex.create_block_mask
        assert outer is not KEPT["mask"] and all(m.create_block_mask is outer for m in names)
        with attngrad.patch_flex_attention("flash"):
            inner = masking_utils.create_block_mask
            assert inner is not outer and all(m.create_block_mask is inner for m in names)
        assert all(m.create_block_mask is outer for m in names)
        mask = masking_utils.create_block_mask(
            masking_utils.causal_mask_function, 2, None, 40, 40, device="cpu", _compile=True
        )  # transformers' call: nothing compiled, torch's BlockMask
    assert all(m.create_block_mask is KEPT["mask"] for m in names)
    want = KEPT["mask"](masking_utils.causal_mask_function, 2, None, 40, 40, device="cpu")
    assert isinstance(mask, torch_flex.BlockMask) and mask.seq_lengths == (40, 40)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(mask, name), getattr(want, name)), name


EAGER64 = "flexref-eager64"
hf_eager.register(EAGER64)

VOCAB = 128
SEQ = 24
WINDOW = 8
RTOL64 = 1e-10
GLOBAL_RTOL64 = 1e-12
FLOOR_ROUNDINGS = 8
EPS32 = torch.finfo(torch.float32).eps
T = transformers
DECODER = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # GQA: 2 query heads per kv head
    "max_position_embeddings": 128,
    "initializer_range": 0.2,
}


def _llama() -> nn.Module:
    return T.LlamaForCausalLM(T.LlamaConfig(**DECODER))


def _gemma2() -> nn.Module:  # layer 0 slides (window 8), layer 1 full; softcap 1.0 bites
    config = T.Gemma2Config(
        **DECODER, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        attn_logit_softcapping=1.0, final_logit_softcapping=None,
    )  # fmt: skip
    assert config.layer_types == ["sliding_attention", "full_attention"], config.layer_types
    return T.Gemma2ForCausalLM(config)


def _mistral() -> nn.Module:  # every layer slides: window 8 < 24 tokens
    return T.MistralForCausalLM(T.MistralConfig(**DECODER, head_dim=16, sliding_window=WINDOW))


def _qwen2() -> nn.Module:
    return T.Qwen2ForCausalLM(T.Qwen2Config(**DECODER))


@dataclass(frozen=True)
class Spec:
    build: Callable[[], nn.Module]
    reference: str
    batch: str  # "padded" (left padding), "packed" (position_ids restart) or "plain"


SPECS = {
    "llama": Spec(_llama, "sdpa", "padded"),
    "gemma2": Spec(_gemma2, EAGER64, "plain"),
    "mistral": Spec(_mistral, "sdpa", "plain"),
    "qwen2": Spec(_qwen2, "sdpa", "packed"),
}
DOCS = (10, 14)  # the packed row: two documents


@functools.cache
def model64(name: str) -> nn.Module:
    torch.manual_seed(0)
    return SPECS[name].build().double()


@functools.cache
def model32(name: str) -> nn.Module:
    return copy.deepcopy(model64(name)).float()


def make_batch(kind: str) -> dict[str, object]:
    """Two rows of SEQ tokens, labels -100 where padded; no cache (transformers detects
    packing from position_ids only without one: `_preprocess_mask_arguments`)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    batch: dict[str, object] = {"input_ids": ids, "labels": ids, "use_cache": False}
    if kind == "padded":
        mask = torch.ones(2, SEQ, dtype=torch.long)
        mask[0, :5] = 0  # left padding: row 0's first 5 queries attend nothing
        batch.update(attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    elif kind == "packed":
        batch["position_ids"] = torch.cat([torch.arange(n) for n in DOCS]).expand(2, SEQ)
    return batch


Step = tuple[torch.Tensor, dict[str, torch.Tensor]]


def train_step(model: nn.Module, impl: str, inputs: dict[str, object]) -> Step:
    """One training step's loss and every parameter's gradient, ``impl`` the attention.

    "flex_attention" runs under the patch and must reach attngrad's backward.
    """
    model.set_attn_implementation(impl)
    model.train()
    model.zero_grad(set_to_none=True)
    flex = impl == "flex_attention"
    with attngrad.patch_flex_attention() if flex else contextlib.nullcontext():
        loss = model(**inputs).loss
    if flex:
        nodes = autograd_nodes(loss)
        # "auto" takes fused's kernels where they build (softcap and the identity score_mod
        # included), else explicit at 24 x 24 scores
        fused = unavailable_reason("fused", torch.device("cpu")) is None
        assert ("FusedAttentionBackward" if fused else "ExplicitAttentionBackward") in nodes, nodes
        assert not any("Flex" in n or "ScaledDotProduct" in n for n in nodes), nodes
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert len(grads) == len(list(model.parameters())), "a parameter got no gradient"
    return loss.detach(), grads


def assert_close64(got: Step, want: Step) -> None:
    (lg, gg), (lw, gw) = got, want
    assert (lg - lw).abs() <= RTOL64 * lw.abs(), f"loss {lg.item()!r} vs {lw.item()!r}"
    top = max(g.abs().max().item() for g in gw.values())
    failed = [
        f"{n}: {e:.3g} > {b:.3g}"
        for n, w in gw.items()
        if not (e := (gg[n] - w).abs().max().item())
        <= (b := RTOL64 * w.abs().max().item() + GLOBAL_RTOL64 * top)
    ]
    assert not failed, "gradients: " + "; ".join(failed)


def assert_2x32(got32: Step, ref32: Step, ref64: Step) -> None:
    """The float32 rule of the module docstring, for the loss and every gradient."""
    top = max(g.abs().max().item() for g in ref64[1].values())
    pairs = [("loss", got32[0], ref32[0], ref64[0], ref64[0].abs().item())]
    for n, w in ref64[1].items():
        pairs.append((n, got32[1][n], ref32[1][n], w, max(w.abs().max().item(), 1e-2 * top)))
    failed = []
    for n, g, r, w, m in pairs:
        err, ref_err = (g.double() - w).abs().max().item(), (r.double() - w).abs().max().item()
        bound = 2 * ref_err + FLOOR_ROUNDINGS * EPS32 * m
        if not err <= bound:
            failed.append(f"{n}: {err:.3g} > 2 * {ref_err:.3g} + floor")
    assert not failed, "; ".join(failed)


@pytest.mark.parametrize("name", list(SPECS))
def test_training_step_matches_the_reference(name: str) -> None:
    spec, inputs = SPECS[name], make_batch(SPECS[name].batch)
    ref64 = train_step(model64(name), spec.reference, inputs)
    got64 = train_step(model64(name), "flex_attention", inputs)
    assert_close64(got64, ref64)
    ref32 = train_step(model32(name), spec.reference, inputs)
    got32 = train_step(model32(name), "flex_attention", inputs)
    assert_2x32(got32, ref32, ref64)
    assert hf_flex.compile_friendly_flex_attention is KEPT["hf"]


@contextlib.contextmanager
def _changed(obj: object, **values: object) -> Iterator[None]:
    before = {k: getattr(obj, k) for k in values}
    for k, v in values.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            setattr(obj, k, v)


def _flex_logits(model: nn.Module, **inputs: torch.Tensor) -> torch.Tensor:
    model.set_attn_implementation("flex_attention")
    model.eval()
    with attngrad.patch_flex_attention(), torch.no_grad():
        return model(**inputs, use_cache=False).logits


def test_the_features_bite() -> None:
    """Padding, softcap, window and packing each change the logits of the patched flex run."""

    def moved(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).abs().max() / b.abs().max()).item()

    llama, batch = model64("llama"), make_batch("padded")
    padded = _flex_logits(
        llama, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
    )
    assert moved(padded[0, 5:], _flex_logits(llama, input_ids=batch["input_ids"])[0, 5:]) > 1e-3

    ids = make_batch("plain")["input_ids"]
    gemma = model64("gemma2")
    base = _flex_logits(gemma, input_ids=ids)
    with contextlib.ExitStack() as stack:
        for layer in gemma.model.layers:
            stack.enter_context(_changed(layer.self_attn, attn_logit_softcapping=None))
        assert moved(_flex_logits(gemma, input_ids=ids), base) > 1e-3
    with _changed(gemma.config, sliding_window=SEQ):  # a window as long as the row: full causal
        assert moved(_flex_logits(gemma, input_ids=ids), base) > 1e-3

    mistral = model64("mistral")
    base = _flex_logits(mistral, input_ids=ids)
    with _changed(mistral.config, sliding_window=None):
        full = _flex_logits(mistral, input_ids=ids)
    torch.testing.assert_close(full[:, :WINDOW], base[:, :WINDOW], rtol=1e-12, atol=1e-12)
    assert moved(full[:, WINDOW:], base[:, WINDOW:]) > 1e-3

    # packed: the second document's logits are those of running it alone
    qwen, packed = model64("qwen2"), make_batch("packed")
    logits = _flex_logits(qwen, input_ids=packed["input_ids"], position_ids=packed["position_ids"])
    alone = _flex_logits(qwen, input_ids=packed["input_ids"][:, DOCS[0] :])
    torch.testing.assert_close(logits[:, DOCS[0] :], alone, rtol=1e-10, atol=1e-10)


def test_hf_steps_compile_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh tiny Llama's first training step, and a step at a new sequence length, under
    the patch: transformers asks for ``create_block_mask(_compile=True)`` at each, and
    nothing calls ``torch.compile`` or has Dynamo compile a frame (unpatched, each new
    shape is an Inductor compile: tens of seconds on a CPU)."""
    from torch._dynamo.utils import counters

    import attngrad.integrations.patch_flex as patch_flex

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"torch.compile called in the patched route: {args[:1]!r}")

    built: list[object] = []
    build = patch_flex.attngrad_create_block_mask

    def spy(*args: object, **kwargs: object) -> object:
        built.append(kwargs.get("_compile"))
        return build(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", refuse)
    monkeypatch.setattr(patch_flex, "attngrad_create_block_mask", spy)
    frames = sum(counters["frames"].values())
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(**DECODER))
    model.set_attn_implementation("flex_attention")
    model.train()
    with attngrad.patch_flex_attention():
        for n in (24, 40):  # the first step, then a new sequence length
            ids = torch.randint(0, VOCAB, (2, n))
            mask = torch.ones(2, n, dtype=torch.long)
            mask[0, :3] = 0  # padding: transformers ands a padding mask into the causal one
            model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    assert built == [True, True], built  # one BlockMask per forward, transformers' _compile=True
    assert sum(counters["frames"].values()) == frames, dict(counters["frames"])
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())


# -- torch.compile ---------------------------------------------------------------------


class AlibiAttention(nn.Module):
    """A block whose attention is flex with a learnable ALiBi slope per head (a captured tensor).

    x [B, N, C] -> [B, N, C]; heads [B, H, N, C/H].
    """

    def __init__(self, call: Callable[..., torch.Tensor], dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.call, self.heads = call, heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.slopes = nn.Parameter(torch.linspace(0.5, 0.05, heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (t.view(b, n, self.heads, c // self.heads).transpose(1, 2) for t in (q, k, v))

        def alibi(s, b_, h, i, j):  # type: ignore[no-untyped-def]
            return torch.where(j <= i, s - self.slopes[h] * (i - j), -math.inf)  # causal ALiBi

        y = self.call(q, k, v, alibi)  # (B, H, N, C/H)
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


@pytest.mark.parametrize("route", ["attngrad", "patched-torch"])
def test_compiled_module_matches_eager_and_breaks_the_graph_once(route: str) -> None:
    """torch.compile (aot_eager: AOTAutograd's joint graph, no codegen) around a flex call.

    attngrad.flex_attention is torch.compiler.disable'd: Dynamo compiles the
    projections before it and after it as two graphs with one break between,
    at the call; the call itself and its backward run eagerly.
    """
    torch._dynamo.reset()
    patched = route == "patched-torch"

    def torch_call(*args: object) -> torch.Tensor:  # looks torch's function up when called
        return torch_flex.flex_attention(*args)  # type: ignore[arg-type,no-any-return]

    call = torch_call if patched else attngrad.flex_attention
    model = AlibiAttention(call).double()
    x = torch.randn(2, 20, 32, dtype=torch.float64, requires_grad=True)
    graphs: list[torch.fx.GraphModule] = []
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def counting(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable:
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    # patched-torch: the eager run needs the patch too (torch's flex has no backward on CPU)
    with attngrad.patch_flex_attention("flash") if patched else contextlib.nullcontext():
        explained = torch._dynamo.explain(model)(x)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=counting)
        got = compiled(x)
        got_grads = torch.autograd.grad((got * got).sum(), [x, *model.parameters()])
        expected = model(x)
        want_grads = torch.autograd.grad((expected * expected).sum(), [x, *model.parameters()])
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert explained.graph_count == 2 and explained.graph_break_count == 1, explained
    (reason,) = explained.break_reasons
    assert "torch.compiler.disable" in reason.reason, reason.reason
    lines = [frame.line.strip() for frame in reason.user_stack]
    assert "y = self.call(q, k, v, alibi)  # (B, H, N, C/H)" in lines, lines
    assert len(graphs) == 2
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert not any("flex" in t or "attngrad" in t for t in targets), targets
    torch._dynamo.reset()
