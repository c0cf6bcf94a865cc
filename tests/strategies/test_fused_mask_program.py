"""A BlockMask that is no band, on fused: its mask_mod compiled into a mask program.

A BlockMask whose rows do not each keep one interval of keys (global tokens, dilated
windows, masks that differ by head or batch) reaches fused's kernels as its block status
and its ``mask_mod`` compiled (`attngrad.core.score_program.compile_mask`): empty blocks
masked, full blocks kept without calling ``mask_mod``, partial blocks running the program
(``csrc/tile.h``, ``mask_blocks``).  Each case runs against strategy "flash" (the tensor-op
tiles, which evaluate ``mask_mod`` in PyTorch) with the same BlockMask in float64, with the
dense keep mask [B, H, Nq, Nk] forbidden (`BlockTable._dense` raises), over block sizes
that are not the tiles' and tiles that do not line up with the blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

import attngrad
import attngrad.call.flex as flex_call
from attngrad.core.block_table import BlockTable
from attngrad.core.score_program import compile_score, encode
from attngrad.strategies.fused import build
from attngrad.strategies.fused.strategy import _block_args

TOL = {"rtol": 1e-10, "atol": 1e-10}  # float64 on both sides


@pytest.fixture(scope="module", autouse=True)
def _library() -> None:
    build.load()


@pytest.fixture
def no_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building the dense keep [B, H, Nq, Nk] fails the test: the mask program must do."""

    def refuse(self: BlockTable, folded: int, device: torch.device) -> torch.Tensor:
        raise AssertionError("the dense keep mask was built")

    monkeypatch.setattr(BlockTable, "_dense", refuse)


@contextmanager
def tiles(
    monkeypatch: pytest.MonkeyPatch, block_q: int | None, block_k: int | None
) -> Iterator[None]:
    """Both strategies' tiles block_q x block_k (None: as a flex call picks them, whole
    multiples of the BlockMask's blocks)."""
    if block_q is None:
        yield
        return
    with monkeypatch.context() as m:
        m.setattr(
            flex_call, "_tiles",
            lambda strategy, shapes, dtype, blocks: strategy.tiles(shapes, dtype, block_q, block_k),
        )  # fmt: skip
        yield


@dataclass(frozen=True)
class Shape:
    b: int
    hq: int
    hkv: int
    nq: int
    nk: int
    d: int = 8

    def __str__(self) -> str:
        return f"B{self.b}-H{self.hq}x{self.hkv}-Nq{self.nq}-Nk{self.nk}"


SHAPES = [
    Shape(2, 4, 2, 100, 150),  # GQA, more keys than queries, neither a multiple of a block
    Shape(1, 2, 2, 130, 70),  # more queries than keys
]

Mask = Callable[..., torch.Tensor]


def masks(shape: Shape) -> dict[str, tuple[Mask, bool, bool]]:
    """{name: (mask_mod, depends on b, depends on h)}: none is a band."""
    g = torch.Generator().manual_seed(11)
    q_docs = torch.sort(torch.randint(0, 4, (shape.b, shape.nq), generator=g)).values
    k_docs = torch.sort(torch.randint(0, 4, (shape.b, shape.nk), generator=g)).values
    allowed = torch.rand(7, 5, generator=g) < 0.5

    def global_tokens(b, h, i, j):  # type: ignore[no-untyped-def]
        return (i < 4) | (j < 4) | (i >= j)

    def global_window(b, h, i, j):  # type: ignore[no-untyped-def]  # empty blocks inside the span
        return (i < 4) | (j < 4) | ((i - j).abs() <= 10)

    def dilated(b, h, i, j):  # type: ignore[no-untyped-def]
        return (j % 3 == 0) & (i >= j)

    def by_head(b, h, i, j):  # type: ignore[no-untyped-def]
        return torch.where(h % 2 == 0, i >= j, (i - j).abs() <= 12)

    def documents(b, h, i, j):  # type: ignore[no-untyped-def]  # doc ids per batch entry
        return (q_docs[b, i] == k_docs[b, j]) | (j == 0)

    def table(b, h, i, j):  # type: ignore[no-untyped-def]
        return allowed[i % 7, j % 5] | (i == j)

    return {
        "global": (global_tokens, False, False),
        "global-window": (global_window, False, False),
        "dilated": (dilated, False, False),
        "head": (by_head, False, True),
        "documents": (documents, True, False),
        "table": (table, False, False),
    }


