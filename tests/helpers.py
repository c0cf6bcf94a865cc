"""Shared helpers of the test suite: a short `Case` builder and the one error rule.

Inputs, outputs and gradients come from `attngrad.verify.cases`, the
judge from `attngrad.verify.rule`; this module only adds what the tests
need on top: ``case(...)`` (a `Case` from positional sizes), ``assert_rule``
(every verdict of `judge_outputs` passes, the verdicts in the message), `StrictRule`
(the rule without its 2x term, where that term would pass zeros), the lists of
strategies and the small tiles of the tiled ones.  Plain functions (not fixtures) because parametrize ids are built
at collection time.  Test modules import them as ``from helpers import ...``;
pytest puts this folder on ``sys.path`` (the default "prepend" import mode).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attngrad
from attngrad.core.contract import Shapes
from attngrad.verify.cases import (
    AttentionFn,
    Case,
    Inputs,
    as_attention,
    outputs_and_grads,
    received,
)
from attngrad.verify.reference import reference_attention
from attngrad.verify.rule import (
    REFERENCE,
    Expected,
    Verdict,
    case_bounds,
    case_floors,
    expect,
    judge,
    judge_outputs,
    judge_run,
)

# "triton" runs here in Triton's interpreter at about a second per call: the
# large grids (gradcheck, SDPA agreement, windows, properties, the ledger) run
# over the tensor-op strategies, and tests/strategies/test_triton.py gives triton the same
# checks on a smaller grid; the other strategy-parametrized tests include it.
TENSOR_STRATEGIES = tuple(s for s in attngrad.STRATEGIES if s != "triton")

# Small tiles (block_q, block_k) for each tiled strategy (`attngrad.strategies.TILED`), so that
# short sequences span several tiles and the step that merges key tiles (the running max's
# rescale) and the split into query blocks run: the default tiles cover up to 256 keys.
# Triton's tiles are powers of two from 16 (its `tiles` check), so it needs Nq, Nk > 16.
SMALL_TILES: dict[str, tuple[tuple[int, int], ...]] = {
    "flash": ((16, 16), (7, 5)),
    "fused": ((16, 16), (7, 5)),
    "triton": ((16, 16),),
}
# Triton's interpreter costs ~0.3 s a tile: where its small tiles run, its own (one tile of
# a short sequence) do not; the small tiles take every step one tile does, and the merges
SMALL_TILES_ONLY = ("triton",)


def attention_fn(strategy: str, tiles: tuple[int, int] | None = None) -> AttentionFn:
    """`attngrad.attention` bound to ``strategy`` and its tiles (None: the strategy's own)."""
    blocks = {} if tiles is None else {"block_q": tiles[0], "block_k": tiles[1]}

    def fn(*args: object, **kwargs: object) -> torch.Tensor:
        return attngrad.attention(*args, strategy=strategy, **blocks, **kwargs)  # type: ignore[arg-type,call-overload,no-any-return]

    return fn


def runs(strategies: tuple[str, ...]) -> list[tuple[str, tuple[int, int] | None]]:
    """(strategy, tiles) pairs: each strategy at its own tiles (None), each tiled one at
    `SMALL_TILES` too (triton at those only: `SMALL_TILES_ONLY`)."""
    own = [(s, None) for s in strategies if s not in SMALL_TILES_ONLY]
    return own + [(s, t) for s in strategies for t in SMALL_TILES.get(s, ())]


def run_id(run: tuple[str, tuple[int, int] | None]) -> str:
    """``flash`` or ``flash-7x5``: a parametrize id of `runs`' pairs."""
    strategy, tiles = run
    return strategy if tiles is None else f"{strategy}-{tiles[0]}x{tiles[1]}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def case(
    lead: tuple[int, ...],
    heads_q: int,
    heads_kv: int,
    seq_q: int,
    seq_k: int,
    head_dim: int,
    value_dim: int | None = None,
    mask: str = "none",
    mask_shape: tuple[int, ...] | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    **kwargs: object,
) -> Case:
    """`verify.Case` from positional sizes: q [*lead, Hq, Nq, d], k/v [*lead, Hkv, Nk, d|dv].

    ``kwargs``: the rest of `Case` (scale, window, enable_gqa).
    """
    dv = head_dim if value_dim is None else value_dim
    shapes = Shapes(tuple(lead), heads_q, heads_kv, seq_q, seq_k, head_dim, dv)
    return Case(shapes, dtype, mask, mask_shape, **kwargs)  # type: ignore[arg-type]


