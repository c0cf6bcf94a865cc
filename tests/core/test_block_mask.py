"""`attngrad.create_block_mask` builds torch's ``BlockMask``, tensor for tensor, without a compiler.

Each case builds a mask with attngrad's builder and with torch's eager one
(``create_block_mask(..., _compile=False)``: four nested vmaps over every score, then a sum
per block) and requires every list of the two masks to be equal, dtype and shape included:
``kv_num_blocks``, ``kv_indices``, ``full_kv_num_blocks``, ``full_kv_indices`` and the q-side
lists torch derives from them, and ``BLOCK_SIZE``, ``seq_lengths``, ``mask_mod``.  The masks
cover what models build: causal, sliding windows, packed documents (a captured tensor),
transformers' padding, chunked and offset masks, ``and_masks`` / ``or_masks`` (torch's and
transformers'), masks that depend on b or h, B and H None or sized, lengths that are not
multiples of the block, a block larger than the sequence, ``separate_full_blocks=False``,
and a mask vmap must run (not elementwise), on one chunk of blocks and on many.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import attngrad
from attngrad.core import block_mask as block_mask_module

MaskMod = Callable[..., torch.Tensor]
LISTS = (
    "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
    "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices",
)  # fmt: skip
TORCH_BUILD = torch_flex.create_block_mask  # torch's eager builder (no patch is active here)


def assert_same_block_mask(got: object, want: object) -> None:
    for name in LISTS:
        g, w = getattr(got, name), getattr(want, name)
        assert (g is None) == (w is None), name
        if w is not None:
            assert g.dtype == w.dtype and g.shape == w.shape, (name, g.shape, w.shape)
            assert torch.equal(g, w), f"{name}:\n{g}\n!=\n{w}"
    assert got.BLOCK_SIZE == want.BLOCK_SIZE  # type: ignore[attr-defined]
    assert got.seq_lengths == want.seq_lengths  # type: ignore[attr-defined]
    assert got.mask_mod is want.mask_mod  # type: ignore[attr-defined]


def causal(b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    return i >= j


DOC = torch.arange(300) // 70  # documents of 70 tokens
PAD = torch.ones(3, 300, dtype=torch.bool)
PAD[0, :17] = False  # left padding of row 0
PAD[2, 250:] = False  # right padding of row 2
DENSE = torch.rand(2, 3, 150, 170, generator=torch.Generator().manual_seed(0)) < 0.3


def window(b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    return (i >= j) & (i - j < 50)


def documents(b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    return DOC[i] == DOC[j]


def head_window(b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    return (i - j).abs() <= 8 * (h + 1)


def chained(b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    return torch.stack([i, j]).sum(0) % 7 < 3  # a stack and a reduction: vmap runs it


def random_dense(
    b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor
) -> torch.Tensor:
    return DENSE[b, h, i, j]


def _transformers_masks() -> dict[str, tuple[MaskMod, int | None, int | None, int, int]]:
    """transformers' own mask functions, as its flex route combines them."""
    mu = pytest.importorskip("transformers.masking_utils")
    padded = mu.and_masks(mu.causal_mask_function, mu.padding_mask_function(PAD))
    sliding = mu.and_masks(
        mu.sliding_window_causal_mask_function(40), mu.padding_mask_function(PAD)
    )
    left = (~PAD).sum(-1)
    chunked = mu.chunked_causal_mask_function(64, left)
    packed = mu.and_masks(
        mu.causal_mask_function, mu.packed_sequence_mask_function(DOC.expand(3, -1))
    )
    offset = mu.add_offsets_to_mask_function(padded, 200, 0)  # a decode step of 100 after 200
    return {
        "hf-padding": (padded, 3, None, 300, 300),
        "hf-sliding-padding": (sliding, 3, None, 300, 300),
        "hf-chunked": (chunked, 3, None, 300, 300),
        "hf-packed": (packed, 3, None, 300, 300),
        "hf-offset": (offset, 3, None, 100, 300),
    }