def block_mask(shape: Shape, name: str, block: tuple[int, int]) -> BlockMask:
    fn, by_b, by_h = masks(shape)[name]
    return create_block_mask(
        fn, shape.b if by_b else None, shape.hq if by_h else None, shape.nq, shape.nk,
        device="cpu", BLOCK_SIZE=block,
    )  # fmt: skip


def inputs(shape: Shape, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(shape.b, shape.hq, shape.nq, shape.d, generator=g, dtype=torch.float64)
    k, v = (
        torch.randn(shape.b, shape.hkv, shape.nk, shape.d, generator=g, dtype=torch.float64)
        for _ in range(2)
    )
    dout = torch.randn(shape.b, shape.hq, shape.nq, shape.d, generator=g, dtype=torch.float64)
    return q, k, v, dout


def run(
    strategy: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    mask: BlockMask,
    score_mod: object = None,
    captured: tuple[torch.Tensor, ...] = (),
) -> tuple[torch.Tensor, ...]:
    """O and the gradients of q, k, v and ``captured`` (the score_mod's)."""
    wrt = tuple(t.detach().requires_grad_() for t in (q, k, v)) + captured
    o = attngrad.flex_attention(
        *wrt[:3], score_mod, mask, enable_gqa=q.shape[1] != k.shape[1], strategy=strategy
    )
    return (o.detach(), *torch.autograd.grad(o, wrt, dout))


def assert_close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for name, a, b in zip(("O", "dq", "dk", "dv", "dcaptured"), got, want, strict=False):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, name=name: f"{name}: {m}")


# (BLOCK_SIZE, tiles): None = the tiles a flex call picks (whole multiples of the blocks); the
# others straddle the blocks, smaller and larger than them
LAYOUTS = [((16, 16), None), ((32, 16), (48, 40)), ((16, 32), (24, 8))]


@pytest.mark.usefixtures("no_dense")
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"block{x[0][0]}x{x[0][1]}-tiles{x[1]}")
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", list(masks(SHAPES[0])))
def test_a_mask_that_is_no_band_matches_flash_without_a_dense_keep(
    name, shape, layout, monkeypatch
):
    block, tile = layout
    mask = block_mask(shape, name, block)
    q, k, v, dout = inputs(shape)
    with tiles(monkeypatch, *(tile or (None, None))):
        got = run("fused", q, k, v, dout, mask)
        want = run("flash", q, k, v, dout, mask)
    assert_close(got, want)


@pytest.mark.usefixtures("no_dense")
@pytest.mark.parametrize("name", ["dilated", "head", "documents"])
def test_a_score_mod_under_a_mask_program_matches_flash_with_its_captured_gradients(
    name, monkeypatch
):
    shape = SHAPES[0]
    mask = block_mask(shape, name, (16, 32))
    q, k, v, dout = inputs(shape, seed=1)
    g = torch.Generator().manual_seed(2)
    gate = torch.randn(shape.hq, generator=g, dtype=torch.float64, requires_grad=True)
    table = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)

    def score_mod(s, b, h, i, j):  # type: ignore[no-untyped-def]  # no relative term: a program
        return s * torch.sigmoid(gate[h]) + table[j % 5]

    with tiles(monkeypatch, 40, 24):
        got = run("fused", q, k, v, dout, mask, score_mod, (gate, table))
        want = run("flash", q, k, v, dout, mask, score_mod, (gate, table))
    assert_close(got, want)


def test_the_kernels_get_the_status_and_mask_program_not_a_keep():
    shape = SHAPES[0]
    mask = block_mask(shape, "dilated", (16, 16))
    q = torch.zeros(shape.b, shape.hq, shape.nq, shape.d)
    k = torch.zeros(shape.b, shape.hkv, shape.nk, shape.d)
    table = BlockTable.of(mask, q, k, shape.b)
    lo, hi, keep, args = _block_args(table, (shape.b, shape.hq, shape.nq, shape.nk), q.dtype)
    assert keep is None
    assert args["status"] is table.status and (args["mask_block_q"], args["mask_block_k"]) == (
        16,
        16,
    )
    assert lo.shape == hi.shape == (shape.nq,)


