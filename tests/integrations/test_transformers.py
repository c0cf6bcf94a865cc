"""attngrad as a Hugging Face transformers ``attn_implementation``.

Tiny random-init models from configs (hidden 32, 2 layers, vocab 100, 12
tokens; ``initializer_range`` 0.2 so the attention is far from uniform), never
downloaded weights.  Each model runs with ``attn_implementation="attngrad"``
and with transformers' reference on the same weights and inputs:

* ``sdpa`` where the model supports it;
* gpt-oss (sinks): ``eager``, whose softmax runs in the model's dtype;
* Gemma 2 (softcap): ``eager64``, transformers' eager math (softcap, then the
  mask) with the softmax in the model's dtype, registered below with sdpa's
  mask builder told never to skip the mask.  Gemma 2's own ``eager`` rounds
  P to float32 (``softmax(..., dtype=torch.float32)``), so it agrees only to
  about 1e-7 (`test_gemma2_eager_agrees_to_float32`); in float64 with left
  padding it gives NaN: the finfo(float64).min of its mask becomes -inf in
  float32, a padded query row attends nothing and its softmax is 0/0, and
  the NaN row then reaches every position through P @ V (0 * NaN).

What padded positions give
--------------------------
Logits are compared at the positions that are not padding.  At padded
query positions: with right padding a padded query still attends the real
keys before it, and every implementation gives the same value.  With left
padding a padded query of a causal model attends nothing: attngrad gives
a zero attention output and zero gradients, as torch 2.13's SDPA does for a
bool mask row that is all False (both then agree there too); eager with its
finfo.min float mask gives the mean of V over all keys (a uniform softmax),
or NaN where the softmax runs in float32 (above).  Every attngrad output and
gradient is checked to be finite everywhere.

Tolerances
----------
float64 (u = 2**-53 = 1.1e-16): logits agree within ``RTOL64`` = 1e-10 of
their largest magnitude; each parameter's gradient within 1e-10 of its own
largest magnitude plus 1e-12 of the largest gradient of the whole model.
The second term is for gradients that are mathematically zero and so only
rounding (e.g. the key bias: softmax ignores a per-row constant, measured
2e-15 absolute where other gradients are O(1)).  The models are a few dozen
chained sums of at most ~100 products of O(1) numbers, whose rounding stays
below 1e-13 relative (measured: <= 2e-14, BART's gradients); 1e-10 leaves over 10**3 of margin, and
a wrong mask, scale, window, cap or sink moves the logits by 1e-3..1
relative, failing by 10**7.

float32: the 2x rule of `attngrad.verify.rule` at model level: for each quantity
x (logits at real positions, each parameter's gradient),
``max|x_attngrad32 - x_ref64| <= 2 max|x_ref32 - x_ref64| + floor``, where
x_ref32 is the reference implementation run in float32 on the same weights
and ``floor = FLOOR_ROUNDINGS * eps32 * M``: M is the quantity's largest
magnitude (for a gradient at least 1e-2 of the model's largest gradient,
for the near-zero gradients above), eps32 = 2**-23, FLOOR_ROUNDINGS = 8: a
few single roundings of the result, for where the reference happens to be
exact.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

import attngrad  # noqa: E402
import hf_eager  # noqa: E402
from attngrad.integrations.transformers import (  # noqa: E402
    RESERVED_NAMES,
    attention_forward,
    register,
    registered,
)

VOCAB = 100
SEQ = 12
DEC_SEQ = 7
RTOL64 = 1e-10
GLOBAL_RTOL64 = 1e-12
FLOOR_ROUNDINGS = 8
EPS32 = torch.finfo(torch.float32).eps
CPU_STRATEGIES = ("explicit", "recompute", "flash")
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


# -- implementations ---------------------------------------------------------------


hf_eager.register("eager64")

NAME = register()  # "attngrad", strategy "auto"
# a name may not contain "flash" (transformers' flash checks would take it)
STRATEGY_NAMES = {
    s: register("attngrad-tiled" if s == "flash" else f"attngrad-{s}", strategy=s)
    for s in attngrad.STRATEGIES
}


# -- models ------------------------------------------------------------------------

T = transformers
TINY = {"vocab_size": VOCAB, "initializer_range": 0.2}
DECODER = {
    **TINY,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # GQA: 2 query heads per kv head
    "max_position_embeddings": 64,
}


def _llama(**kw: object) -> torch.nn.Module:
    return T.LlamaForCausalLM(T.LlamaConfig(**DECODER, **kw))


def _gpt2(**kw: object) -> torch.nn.Module:
    config = T.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, initializer_range=0.2,
        resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=1, eos_token_id=2,
        **{"attn_pdrop": 0.0, **kw},
    )  # fmt: skip
    return T.GPT2LMHeadModel(config)


def _bert(**kw: object) -> torch.nn.Module:
    config = T.BertConfig(
        **TINY, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **kw,
    )  # fmt: skip
    return T.BertForMaskedLM(config)


def _mistral(**kw: object) -> torch.nn.Module:  # every layer slides, window 5 < 12 tokens
    return T.MistralForCausalLM(T.MistralConfig(**DECODER, head_dim=8, sliding_window=5, **kw))


def _qwen2(**kw: object) -> torch.nn.Module:  # layer 0 full, layer 1 a window of 5
    config = T.Qwen2Config(
        **DECODER, use_sliding_window=True, sliding_window=5, max_window_layers=1, **kw
    )
    assert config.layer_types == ["full_attention", "sliding_attention"]
    return T.Qwen2ForCausalLM(config)


def _gemma2(**kw: object) -> torch.nn.Module:  # softcap 1.0 bites: |scores| reach ~3 here
    config = T.Gemma2Config(
        **DECODER, head_dim=8, query_pre_attn_scalar=8, sliding_window=5,
        attn_logit_softcapping=1.0, final_logit_softcapping=None, **kw,
    )  # fmt: skip
    return T.Gemma2ForCausalLM(config)


def _gpt_oss(**kw: object) -> torch.nn.Module:  # sinks, sliding window 5 on layer 0
    config = T.GptOssConfig(
        **{**DECODER, "intermediate_size": 32}, head_dim=8, num_local_experts=2,
        num_experts_per_tok=1, sliding_window=5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **kw,
    )  # fmt: skip
    model = T.GptOssForCausalLM(config)
    model.set_experts_implementation("eager")  # grouped_mm takes no float64 on CPU
    with torch.no_grad():  # sinks start at zero: make them matter
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    return model


def _t5(**kw: object) -> torch.nn.Module:
    config = T.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **{"dropout_rate": 0.0, **kw},
    )  # fmt: skip
    return T.T5ForConditionalGeneration(config)


def _bart(**kw: object) -> torch.nn.Module:
    config = T.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, init_std=0.2, dropout=0.0, **kw,
    )  # fmt: skip
    return T.BartForConditionalGeneration(config)


@dataclass(frozen=True)
class Spec:
    build: Callable[..., torch.nn.Module]
    reference: str  # the implementation attngrad is compared with
    seq2seq: bool = False


SPECS = {
    "llama": Spec(_llama, "sdpa"),
    "gpt2": Spec(_gpt2, "sdpa"),
    "bert": Spec(_bert, "sdpa"),
    "mistral": Spec(_mistral, "sdpa"),
    "qwen2": Spec(_qwen2, "sdpa"),
    "gemma2": Spec(_gemma2, "eager64"),
    "gpt_oss": Spec(_gpt_oss, "eager"),
    "t5": Spec(_t5, "sdpa", seq2seq=True),
    "bart": Spec(_bart, "sdpa", seq2seq=True),
}


@functools.cache
def model64(name: str) -> torch.nn.Module:
    """The float64 model of ``name`` (shared: every use sets its implementation first)."""
    torch.manual_seed(0)
    return SPECS[name].build().double().eval()


@functools.cache
def model32(name: str) -> torch.nn.Module:
    """The same weights as `model64`, in float32."""
    return copy.deepcopy(model64(name)).float()


@dataclass
class Batch:
    inputs: dict[str, torch.Tensor]
    real: torch.Tensor  # [B, Nq] bool: the logits' positions that are not padding
    weights: torch.Tensor  # the loss is sum(logits * weights); zero at padding


def make_batch(name: str, padding: str, dtype: torch.dtype) -> Batch:
    """Two rows of SEQ tokens; with padding, row 0 loses 4 tokens and row 1 two, on ``padding``'s side."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=g)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    for row, pads in ((0, 4), (1, 2)):
        if padding == "left":
            mask[row, :pads] = 0
        elif padding == "right":
            mask[row, SEQ - pads :] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if SPECS[name].seq2seq:
        inputs["decoder_input_ids"] = torch.randint(3, VOCAB, (2, DEC_SEQ), generator=g)
        real = torch.ones(2, DEC_SEQ, dtype=torch.bool)
    else:
        real = mask.bool()
    w = torch.randn(*real.shape, VOCAB, generator=g, dtype=torch.float64).to(dtype)
    return Batch(inputs, real, w * real[..., None])