CASES: dict[str, tuple[MaskMod, int | None, int | None, int, int]] = {
    "causal": (causal, None, None, 300, 300),
    "causal-short": (causal, None, None, 24, 24),  # one block, cut
    "causal-rect": (causal, None, None, 130, 257),
    "window": (window, None, None, 300, 257),
    "documents": (documents, None, None, 300, 300),
    "causal-documents": (torch_flex.and_masks(causal, documents), 2, None, 300, 300),
    "or-prefix": (torch_flex.or_masks(causal, lambda b, h, i, j: j < 5), None, 3, 130, 130),
    "batch-padding": (lambda b, h, i, j: PAD[b, j] & PAD[b, i], 3, None, 300, 300),
    "batch-padding-sized-h": (lambda b, h, i, j: PAD[b, j], 3, 2, 300, 300),
    "per-head": (head_window, None, 4, 200, 130),
    "per-head-batch": (lambda b, h, i, j: head_window(b, h, i, j) & PAD[b, j], 3, 4, 200, 200),
    "random": (random_dense, 2, 3, 150, 170),
    "vmap-chained": (chained, 2, None, 100, 90),
    "nothing": (lambda b, h, i, j: i < 0, None, None, 100, 100),
    "everything": (torch_flex.noop_mask, 2, 2, 100, 100),
    "constant-true": (lambda b, h, i, j: b.new_ones((), dtype=torch.bool), None, None, 64, 64),
}


def _case(name: str) -> tuple[MaskMod, int | None, int | None, int, int]:
    return _transformers_masks()[name] if name.startswith("hf-") else CASES[name]


NAMES = [*CASES, "hf-padding", "hf-sliding-padding", "hf-chunked", "hf-packed", "hf-offset"]


@pytest.mark.parametrize("block", [128, 32, (16, 64)], ids=lambda b: f"block{b}")
@pytest.mark.parametrize("name", NAMES)
def test_same_block_mask_as_torch(name: str, block: int | tuple[int, int]) -> None:
    fn, b, h, nq, nk = _case(name)
    got = attngrad.create_block_mask(fn, b, h, nq, nk, device="cpu", BLOCK_SIZE=block)
    want = TORCH_BUILD(fn, b, h, nq, nk, device="cpu", BLOCK_SIZE=block, _compile=False)
    assert_same_block_mask(got, want)