def assert_rule(
    case: Case, inputs: Inputs, got: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None
) -> list[Verdict]:
    """Assert `verify.judge_outputs` passes every quantity in ``got``; return the verdicts.

    ``got``: out and gradients of one run on ``inputs`` (any inputs dict with
    the keys of `verify.make_inputs`, hand-built ones too), a subset of them
    allowed (a quantity left out is not judged).  Each must have the case's
    dtype (or ``dtype``) and its reference's shape.
    """
    want = dtype or case.dtype
    for name, t in got.items():
        assert t.dtype == want, f"{case.id}: {name} is {t.dtype}, not {want}"
    full = dict(got)
    names = {"out", "dq", "dk", "dv"} | ({"dmask"} if case.mask == "float" else set())
    names |= {"dsinks"} if case.sinks != "none" else set()
    if not names <= got.keys():  # judge what is there; the reference stands in for the rest
        reference = as_attention(reference_attention)
        full = {**outputs_and_grads(reference, case, inputs, torch.float64), **got}
    verdicts = [v for v in judge_outputs(case, inputs, full) if v.name in got]
    assert {v.name for v in verdicts} == set(got), (sorted(got), case.id)
    failed = [str(v) for v in verdicts if not v.passed]
    assert not failed, f"{case.id}: " + "; ".join(failed)
    return verdicts