def run(
    model: torch.nn.Module, impl: str, batch: Batch
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and every parameter's gradient of sum(logits * weights) under ``impl``."""
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    logits = model(**batch.inputs).logits
    (logits * batch.weights).sum().backward()
    grads = {
        n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        for n, p in model.named_parameters()
    }
    return logits.detach(), grads


def assert_finite(logits: torch.Tensor, grads: dict[str, torch.Tensor]) -> None:
    assert logits.isfinite().all(), "non-finite logits"
    bad = [n for n, g in grads.items() if not g.isfinite().all()]
    assert not bad, f"non-finite gradients: {bad}"


def assert_close64(
    got: tuple[torch.Tensor, dict[str, torch.Tensor]],
    want: tuple[torch.Tensor, dict[str, torch.Tensor]],
    real: torch.Tensor,
) -> None:
    """The float64 tolerances of the module docstring."""
    (lg, gg), (lw, gw) = got, want
    err = (lg - lw)[real].abs().max().item()
    scale = lw[real].abs().max().item()
    assert err <= RTOL64 * scale, f"logits: {err:.3g} > {RTOL64:g} * {scale:.3g}"
    top = max(g.abs().max().item() for g in gw.values())
    failed = []
    for n, w in gw.items():
        e = (gg[n] - w).abs().max().item()
        bound = RTOL64 * w.abs().max().item() + GLOBAL_RTOL64 * top
        if not e <= bound:
            failed.append(f"{n}: {e:.3g} > {bound:.3g}")
    assert not failed, "gradients: " + "; ".join(failed)


# -- float64 agreement -------------------------------------------------------------


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("name", list(SPECS))
def test_float64_matches_reference(name: str, padding: str) -> None:
    model, batch = model64(name), make_batch(name, padding, torch.float64)
    want = run(model, SPECS[name].reference, batch)
    got = run(model, NAME, batch)
    assert_finite(*got)
    assert_close64(got, want, batch.real)


def test_float64_padded_rows_are_zero_like_sdpa() -> None:
    """Left padding, causal: a padded query attends nothing; attngrad and SDPA both give it 0."""
    model, batch = model64("llama"), make_batch("llama", "left", torch.float64)
    outputs = {}
    for impl in ("sdpa", NAME):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            outputs[impl] = model(**batch.inputs).logits
    torch.testing.assert_close(outputs[NAME], outputs["sdpa"], rtol=RTOL64, atol=0.0)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_float64_custom_4d_mask(kind: str) -> None:
    """A 4-D mask given to the model (transformers passes it through as is), bool or additive.

    The float mask is eager's (0 / finfo.min): a padded row is then all finfo.min, which
    SDPA and attngrad both treat as a uniform softmax over its keys, not as an empty row.
    """
    model, batch = model64("llama"), make_batch("llama", "left", torch.float64)
    pad = batch.inputs["attention_mask"].bool()
    allowed = torch.ones(SEQ, SEQ, dtype=torch.bool).tril() & pad[:, None, None, :]
    if kind == "float":
        zero = torch.zeros((), dtype=torch.float64)
        mask = torch.where(allowed, zero, torch.finfo(torch.float64).min)
    else:
        mask = allowed
    inputs = {**batch.inputs, "attention_mask": mask}
    custom = Batch(inputs, torch.ones_like(batch.real), batch.weights)
    got, want = run(model, NAME, custom), run(model, "sdpa", custom)
    assert_finite(*got)
    assert_close64(got, want, custom.real)  # every position, the padded ones too


@pytest.mark.parametrize("padding", ["none", "right"])
def test_gemma2_eager_agrees_to_float32(padding: str) -> None:
    """Gemma 2's own eager (its softmax in float32) agrees with attngrad to float32's rounding."""
    model, batch = model64("gemma2"), make_batch("gemma2", padding, torch.float64)
    (lw, gw), (lg, gg) = run(model, "eager", batch), run(model, NAME, batch)
    scale = lw[batch.real].abs().max().item()
    assert (lg - lw)[batch.real].abs().max().item() <= 64 * EPS32 * scale
    top = max(g.abs().max().item() for g in gw.values())
    for n, w in gw.items():
        assert (gg[n] - w).abs().max().item() <= 64 * EPS32 * top, n


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_softcap_and_sinks_bite(name: str) -> None:
    """Without softcap (Gemma 2) or with sinks at -1e4 (gpt-oss) the logits move: both matter."""
    torch.manual_seed(0)
    model = SPECS[name].build().double().eval()  # its own copy: it is changed below
    batch = make_batch(name, "none", torch.float64)
    model.set_attn_implementation(NAME)
    with torch.no_grad():
        base = model(**batch.inputs).logits
        for layer in model.model.layers:
            if name == "gemma2":
                layer.self_attn.attn_logit_softcapping = None
            else:
                layer.self_attn.sinks.fill_(-1e4)
        off = model(**batch.inputs).logits
    assert (base - off).abs().max() > 1e-3 * base.abs().max()


# -- float32: the 2x rule ----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "padding"), [("llama", "left"), ("t5", "right"), ("gemma2", "left")]
)
def test_float32_twice_the_reference_error(name: str, padding: str) -> None:
    reference = SPECS[name].reference
    ref = run(model64(name), reference, make_batch(name, padding, torch.float64))
    batch = make_batch(name, padding, torch.float32)
    plain = run(model32(name), reference, batch)
    got = run(model32(name), NAME, batch)
    assert_finite(*got)
    real = batch.real
    pairs = [("logits", got[0][real], plain[0][real], ref[0][real], ref[0][real].abs().max())]
    top = max(g.abs().max() for g in ref[1].values())
    pairs += [
        (n, got[1][n], plain[1][n], r, torch.maximum(r.abs().max(), 1e-2 * top))
        for n, r in ref[1].items()
    ]
    failed = []
    for n, g, p, r, magnitude in pairs:
        err = (g.double() - r).abs().max().item()
        baseline = (p.double() - r).abs().max().item()
        bound = 2 * baseline + FLOOR_ROUNDINGS * EPS32 * magnitude.item()
        if not err <= bound:
            failed.append(f"{n}: {err:.3g} > 2 * {baseline:.3g} + floor")
    assert not failed, "; ".join(failed)