def test_a_mask_mod_with_an_op_outside_the_table_runs_as_a_dense_keep(monkeypatch):
    shape = SHAPES[1]

    def fmod_dilated(b, h, i, j):  # type: ignore[no-untyped-def]  # fmod: no program op
        return (torch.fmod(j, 3) == 0) & (i >= j)

    mask = create_block_mask(fmod_dilated, None, None, shape.nq, shape.nk, "cpu", BLOCK_SIZE=16)
    built = []
    dense = BlockTable._dense
    monkeypatch.setattr(BlockTable, "_dense", lambda self, *a: built.append(1) or dense(self, *a))
    q, k, v, dout = inputs(shape)
    assert_close(run("fused", q, k, v, dout, mask), run("flash", q, k, v, dout, mask))
    assert built


def test_full_blocks_are_kept_without_calling_mask_mod_and_partial_ones_call_it():
    """A BlockMask listing blocks as full where its mask_mod would drop scores, and as partial
    where it keeps every other one: torch keeps full blocks whole, calls mask_mod on partial
    ones and masks the unlisted (the kernels' three block kinds told apart)."""
    n, bs = 64, 16

    def even_keys(b, h, i, j):  # type: ignore[no-untyped-def]
        return j % 2 == 0

    # rows of blocks: 0 -> key blocks {1 partial, 2 full}; 1 -> {0 full, 3 partial}; 2, 3 ->
    # {2 partial, 0 full, 1 full}
    partial = [[1], [3], [2], [2]]
    full = [[2], [0], [0, 1], [0, 1]]

    def listed(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        num = torch.tensor([len(r) for r in rows], dtype=torch.int32)
        idx = torch.tensor([r + [0] * (4 - len(r)) for r in rows], dtype=torch.int32)
        return num[None, None], idx[None, None]

    mask = BlockMask.from_kv_blocks(
        *listed(partial), *listed(full), BLOCK_SIZE=bs, mask_mod=even_keys, seq_lengths=(n, n)
    )
    shape = Shape(1, 2, 2, n, n)
    q, k, v, dout = inputs(shape, seed=3)
    want = run("flash", q, k, v, dout, mask)
    assert_close(run("fused", q, k, v, dout, mask), want)
    # and flash's reading is torch's: the keep that says so, as a bool mask
    keep = torch.zeros(n, n, dtype=torch.bool)
    for r in range(4):
        rows = slice(r * bs, (r + 1) * bs)
        for c in partial[r]:
            keep[rows, c * bs : (c + 1) * bs] = torch.arange(c * bs, (c + 1) * bs) % 2 == 0
        for c in full[r]:
            keep[rows, c * bs : (c + 1) * bs] = True
    o = attngrad.attention(q, k, v, attn_mask=keep, strategy="flash")
    torch.testing.assert_close(want[0], o, **TOL)


def test_results_are_the_same_bits_for_any_thread_count():
    shape = Shape(2, 4, 2, 150, 150)
    mask = block_mask(shape, "global-window", (16, 16))
    q, k, v, dout = (t.float() for t in inputs(shape, seed=4))
    gate = torch.randn(shape.hq, requires_grad=True)

    def score_mod(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return s * torch.sigmoid(gate[h])

    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(run("fused", q, k, v, dout, mask, score_mod, (gate,)))
    finally:
        torch.set_num_threads(before)
    for one, two in zip(*results, strict=True):
        assert torch.equal(one, two)


@pytest.mark.usefixtures("no_dense")
def test_a_score_mod_reading_out_of_bounds_only_where_the_mask_program_drops_runs():
    """score_mod reads table[j // 3] where j % 3 == 0 and far past its end elsewhere: the
    dilated mask drops those keys, so torch never evaluates it there, nor may fused."""
    shape = Shape(1, 2, 2, 96, 96)
    mask = block_mask(shape, "dilated", (16, 16))
    table = torch.randn(32, dtype=torch.float64, requires_grad=True)

    def score_mod(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return s + table[(j % 3) * 1000 + j // 3]

    q, k, v, dout = inputs(shape, seed=5)
    got = run("fused", q, k, v, dout, mask, score_mod, (table,))
    assert_close(got, run("flash", q, k, v, dout, mask, score_mod, (table,)))

    def everywhere(b, h, i, j):  # type: ignore[no-untyped-def]  # keeps a j % 3 != 0 key
        return (j % 3 == 0) | (i == j)

    kept = create_block_mask(everywhere, None, None, 96, 96, "cpu", BLOCK_SIZE=16)
    with pytest.raises(IndexError, match="score_mod reads captured tensor"):
        run("fused", q, k, v, dout, kept, score_mod, (table,))


def test_a_mask_program_reading_out_of_bounds_in_a_partial_block_raises_index_error():
    """The table the mask_mod reads shrinks after its BlockMask was built: a partial block
    reads past its end, where torch evaluates mask_mod too."""
    shape = Shape(1, 2, 2, 64, 64)
    holder = {"table": torch.arange(64)}

    def by_table(b, h, i, j):  # type: ignore[no-untyped-def]
        return (holder["table"][j] % 3 == 0) & (i >= j)

    mask = create_block_mask(by_table, None, None, 64, 64, "cpu", BLOCK_SIZE=16)
    holder["table"] = torch.arange(40)
    q, k, v, dout = inputs(shape, seed=6)
    with pytest.raises(IndexError, match="mask_mod reads captured tensor 0 of shape"):
        run("fused", q, k, v, dout, mask)


@pytest.mark.usefixtures("no_dense")
def test_ds_is_zero_where_the_mask_program_drops_a_score_even_if_the_pullback_is_nan():
    """score_mod scales the score by w[kv_idx], infinite at the keys the dilated mask drops:
    there dS' = 0 and the pullback makes 0 * inf = NaN, which backward must zero (flex's dS
    is 0 wherever the mask drops a score).  The reference: w finite there, which changes no
    kept score.  (flash's dq is NaN on this call: its tiles do not zero dS there.)"""
    shape = Shape(1, 2, 2, 80, 80)
    mask = block_mask(shape, "dilated", (16, 16))
    j = torch.arange(80)
    w = torch.where(j % 3 == 0, 1.0 + torch.rand(80, dtype=torch.float64), 1.0)
    w_inf = torch.where(j % 3 == 0, w, torch.inf)

    def finite(s, b, h, i, kv):  # type: ignore[no-untyped-def]
        return s * w[kv]

    def infinite(s, b, h, i, kv):  # type: ignore[no-untyped-def]
        return s * w_inf[kv]

    q, k, v, dout = inputs(shape, seed=7)
    assert_close(
        run("fused", q, k, v, dout, mask, infinite), run("flash", q, k, v, dout, mask, finite)
    )


@pytest.mark.parametrize("divisor", [3, -3, 7, 1, -1, 2**31 - 1, 2**31])
def test_integer_division_by_a_uniform_divisor_is_torchs(divisor):
    """FLOORDIV_I and REMAINDER_I by a uniform divisor (``kv_idx % 3``, the mask programs'
    common case) run through doubles where that is exact, else per column: torch's results
    either way, over both signs, near 2^31 and past it."""
    nk = 64
    offsets = torch.tensor([0, -40, 2**31 - 60, -(2**31) - 3, 2**40])  # per query row

    def fn(s, b, h, i, j):  # type: ignore[no-untyped-def]
        x = j + offsets[i]
        return s + (x // divisor) * 1000 + x % divisor

    program = compile_score(fn, [offsets], torch.float64, [False])
    assert not isinstance(program, str)
    names = {name: n for n, name in enumerate(torch.ops.attngrad_fused.program_ops())}
    code, constants, indices = encode(program.forward, names)
    scores = torch.zeros(1, 1, len(offsets), nk, dtype=torch.float64)
    got, _ = torch.ops.attngrad_fused.program_rows(
        code, constants, indices, program.forward.out, [offsets, *program.made], scores, None,
        1, [False, *(False for _ in program.made)],
    )  # fmt: skip
    x = torch.arange(nk)[None, :] + offsets[:, None]
    want = (torch.floor_divide(x, divisor) * 1000 + torch.remainder(x, divisor)).double()
    assert torch.equal(got[0, 0], want)
