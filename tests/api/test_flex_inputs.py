"""`attngrad.flex_attention` refuses what it cannot run, with errors that name the argument.

Each bad argument raises TypeError (a wrong type or dtype) or ValueError (a wrong value),
before anything is computed, with a message that names the argument and says what to do.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask

import attngrad

N = 20  # two blocks of 16: the second one cut


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = (torch.randn(2, 2, N, 8) for _ in range(3))
    return q, k, v


def _with_mask_mod(mask_mod: Any) -> BlockMask:
    """A BlockMask whose blocks are all partial, with ``mask_mod`` as it is (create_block_mask
    would call it first and fail in torch's own checks)."""
    num = torch.full((1, 1, 2), 2, dtype=torch.int32)
    idx = torch.tensor([[[[0, 1], [0, 1]]]], dtype=torch.int32)
    return BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16, mask_mod=mask_mod, seq_lengths=(N, N))


def _if_on_a_value(s: torch.Tensor, b: Any, h: Any, i: Any, j: Any) -> torch.Tensor:
    if s > 0:  # Python control flow on a score
        return s
    return -s


W = torch.ones(3, requires_grad=True)

BAD_SCORE_MODS = {
    "three-arguments": (lambda s, b, h: s, TypeError, "score_mod must take 5"),
    "not-callable": (3, TypeError, "score_mod must be a function"),
    "returns-int": (lambda s, b, h, i, j: i - j, TypeError, "score_mod must return"),
    "returns-bool": (lambda s, b, h, i, j: s > 0, TypeError, "score_mod must return"),
    "returns-two-scores": (
        lambda s, b, h, i, j: torch.stack([s, s]),
        TypeError,
        r"score_mod must return .* shape \(2,\)",
    ),
    "if-on-a-tensor": (_if_on_a_value, ValueError, "score_mod uses a tensor's value"),
    "item": (lambda s, b, h, i, j: s * s.item(), ValueError, "score_mod uses a tensor's value"),
}


@pytest.mark.parametrize("name", BAD_SCORE_MODS)
def test_a_bad_score_mod(name: str) -> None:
    score_mod, error, match = BAD_SCORE_MODS[name]
    with pytest.raises(error, match=match):
        attngrad.flex_attention(*_inputs(), score_mod)


BAD_BLOCK_MASKS = {
    "mask-returns-int": (
        lambda: _with_mask_mod(lambda b, h, i, j: i - j),
        TypeError,
        "mask_mod must return a bool",
    ),
    "mask-three-arguments": (
        lambda: _with_mask_mod(lambda b, h, i: i > 0),
        TypeError,
        "mask_mod must take 4",
    ),
    "mask-reads-a-tensor-that-requires-grad": (
        lambda: _with_mask_mod(lambda b, h, i, j: j <= i + W[0]),
        ValueError,
        "mask_mod reads a tensor that requires grad",
    ),
    "mask-if-on-a-tensor": (
        lambda: _with_mask_mod(lambda b, h, i, j: (j <= i) if i > 3 else (j > i)),
        ValueError,
        "mask_mod uses a tensor's value",
    ),
    "built-for-longer-queries": (
        lambda: create_block_mask(lambda b, h, i, j: j <= i, None, None, N + 4, N, device="cpu"),
        ValueError,
        r"block_mask was built for \(Q_LEN, KV_LEN\) = \(24, 20\)",
    ),
    "built-for-longer-keys": (
        lambda: create_block_mask(lambda b, h, i, j: j <= i, None, None, N, 32, device="cpu"),
        ValueError,
        r"block_mask was built for \(Q_LEN, KV_LEN\) = \(20, 32\)",
    ),
    "built-for-another-batch": (
        lambda: create_block_mask(lambda b, h, i, j: j <= i, 3, None, N, N, device="cpu"),
        ValueError,
        r"block_mask has \(B, H\) = \(3, 1\)",
    ),
    "a-tensor-mask": (lambda: torch.ones(N, N, dtype=torch.bool), TypeError, "block_mask must be"),
}


@pytest.mark.parametrize("name", BAD_BLOCK_MASKS)
def test_a_bad_block_mask(name: str) -> None:
    make, error, match = BAD_BLOCK_MASKS[name]
    with pytest.raises(error, match=match):
        attngrad.flex_attention(*_inputs(), block_mask=make())


@pytest.mark.parametrize(
    ("strategy", "score_mod", "why"),
    [
        ("triton", lambda s, b, h, i, j: s * 2, "call a Python score_mod"),
        ("fused", lambda s, b, h, i, j: torch.sin(s), "aten.sin"),  # outside its programs' ops
    ],
    ids=["triton", "fused"],
)
def test_the_kernel_strategies_refuse_a_score_mod_naming_why(
    strategy: str, score_mod: object, why: str
) -> None:
    """triton's kernels run no score function, fused's those its programs can express: the
    error names the strategy, what it does not run, and the strategies that do; "auto"
    warns once with the same reason and runs it on the tensor-op tiles."""
    with pytest.raises(
        ValueError, match=rf"strategy='{strategy}' cannot run this call: .*{why}.*'flash'"
    ):
        attngrad.flex_attention(*_inputs(), score_mod, strategy=strategy)
    if strategy == "fused":
        with pytest.warns(RuntimeWarning, match=rf"instead of 'fused': .*{why}"):
            attngrad.flex_attention(*_inputs(), score_mod)


def test_other_bad_arguments() -> None:
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="flex_attention takes 4-D query"):
        attngrad.flex_attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="return_lse=True and return_aux"):
        attngrad.flex_attention(q, k, v, return_lse=True, return_aux=AuxRequest(lse=True))
    with pytest.raises(TypeError, match="kernel_options must be a dict"):
        attngrad.flex_attention(q, k, v, kernel_options=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="enable_gqa"):
        attngrad.flex_attention(q, k[:, :1], v[:, :1])
    attngrad.flex_attention(q, k, v, kernel_options={"BLOCK_M": 64})  # accepted, ignored


def test_a_refused_call_changes_nothing() -> None:
    """A call refused after its score_mod ran once (to find its captures) leaves the
    captures' gradients and the inputs as they were."""
    q, k, v = (t.requires_grad_() for t in _inputs())
    slopes = torch.ones(2, requires_grad=True)
    before = [t.detach().clone() for t in (q, k, v, slopes)]
    with pytest.raises(ValueError):
        attngrad.flex_attention(
            q, k, v, lambda s, b, h, i, j: s + slopes[h] * (j - i), strategy="triton"
        )
    assert all(t.grad is None for t in (q, k, v, slopes))
    assert all(torch.equal(t, b) for t, b in zip((q, k, v, slopes), before, strict=True))