# -- every strategy ----------------------------------------------------------------


def _strategies() -> list[object]:
    triton = pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not TRITON_INTERPRETED, reason="triton on CPU runs only under TRITON_INTERPRET=1"
        ),
    )
    return [*CPU_STRATEGIES, triton]


@pytest.mark.parametrize("strategy", _strategies())
def test_strategy_matches_sdpa(strategy: str) -> None:
    """Each strategy on Llama (GQA, causal) with left padding, against sdpa in float64."""
    model, batch = model64("llama"), make_batch("llama", "left", torch.float64)
    want = run(model, "sdpa", batch)
    got = run(model, STRATEGY_NAMES[strategy], batch)
    assert_finite(*got)
    assert_close64(got, want, batch.real)


@pytest.mark.parametrize("strategy", CPU_STRATEGIES)
def test_strategy_sinks_window_matches_eager(strategy: str) -> None:
    """Each CPU strategy on gpt-oss (sinks, a sliding window, GQA) with left padding."""
    model, batch = model64("gpt_oss"), make_batch("gpt_oss", "left", torch.float64)
    want = run(model, "eager", batch)
    got = run(model, STRATEGY_NAMES[strategy], batch)
    assert_finite(*got)
    assert_close64(got, want, batch.real)


# -- training with attention dropout -----------------------------------------------