@pytest.mark.parametrize(
    "name", ["causal-documents", "per-head-batch", "vmap-chained", "hf-padding"]
)
def test_many_chunks_and_no_full_blocks(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk of one block per call of mask_mod (the bound on memory) changes nothing;
    nor does listing the full blocks as partial."""
    fn, b, h, nq, nk = _case(name)
    monkeypatch.setattr(block_mask_module, "CHUNK", 1)
    calls = []
    counted = block_mask_module._evaluate

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return counted(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(block_mask_module, "_evaluate", counting)
    for separate in (True, False):
        got = attngrad.create_block_mask(fn, b, h, nq, nk, device="cpu", BLOCK_SIZE=32,
                                         separate_full_blocks=separate)  # fmt: skip
        want = TORCH_BUILD(fn, b, h, nq, nk, device="cpu", BLOCK_SIZE=32,
                           separate_full_blocks=separate)  # fmt: skip
        assert_same_block_mask(got, want)
    assert len(calls) == 2 * (-(-nq // 32)) * (-(-nk // 32))  # one call per block


def test_dq_write_order_as_torch() -> None:
    if not hasattr(torch_flex, "_compute_dq_write_order_from_block_mask"):
        pytest.skip(f"torch {torch.__version__} has no dQ write order")
    fn, b, h, nq, nk = CASES["causal-documents"]
    got = attngrad.create_block_mask(fn, b, h, nq, nk, device="cpu", BLOCK_SIZE=32,
                                     compute_dq_write_order=True, dq_kv_order=False)  # fmt: skip
    want = TORCH_BUILD(fn, b, h, nq, nk, device="cpu", BLOCK_SIZE=32,
                       compute_dq_write_order=True, dq_kv_order=False)  # fmt: skip
    assert_same_block_mask(got, want)
    for name in ("dq_write_order", "dq_write_order_full"):
        g, w = getattr(got, name), getattr(want, name)
        assert (g is None) == (w is None) and (w is None or torch.equal(g, w)), name
    assert got.dq_kv_order_spt is want.dq_kv_order_spt is False


def test_runs_flex_attention_as_torch_mask_does() -> None:
    """The BlockMask is a torch BlockMask: attngrad's flex gives the same as with torch's."""
    fn, b, h, nq, nk = CASES["per-head-batch"]
    q = torch.randn(3, 4, nq, 8, dtype=torch.float64)
    ours = attngrad.create_block_mask(fn, b, h, nq, nk, device="cpu", BLOCK_SIZE=32)
    theirs = TORCH_BUILD(fn, b, h, nq, nk, device="cpu", BLOCK_SIZE=32)
    got = attngrad.flex_attention(q, q, q, block_mask=ours, strategy="flash")
    want = attngrad.flex_attention(q, q, q, block_mask=theirs, strategy="flash")
    assert torch.equal(got, want)


def test_compiles_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_compile=True`` (what transformers passes) is ignored: no torch.compile."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.compile was called")

    monkeypatch.setattr(torch, "compile", refuse)
    mask = attngrad.create_block_mask(causal, 2, None, 40, 40, device="cpu", _compile=True)
    assert mask.kv_num_blocks.shape == (2, 1, 1)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mask_mod": "causal"}, TypeError, "mask_mod must be a function"),
        ({"mask_mod": lambda b, h, i: i >= 0}, TypeError, "mask_mod must take 4 positional"),
        ({"mask_mod": lambda b, h, i, j: i - j}, TypeError, "must return a bool"),
        ({"mask_mod": lambda b, h, i, j: i >= j if bool(i > 3) else j > 0}, ValueError,
         "control flow"),
        ({"B": 0}, ValueError, "B must be a positive int or None, got 0"),
        ({"H": 2.0}, TypeError, "H must be an int or None .* got 2.0 of type float"),
        ({"Q_LEN": 0}, ValueError, "Q_LEN must be a positive int .* got 0"),
        ({"KV_LEN": "64"}, TypeError, "KV_LEN must be an int .* got '64'"),
        ({"BLOCK_SIZE": (16, 16, 16)}, TypeError, r"BLOCK_SIZE must be an int or a pair"),
        ({"BLOCK_SIZE": 0}, ValueError, "BLOCK_SIZE must be positive, got 0"),
        ({"device": "gpu0"}, ValueError, "device must name a device .* got 'gpu0'"),
        ({"separate_full_blocks": "yes"}, TypeError, "separate_full_blocks must be True or False"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)  # fmt: skip
def test_bad_arguments_name_the_argument(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    args: dict[str, object] = {"mask_mod": causal, "B": None, "H": None, "Q_LEN": 64,
                               "KV_LEN": 64, "device": "cpu"}  # fmt: skip
    args.update(kwargs)
    with pytest.raises(error, match=match):
        attngrad.create_block_mask(**args)  # type: ignore[arg-type]


def test_mask_of_the_wrong_shape_is_refused() -> None:
    table = torch.ones(5, 64, 64, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"mask_mod returned shape \(1, 1, 128, 128, 5\)"):
        attngrad.create_block_mask(lambda b, h, i, j: table[:, i, j], None, None, 64, 64,
                                   device="cpu")  # fmt: skip


def test_a_band_is_found_once_per_block_mask_until_what_it_reads_changes(monkeypatch):
    """Across calls the band is kept per BlockMask; an in-place change of a tensor its
    mask_mod reads (or of its block lists) makes the next call find it again."""
    from attngrad.core.block_table import BlockTable

    n = 64
    width = torch.tensor(8)
    mask = torch_flex.create_block_mask(
        lambda b, h, i, j: (i >= j) & (i - j < width), None, None, n, n, device="cpu",
        BLOCK_SIZE=16,
    )  # fmt: skip
    q = torch.randn(1, 2, n, 8)
    found = []
    real = BlockTable._exact
    monkeypatch.setattr(BlockTable, "_exact", lambda self, *a: found.append(1) or real(self, *a))
    lo, hi, _ = BlockTable.of(mask, q, q, 1).rows_of_blocks(1, q.device)
    again = BlockTable.of(mask, q, q, 1).rows_of_blocks(1, q.device)
    assert len(found) == 1 and torch.equal(again[0], lo) and torch.equal(again[1], hi)
    width.fill_(4)
    lo4, _, _ = BlockTable.of(mask, q, q, 1).rows_of_blocks(1, q.device)
    assert len(found) == 2 and torch.equal(lo4, (torch.arange(n) - 3).clamp(min=0))