def sdpa_math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """PyTorch's own SDPA, pinned to the MATH backend (the reference is checked against it)."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )


def assert_floor(
    case: Case, inputs: Inputs, got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]
) -> list[Verdict]:
    """Assert |got - want| <= the rule's floor, element by element: the rule without its 2x term.

    For checking the references themselves, where the 2x term would compare a
    computation with itself: `plain_attention` in float64 *is* SDPA MATH.
    ``want``: out and gradients in float64 (a subset of ``got``'s names or all).
    """
    floors = case_floors(case, inputs)
    verdicts = [judge(name, got[name], w, floors[name]) for name, w in want.items()]
    failed = [str(v) for v in verdicts if not v.passed]
    assert not failed, f"{case.id}: " + "; ".join(failed)
    return verdicts


def tiny_llama() -> torch.nn.Module:
    """A random-init 2-layer Llama with GQA (4 query heads, 2 kv heads), vocabulary 64; skips
    the test when transformers is not installed."""
    import pytest

    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


@dataclass(frozen=True)
class StrictRule:
    """The rule without its 2x term, for one case and its inputs: |got - ref| <= max(kept, 0) + floor.

    For where the plain run in the dtype is so far off that the 2x term would
    pass any answer (`blind_to_zeros`): attngrad's strategies keep scores and
    sums in the compute dtype, so they answer to the floor (`case_floors`) and
    the kept bound (`kept_bound`: P and dS kept in the dtype) alone.  ref:
    the float64 reference on the inputs as received (`received`).
    """

    ref: dict[str, torch.Tensor]
    floor: dict[str, torch.Tensor]
    kept: dict[str, torch.Tensor]

    @classmethod
    def of(cls, case: Case, inputs: Inputs) -> StrictRule:
        ref = reference_of(case, inputs)
        floor, kept = case_bounds(case, received(inputs, case.dtype), ref)
        return cls(ref, floor, kept)

    def judge(self, got: Mapping[str, torch.Tensor]) -> list[Verdict]:
        """One verdict per quantity of ``got``."""
        return [
            judge(name, g, self.ref[name], self.floor[name], kept=self.kept[name])
            for name, g in got.items()
        ]


def zeros_like(got: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every quantity of ``got`` as zeros: the wrong answer a rule must reject."""
    return {name: torch.zeros_like(g) for name, g in got.items()}


def reference_of(case: Case, inputs: Inputs) -> dict[str, torch.Tensor]:
    """The float64 reference's out and gradients on the inputs as received (`received`)."""
    return outputs_and_grads(REFERENCE, case, received(inputs, case.dtype), torch.float64)


def blind_to_zeros(
    case: Case,
    inputs: Inputs,
    got: Mapping[str, torch.Tensor],
    expected: Expected | None = None,
) -> set[str]:
    """The quantities of ``got`` whose reference is not all zero, yet the rule
    (`judge_run` on ``expected``: `expect`, computed here when None) passes all zeros
    for them: the plain run in the dtype is off by half of x or more there (16-bit
    at large logits)."""
    expected = expect(case, inputs) if expected is None else expected
    verdicts = judge_run(expected, zeros_like(got), names=set(got))
    return {v.name for v in verdicts if v.passed and expected.ref[v.name].any()}


def assert_passed(verdicts: list[Verdict], what: str = "") -> None:
    """Assert every verdict passes; the failed ones in the message."""
    failed = [str(v) for v in verdicts if not v.passed]
    assert not failed, what + "; ".join(failed)


def _one_hot_rows(dtype: torch.dtype, device: torch.device, n: int = 40, d: int = 64):
    """q, k, v [1, 2, n, d] in ``dtype`` where query row i puts all its weight on key pi[i].

    q_i = 400 k_pi(i): the score of key pi(i) beats every other by 1e3 or more (|S| ~ 3e3),
    so every other P is exactly 0 (exp(-1e3), below float64's range too) and l = 1: P = 1
    at pi(i) exactly, provided backward rebuilds that score bit for bit as forward formed it."""
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(1, 2, n, d, generator=gen).to(dtype)
    pi = torch.randperm(n, generator=gen)
    q = (400 * k[:, :, pi].float()).to(dtype)
    v = torch.randn(1, 2, n, d, generator=gen).to(dtype)
    return q.to(device), k.to(device), v.to(device), pi.to(device)


def assert_scores_rebuilt_bit_for_bit(
    strategy: str,
    dtype: torch.dtype,
    device: torch.device,
    tiles: Mapping[str, int],
    head_dim: int = 64,
) -> None:
    """Assert that ``strategy``'s backward rebuilds every score forward formed, bit for bit.

    Observed where one bit would show: rows whose P is exactly one-hot at |S| ~ 3e3, where a
    score one unit off (2e-4 in float32) makes the row's P 1 +- 2e-4.  Then, bit for bit,
    dv[pi(i)] = dO[i] (dq = dk = 0: dS = P (dP - Delta) = 0 exactly, where Delta is formed like
    dP), and with dO = 0 and an lse cotangent g, dS = P g: dq[i] = s g_i k[pi(i)] and
    dk[pi(i)] = s g_i q[i] (g kept in the input dtype, as dS is for its products).
    """
    q, k, v, pi = _one_hot_rows(dtype, device, d=head_dim)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attngrad.attention(*leaves, strategy=strategy, return_lse=True, **tiles)
    scale = q.shape[-1] ** -0.5
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad((out, lse), leaves, (dout, torch.zeros_like(lse)), True)
    assert torch.equal(out, v[:, :, pi])
    assert torch.equal(dv[:, :, pi], dout)
    assert (dq == 0).all() and (dk == 0).all()
    g = torch.randn_like(lse)
    dq, dk, dv = torch.autograd.grad((out, lse), leaves, (torch.zeros_like(out), g))
    ds = g.to(dtype).to(lse.dtype)[..., None]  # dS kept in the input dtype for its products
    assert torch.equal(dq, (ds * k[:, :, pi] * scale).to(dtype))
    assert torch.equal(dk[:, :, pi], (ds * q * scale).to(dtype))
    assert (dv == 0).all()


def autograd_nodes(t: torch.Tensor) -> set[str]:
    """The class names of every node of t's autograd graph (which strategy's backward ran)."""
    seen, names, stack = set(), set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(n for n, _ in node.next_functions)
    return names