DROPOUT = {
    "llama": {"attention_dropout": 0.3},
    "gpt2": {"attn_pdrop": 0.3},
    "bart": {"attention_dropout": 0.3},
}


@pytest.mark.parametrize("name", list(DROPOUT))
def test_dropout_training_step_reproduces(name: str) -> None:
    torch.manual_seed(0)
    model = SPECS[name].build(**DROPOUT[name]).double().train()
    batch = make_batch(name, "left", torch.float64)

    def step(seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        torch.manual_seed(seed)
        return run(model, NAME, batch)

    first, again, other = step(7), step(7), step(8)
    assert_finite(*first)
    assert torch.equal(first[0], again[0])
    assert all(torch.equal(first[1][n], again[1][n]) for n in first[1])
    assert not torch.equal(first[0], other[0])
    model.eval()
    evaluated = run(model, NAME, batch)[0]
    assert not torch.allclose(first[0], evaluated), "dropout left the logits unchanged"
    # one optimizer step on the gradients runs and stays finite
    torch.manual_seed(7)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    model.train()
    run(model, NAME, batch)
    optimizer.step()
    assert all(p.isfinite().all() for p in model.parameters())


# -- generation with a KV cache ----------------------------------------------------


def _generate(
    model: torch.nn.Module, impl: str, inputs: dict[str, torch.Tensor], **kw: object
) -> torch.Tensor:
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=0, **kw)


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "t5", "bart"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_greedy_generation_matches_sdpa(name: str, padded: bool) -> None:
    """Greedy decoding with a dynamic KV cache; 6 + 8 tokens pass the window of 5."""
    model = model64(name)
    batch = make_batch(name, "left" if padded else "none", torch.float64)
    # the first 6 tokens: padded, row 0 keeps 2 of them and row 1 four
    inputs = {k: batch.inputs[k][:, :6] for k in ("input_ids", "attention_mask")}
    want = _generate(model, "sdpa", inputs)
    got = _generate(model, NAME, inputs)
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_greedy_generation_static_cache(padded: bool) -> None:
    """A static cache: its prefill passes no mask with Nk > Nq (sdpa crops the keys)."""
    model = model64("llama")
    batch = make_batch("llama", "left" if padded else "none", torch.float64)
    want = _generate(model, "sdpa", batch.inputs, cache_implementation="static")
    got = _generate(model, NAME, batch.inputs, cache_implementation="static")
    assert torch.equal(got, want), (got, want)


