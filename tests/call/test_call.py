"""`Call`: one attention call built once, and the same pieces for the eager and compiled routes.

The mask's pieces are made once per call whichever route runs it: the bias
and keep views of ``attn_mask`` when the `Call` is built, the band's rows
once (`BandSpec.build`: by the eager route, or by the compiled forward op,
which hands them to the backward op instead of rebuilding them).
"""

from __future__ import annotations

import pytest
import torch

import attngrad
from attngrad.call import Call
from attngrad.core.band import Band, BandSpec
from attngrad.strategies import resolve

B, H, N, D = 1, 2, 12, 4


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often `Call.build` and `Band.of` (the band's layout) ran."""
    seen = {"call": 0, "band": 0}
    build, band_of = Call.build, Band.of

    def counted_build(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen["call"] += 1
        return build(*args, **kwargs)

    def counted_band(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen["band"] += 1
        return band_of(*args, **kwargs)

    monkeypatch.setattr(Call, "build", staticmethod(counted_build))
    monkeypatch.setattr(Band, "of", staticmethod(counted_band))
    return seen


def _inputs() -> tuple[torch.Tensor, ...]:
    q, k, v = (torch.randn(B, H, N, D, dtype=torch.float64, requires_grad=True) for _ in "qkv")
    bias = torch.randn(H, N, N, dtype=torch.float64, requires_grad=True)
    return q, k, v, bias


def _attention(q, k, v, bias):  # type: ignore[no-untyped-def]
    return attngrad.attention(q, k, v, bias, window=(3, 0), strategy="flash", block_q=4)


def _step(q, k, v, bias, attention=_attention):  # type: ignore[no-untyped-def]
    out = attention(q, k, v, bias)
    out.square().sum().backward()
    return out


def test_eager_call_builds_the_call_and_the_band_once(counts: dict[str, int]) -> None:
    for calls in (1, 2):
        _step(*_inputs())
        assert counts == {"call": calls, "band": calls}


def test_compiled_call_lays_out_the_band_once_per_call(counts: dict[str, int]) -> None:
    torch._dynamo.reset()
    compiled = torch.compile(_attention, fullgraph=True, backend="aot_eager")
    inputs = _inputs()
    for calls in (1, 2):
        out = _step(*inputs, attention=compiled)
        # the forward op lays the band out; the backward op takes its rows, no second layout
        assert counts["band"] == calls
    eager = [t.detach().requires_grad_() for t in inputs]
    torch.testing.assert_close(out, _step(*eager), rtol=0, atol=0)
    for a, b in zip(inputs, eager, strict=True):
        torch.testing.assert_close(a.grad, 2 * b.grad, rtol=0, atol=0)  # two compiled steps


def test_call_holds_the_validated_call() -> None:
    q, k, v, bias = _inputs()
    call = Call.build(
        q, k, v, bias[0] > 0, 0.0, False, None, False, strategy="auto", window=(2, 0),
        block_q=None, block_k=None, return_lse=False, softcap=None, sinks=None,
        align="bottom-right", cu_seqlens_q=None, cu_seqlens_k=None, generator=None,
    )  # fmt: skip
    auto = resolve("auto", call.shapes, False, True, q.device)  # fused where it builds
    assert call.strategy == auto and call.scale == D**-0.5
    assert call.bias is None and call.keep is not None and call.keep.shape == (1, 1, N, N)
    assert call.band == BandSpec(2, 0, "bottom-right")
    mods = call.score_mods(call.band.build(N, N), None)
    assert mods.band is not None and mods.keep is call.keep


def test_strategies_base_no_longer_shadows_attention() -> None:
    import attngrad.strategies.base as base

    assert not hasattr(base, "attention")