# -- packed sequences --------------------------------------------------------------


def test_packed_sequences_with_flash_kwargs() -> None:
    """DataCollatorWithFlattening: cu_seq_lens (and position_ids) give each sequence alone.

    With the model's default use_cache=True transformers builds no packed mask
    from position_ids (it packs only without a cache), so sdpa, which ignores
    cu_seq_lens, lets the sequences attend each other; attngrad gets no mask
    and the segments.  With use_cache=False the mask is packed too, and both
    apply.
    """
    model = model64("llama")
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g) for n in (5, 7)]
    collate = T.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")
    packed = collate([{"input_ids": s.tolist()} for s in seqs])
    assert packed["cu_seq_lens_q"].tolist() == [0, 5, 12]
    packed.pop("labels")
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        alone = torch.cat([model(input_ids=s[None]).logits for s in seqs], dim=1)
    weights = torch.randn(alone.shape, generator=g, dtype=torch.float64)
    real = torch.ones(1, 12, dtype=torch.bool)
    got = run(model, NAME, Batch(dict(packed), real, weights))  # no mask: the segments alone
    torch.testing.assert_close(got[0], alone, rtol=RTOL64, atol=0.0)
    no_cache = {**packed, "use_cache": False}
    got = run(model, NAME, Batch(no_cache, real, weights))  # the packed mask and the segments
    torch.testing.assert_close(got[0], alone, rtol=RTOL64, atol=0.0)
    no_kwargs = {k: v for k, v in no_cache.items() if not k.startswith(("cu_seq", "max_len"))}
    want = run(model, "sdpa", Batch(no_kwargs, real, weights))  # sdpa: from position_ids
    assert_close64(got, want, real)


# -- attention_forward directly ----------------------------------------------------


class _Module(torch.nn.Module):
    def __init__(self, is_causal: bool = True) -> None:
        super().__init__()
        self.is_causal = is_causal


def _qkv(b: int, hq: int, hkv: int, nq: int, nk: int, d: int = 8) -> list[torch.Tensor]:
    shapes = ((b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, d))
    return [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes]


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    **kw: object,
) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, **kw)  # type: ignore[arg-type]
    return out.transpose(1, 2)


def test_forward_decode_step_window_bottom_right() -> None:
    """One query, no mask, Nk = 9 keys, sliding_window=4: the last 4 keys (the query is the last)."""
    q, k, v = _qkv(2, 4, 2, 1, 9)
    out, weights = attention_forward(_Module(), q, k, v, None, sliding_window=4)
    assert weights is None and out.shape == (2, 1, 4, 8) and out.is_contiguous()
    mask = torch.zeros(1, 9, dtype=torch.bool)
    mask[:, -4:] = True
    torch.testing.assert_close(out, _sdpa(q, k, v, mask))


def test_forward_windows_without_mask() -> None:
    """Nq = Nk: causal (w - 1, 0) on a causal module, |i - j| <= w on a bidirectional one."""
    q, k, v = _qkv(1, 2, 2, 10, 10)
    i, j = torch.arange(10)[:, None], torch.arange(10)[None]
    out, _ = attention_forward(_Module(), q, k, v, None, sliding_window=3)
    torch.testing.assert_close(out, _sdpa(q, k, v, (j <= i) & (j > i - 3)))
    out, _ = attention_forward(_Module(is_causal=False), q, k, v, None, sliding_window=3)
    torch.testing.assert_close(out, _sdpa(q, k, v, (i - j).abs() <= 3))
    out, _ = attention_forward(_Module(), q, k, v, None, is_causal=False)  # the keyword wins
    torch.testing.assert_close(out, _sdpa(q, k, v))


def test_forward_mask_is_authoritative() -> None:
    """A given mask (here bidirectional in a block) gets no causal mask and no window on top."""
    q, k, v = _qkv(1, 2, 2, 6, 6)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    mask[:3, :3] = True  # a bidirectional prefix overlay
    out, _ = attention_forward(_Module(), q, k, v, mask[None, None], sliding_window=2)
    torch.testing.assert_close(out, _sdpa(q, k, v, mask))


def test_forward_static_prefill_crops_keys() -> None:
    """No mask, causal, Nk > Nq > 1 (an empty static cache): top-left, as sdpa."""
    q, k, v = _qkv(1, 4, 2, 4, 10)
    out, _ = attention_forward(_Module(), q, k, v, None)
    torch.testing.assert_close(out, _sdpa(q, k[:, :, :4], v[:, :, :4], is_causal=True))


def test_forward_float_mask_gradient() -> None:
    """A float additive mask [B, 1, Nq, Nk] that requires grad receives SDPA's gradient."""
    q, k, v = _qkv(2, 4, 2, 5, 7)
    bias = torch.randn(2, 1, 5, 7, dtype=torch.float64)
    bias[0, 0, :, :2] = torch.finfo(torch.float64).min
    bias.requires_grad_()
    w = torch.randn(2, 5, 4, 8, dtype=torch.float64)
    grads = []
    for fn in (
        lambda: attention_forward(_Module(), q, k, v, bias)[0],
        lambda: _sdpa(q, k, v, bias),
    ):
        out = fn()
        grads.append((out, *torch.autograd.grad((out * w).sum(), (q, k, v, bias))))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_forward_position_bias() -> None:
    """T5's bias joins a bool mask (-inf where False), receives its gradient; an empty row is 0."""
    q, k, v = _qkv(2, 4, 4, 5, 6)
    bias = torch.randn(1, 4, 5, 6, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 1, 5, 6, dtype=torch.bool)
    mask[0, 0, :, :2] = False
    mask[1, 0, 3] = False  # a row that attends nothing
    w = torch.randn(2, 5, 4, 8, dtype=torch.float64)
    out, _ = attention_forward(_Module(False), q, k, v, mask, scaling=1.0, position_bias=bias)
    got = torch.autograd.grad((out * w).sum(), (q, k, v, bias))
    combined = torch.where(mask, bias, -math.inf)
    ref = _sdpa(q, k, v, combined, scale=1.0)
    want = torch.autograd.grad((ref.nan_to_num(0.0) * w).sum(), (q, k, v, bias))
    assert out[1, 3].abs().max() == 0
    torch.testing.assert_close(out, ref.nan_to_num(0.0))
    for a, b in zip(got, want, strict=True):
        assert a.isfinite().all()
        torch.testing.assert_close(a, b.nan_to_num(0.0))
    # no mask, causal: the bias (broadcast over the batch) is the float mask, causality a band
    out, _ = attention_forward(_Module(), q, k, v, None, position_bias=bias)
    got = torch.autograd.grad((out * w).sum(), (q, k, v, bias))
    causal = torch.ones(5, 6, dtype=torch.bool).tril()
    ref = _sdpa(q, k, v, torch.where(causal, bias, -math.inf))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v, bias))
    torch.testing.assert_close(out, ref)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_forward_packed_batch_rows_end_to_end() -> None:
    """cu_seq_lens over a batch of 2 rows index the rows laid end to end (FlashAttention's layout)."""
    q, k, v = _qkv(2, 4, 2, 6, 6)
    cu = torch.tensor([0, 4, 6, 12], dtype=torch.int32)
    out, _ = attention_forward(_Module(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    flat = [t.transpose(0, 1).reshape(1, t.shape[1], 12, 8) for t in (q, k, v)]
    parts = [
        _sdpa(*(t[:, :, a:b] for t in flat), is_causal=True) for a, b in ((0, 4), (4, 6), (6, 12))
    ]
    torch.testing.assert_close(out, torch.cat(parts, dim=1).reshape(2, 6, 4, 8))


def test_forward_refuses_what_it_cannot_honour() -> None:
    q, k, v = _qkv(1, 2, 2, 3, 3)
    m = _Module()
    for key in ("indices", "block_table", "head_mask", "score_mod"):
        with pytest.raises(NotImplementedError, match=key):
            attention_forward(m, q, k, v, None, **{key: torch.zeros(1)})
    with pytest.raises(ValueError, match="eager"):
        attention_forward(m, q, k, v, None, output_attentions=True)
    with pytest.raises(ValueError, match="4-D"):
        attention_forward(m, q, k, v, torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="flex_attention"):
        attention_forward(m, q, k, v, object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="once"):
        attention_forward(m, q, k, v, None, s_aux=torch.zeros(2), sinks=torch.ones(2))
    # harmless keywords pass
    out, _ = attention_forward(
        m,
        q,
        k,
        v,
        None,
        position_ids=torch.arange(3),
        cache_position=torch.arange(3),
        use_cache=True,
    )
    assert out.shape == (1, 3, 2, 8)


# -- registration and refusals -----------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_output_attentions_raises(name: str) -> None:
    """Through the keyword (Llama) and through transformers' recorder (GPT-2 pops the keyword)."""
    model, batch = model64(name), make_batch(name, "none", torch.float64)
    model.set_attn_implementation(NAME)
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        model(**batch.inputs, output_attentions=True)


def test_register_second_name_and_strategy() -> None:
    name = register("attngrad-test-recompute", strategy="recompute")
    assert name == "attngrad-test-recompute"
    assert registered()[name] == "recompute"
    assert name in AttentionInterface._global_mapping
    assert name in AttentionMaskInterface._global_mapping
    assert AttentionInterface._global_mapping[name].keywords == {"strategy": "recompute"}
    # re-registering one of ours rebinds it
    register(name, strategy="flash")
    assert registered()[name] == "flash"
    torch.manual_seed(0)
    config = T.LlamaConfig(**DECODER)
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation=name).double()
    assert model.config._attn_implementation == name
    batch = make_batch("llama", "left", torch.float64)
    assert_close64(run(model, name, batch), run(model, "sdpa", batch), batch.real)


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("flash_attention_2", "own implementations"),
        ("my-flash", "'flash'"),
        ("sdpa", "own implementations"),
        ("fast_sdpa", "'sdpa'"),
        ("eager", "own implementations"),
        ("flex_attention", "own implementations"),
        ("paged|attngrad", "prefix"),
        ("org/attngrad", "Hub"),
        ("", "empty"),
        (3, "must be a str"),
        (None, "must be a str"),
    ],
)
def test_register_refuses_names(name: object, match: str) -> None:
    error = ValueError if isinstance(name, str) else TypeError
    with pytest.raises(error, match=match) as info:
        register(name)  # type: ignore[arg-type]
    message = str(info.value)
    assert repr(name) in message and "register(" in message


def test_register_refuses_names_others_hold_and_unknown_strategies() -> None:
    AttentionInterface.register("someone-elses", hf_eager.eager64_attention)
    with pytest.raises(ValueError, match="already registered") as info:
        register("someone-elses")
    assert "'someone-elses'" in str(info.value)
    for strategy in ("fast", "FLASH", 1, None):
        error = ValueError if isinstance(strategy, str) else TypeError
        with pytest.raises(error, match="choose one of") as info:
            register("attngrad-bad", strategy=strategy)  # type: ignore[arg-type]
        assert repr(strategy) in str(info.value) and "'auto'" in str(info.value)
    assert "attngrad-bad" not in AttentionInterface._global_mapping
    assert {"sdpa", "eager"} <= RESERVED_NAMES


def test_imports_without_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The module imports without transformers; register then names the extra to install."""
    import attngrad.integrations.transformers as module

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    for name in list(sys.modules):
        if name.startswith("transformers."):
            monkeypatch.delitem(sys.modules, name)
    spec = importlib.util.spec_from_file_location("_attngrad_hf_fresh", module.__file__)
    assert spec is not None and spec.loader is not None
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)  # a fresh copy, executed with transformers missing
    with pytest.raises(ImportError, match=r"pip install 'attngrad\[hf\]'"):
        fresh.register()
    with pytest.raises(ImportError, match=r"pip install 'attngrad\[hf\]'"):
        module.register("attngrad-missing")
