"""Strategy "fused": flash's tiles as C++ CPU kernels, every step of a tile while it is in cache.

Same algorithm and saved tensors as "flash" (q, k, v, O and the row
statistics (m, log l), plus the caller's mask): forward is one kernel by blocks
of query rows, backward one by slabs of key blocks (dK and dV written whole, dQ
summed per slab), each tile's mask, max, exp, row sums, dropout and dS computed
between that tile's products instead of one memory pass per tensor op
(``csrc/fused.cpp``).  16-bit inputs
are computed in float32; float32 and float64 as they come.  The dropout mask
is the hash of `attngrad.core.dropout`, bit for bit; a float mask that
requires grad gets its gradient through dS written at the scores' shape
[B, Hq, Nq, Nk] and summed over the dims the mask broadcasts (that one
gradient costs O(Nq * Nk) memory).  Forward mode runs in the kernels too
(``csrc/tangent.h``: O' and lse' in one walk over each block of query rows'
key tiles, P rebuilt from the saved statistics), with every keyword, a relative score
function (its term's tangent D' added along the diagonals like a bias row, moved by its
captured tensors' tangents), a softcap written as one (the kernels' softcap) and a
program whose captured tensors do not move (its slope f'(x) from its backward program);
a program whose captured tensors move takes the shared tiled pass
(`attngrad.autograd.tangent`).  Double backward runs in the kernels too
(``csrc/second.h``, `Fused.second_order`), a program's excepted.  Where the tangents are
known before the call (torch.func.jvp, jacfwd, a forward_ad dual level), those calls get
O and O' from one pass instead (`Fused.forward_tangent`, `FusedForwardTangent`: the
online softmax carrying rowsum(E * S') and (E * S') v + E v' beside l and E v).

A FlexAttention BlockMask reaches the kernels as their band when each row keeps one
interval of keys; else as the band of its rows' non-empty blocks, its block status and
its ``mask_mod`` compiled into a mask program (`attngrad.core.score_program.compile_mask`),
which the kernels run on the partial blocks alone
(`attngrad.core.block_table.BlockTable.rows_of_blocks`); a ``mask_mod`` with an op outside
the programs' table arrives as a dense keep mask [B, Hq, Nq, Nk] instead
(`BlockTable.rows_of_keys`).  A relative score function
(``S + t(b, h, q_idx - kv_idx)``) reaches them as its term along the diagonals
(`attngrad.strategies.fused.diagonal`), added to each row like a bias row.  Any other
score function runs inside them as a program (`attngrad.core.score_program`: the function traced once
into row operations, and its pullback): forward applies it to each tile row after
the softcap, backward recomputes it from the raw scores and takes dS and the
captured tensors' gradients through it (summed per unit, then in unit order: the
same bits for any thread count).  A function with an op outside the programs'
table is refused, with the op named, and "auto" runs it on the tensor-op tiles.

The kernels are compiled once per torch version and CPU
(`attngrad.strategies.fused.build`); where they cannot be, the strategy says
what to install, and "auto" picks flash instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from attngrad.autograd.second_order import accumulators
from attngrad.core import ops
from attngrad.core.block_table import BlockTable
from attngrad.core.contract import ArgumentError, Shapes
from attngrad.core.interface import Backward, Problem, Saved
from attngrad.core.ops import compute_dtype
from attngrad.core.score_function import TERM_KEY
from attngrad.core.score_program import (
    MaskProgram,
    Program,
    compile_mask,
    encode,
    program_of,
    softcap_of,
)
from attngrad.core.scores import ScoreMods
from attngrad.strategies.base import AttentionFunction, ForwardTangentFunction
from attngrad.strategies.common import (
    KeepsOutput,
    KernelMods,
    add_kernel_gradients,
    kernel_refusal,
)
from attngrad.strategies.fused import build
from attngrad.strategies.fused.diagonal import Diagonal

__all__ = ["BLOCK_K", "BLOCK_Q", "Fused", "FusedAttention", "Tiles", "strategy"]

# Tile sizes: of 64x128, 64x256, 128x128 and 128x256, timed side by side (B=1, H=8, N=4096,
# d=64, float32, forward+backward, with and without is_causal), 128x256 and 64x256 led,
# within this machine's noise of each other.
BLOCK_Q = 128
BLOCK_K = 256


@dataclass(frozen=True)
class Tiles:
    """Rows of queries and keys per tile, as the kernels take them."""

    block_q: int
    block_k: int


def _operands(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Dense tensors in the compute dtype (16-bit inputs upcast; float32/float64 as they are)."""
    return [t.to(compute_dtype(t.dtype)).contiguous() for t in tensors]


def _mod_args(
    problem: Problem[Tiles],
) -> tuple[list[object], list[object], dict[str, object]]:
    """The ops' arguments from the mods, before and after the scale: (bias, keep (at the
    scores' [B, Hq, Nq, Nk], the bias in the compute dtype), the band's lo and hi,
    dropout's row and column words), (the softcap (0: none), the threshold,
    1 / (1 - p)) and, by name, a BlockMask's read by blocks (`_block_args`)."""
    q, k, mods = problem.q, problem.k, problem.mods
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    # the BlockMask is read here, not by KernelMods (which would make it a dense keep)
    m = KernelMods.of(replace(mods, blocks=None), shape, torch.device("cpu"), problem.dtype)
    lo, hi, keep = m.lo, m.hi, m.keep
    blocks: dict[str, object] = {}
    if mods.blocks is not None:
        lo, hi, keep, blocks = _block_args(mods.blocks, shape, problem.dtype)
    before: list[object] = [m.bias, keep, lo, hi, m.row_words, m.col_words]
    cap = m.softcap if m.softcap is not None else _softcap_mod(problem)
    return before, [0.0 if cap is None else float(cap), m.threshold, m.keep_scale], blocks


def _block_args(
    blocks: BlockTable, shape: tuple[int, int, int, int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, object]]:
    """(lo, hi, keep, by name) for a BlockMask over scores ``shape`` [B, Hq, Nq, Nk]: its
    exact band alone where it is one; else the band of its rows' blocks with its status and
    mask program (the ops' ``mask_*`` and ``status``), or, for a ``mask_mod`` that does not
    compile, the dense keep at ``shape``."""
    cpu = torch.device("cpu")
    lo, hi, status = blocks.rows_of_blocks(shape[0], cpu)
    if status is None:
        return lo, hi, None, {}
    mask = _mask_program(blocks)
    if mask is None:
        lo, hi, dense = blocks.rows_of_keys(shape[0], cpu)
        return lo, hi, None if dense is None else dense.expand(shape), {}
    code, constants, indices = _encoded(mask.program)
    captured = [
        t.to(dtype if t.is_floating_point() else torch.int64).contiguous()
        for t in (*blocks.mask.captured, *mask.made)
    ]
    bq, bk = blocks.block
    args: dict[str, object] = {
        "mask_code": code, "mask_constants": constants, "mask_indices": indices,
        "mask_out": mask.program.out, "mask_captured": captured, "mask_batch": blocks.mask.batch,
        "status": status, "mask_block_q": bq, "mask_block_k": bk,
    }  # fmt: skip
    return lo, hi, None, args


def _mask_program(blocks: BlockTable) -> MaskProgram | None:
    """The BlockMask's ``mask_mod`` compiled, or None where it does not compile (an op
    outside the programs' table, or one that reads more than one score's worth at once)."""
    mask = blocks.mask
    if not mask.elementwise:
        return None
    program = compile_mask(mask.fn, mask.captured, mask.point)
    return None if isinstance(program, str) else program


def _softcap_mod(problem: Problem[Tiles]) -> float | None:
    """c where the score function is a softcap, c * tanh(S / c), and the call has no softcap
    of its own: the kernels' softcap runs it then (`softcap_of`), no program."""
    score = problem.mods.score
    if score is None or problem.mods.softcap is not None:
        return None
    program = program_of(score, problem.dtype)
    return None if isinstance(program, str) else softcap_of(program.forward)


_ENCODED: weakref.WeakKeyDictionary[Program, tuple[torch.Tensor, ...]] = weakref.WeakKeyDictionary()


def _encoded(program: Program) -> tuple[torch.Tensor, ...]:
    """A program's (code, constants, indices) as the ops take them, once per program."""
    if program not in _ENCODED:
        ops = {name: n for n, name in enumerate(torch.ops.attngrad_fused.program_ops())}
        _ENCODED[program] = encode(program, ops)
    return _ENCODED[program]


def _diagonal(problem: Problem[Tiles]) -> tuple[Diagonal, torch.Tensor] | None:
    """A relative score function's diagonal and its D, or None (`Diagonal.of`)."""
    score = problem.mods.score
    if score is None:
        return None
    q, k = problem.q, problem.k
    return Diagonal.of(score, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), problem.dtype)


def _diagonal_tangent(
    diagonal: Diagonal, captured_dot: Sequence[torch.Tensor | None]
) -> torch.Tensor | None:
    """D' [B, Hq, Nq + Nk - 1], laid out as D: the term's tangent along its captured
    tensors' tangents (the term's push at every distance), or None where none moves."""
    if all(t is None for t in captured_dot):
        return None
    zero = diagonal.zero  # [B, 1, Hq, Nq + Nk - 1, 1], ascending i - j
    x = diagonal.term.push(zero, diagonal.distances, TERM_KEY, torch.zeros_like(zero), captured_dot)
    b, _, hq, n = zero.shape[:4]
    return x.reshape(b, hq, n).flip(-1).to(zero.dtype).contiguous()  # ascending j - i, as D


def _score_args(
    problem: Problem[Tiles], diagonal: tuple[Diagonal, torch.Tensor] | None,
    dcaptured: Sequence[object] | None,
) -> dict[str, object]:  # fmt: skip
    """The ops' arguments for the score function (none without one, or where it is a
    softcap, `_softcap_mod`): D where the function is relative (``diagonal``), else its
    program (`_program_args`); with ``dcaptured`` (backward) also whether dD is wanted."""
    if _softcap_mod(problem) is not None:
        return {}
    if diagonal is None:
        return _program_args(problem, dcaptured)
    args: dict[str, object] = {"diagonal": diagonal[1]}
    if dcaptured is not None:
        args["need_ddiagonal"] = any(d is not None for d in dcaptured)
    return args


def _program_args(
    problem: Problem[Tiles], dcaptured: Sequence[object] | None, slope: bool = False
) -> dict[str, object]:
    """The ops' score-program arguments (none without a score function): the forward
    program, the captured tensors as the kernels read them (floating ones in the compute
    dtype, the rest int64) and b's modulus; with ``dcaptured`` (backward) also the pullback
    and which captures want a gradient (an entry not None); with ``slope`` (forward mode)
    the pullback alone, whose GRAD = 1 gives the slope f'(x)."""
    score = problem.mods.score
    if score is None:
        return {}
    program = program_of(score, problem.dtype)
    assert not isinstance(program, str), program  # `Fused.refuses` said so first
    captured = [
        t.to(problem.dtype if t.is_floating_point() else torch.int64).contiguous()
        for t in (*score.captured, *program.made)
    ]
    code, constants, indices = _encoded(program.forward)
    args: dict[str, object] = {
        "code": code, "constants": constants, "indices": indices,
        "out": program.forward.out, "captured": captured, "batch": score.batch,
    }  # fmt: skip
    if dcaptured is not None or slope:
        code, constants, indices = _encoded(program.pullback)
        args.update(grad_code=code, grad_constants=constants, grad_indices=indices,
                    grad_out=program.pullback.out)  # fmt: skip
    if dcaptured is not None:
        args["wanted"] = [
            n in program.wanted and n < len(dcaptured) and dcaptured[n] is not None
            for n in range(len(captured))
        ]
    return args


def _kernel_score(problem: Problem[Tiles]) -> bool:
    """Whether the kernels take the call's score function beyond its values in every pass:
    none, a softcap written as one (`_softcap_mod`: the kernels' own softcap) or a relative
    one (`_diagonal`: its term D, moved by D' and summed back by diagonal)."""
    score = problem.mods.score
    return score is None or _softcap_mod(problem) is not None or _diagonal(problem) is not None


def _kernel_tangent(problem: Problem[Tiles], tangents: Sequence[torch.Tensor | None]) -> bool:
    """Whether the forward-mode kernels take the call along tangents = (q', k', v', bias',
    *captured'): a score function they take in every pass (`_kernel_score`), or a program
    whose captured tensors do not move (its slope f'(x) from its pullback); a program whose
    captured tensors move takes the shared tiled pass."""
    return _kernel_score(problem) or all(t is None for t in tangents[4:])


Terms = tuple[Diagonal, torch.Tensor, torch.Tensor | None]  # a relative term, its D and D'


def _direction_operands(
    problem: Problem[Tiles], direction: Sequence[torch.Tensor | None]
) -> tuple[list[torch.Tensor | None], Terms | None]:
    """A direction (q', k', v', bias', *captured') (tangents, or the cotangents of the
    gradients) as the forward-mode and second-order ops read it (None: zero): [q', k', v'
    dense in the compute dtype, bias' at the scores' [B, Hq, Nq, Nk]] and, for a relative
    score function, (its diagonal, D, D') (`_diagonal_tangent`), else None.  A softcap
    written as a score function has no tensor here: its captured tensors' directions move
    nothing."""
    t_q, t_k, t_v, t_bias, *t_captured = direction
    moved = [None if t is None else _operands(t)[0] for t in (t_q, t_k, t_v)]
    scores = (*problem.q.shape[:3], problem.k.shape[2])  # [B, Hq, Nq, Nk]
    moved.append(None if t_bias is None else t_bias.to(problem.dtype).expand(scores))
    diagonal = _diagonal(problem)
    if diagonal is None:
        return moved, None
    return moved, (*diagonal, _diagonal_tangent(diagonal[0], t_captured))


def _tangent_operands(
    problem: Problem[Tiles], tangents: Sequence[torch.Tensor | None]
) -> tuple[list[torch.Tensor | None], dict[str, object]]:
    """Both forward-mode ops' tangent operands along tangents = (q', k', v', bias',
    *captured') (`_direction_operands`) and, by name, a relative score function's D and D'
    or a program's forward and backward programs (`_program_args`)."""
    moved, terms = _direction_operands(problem, tangents)
    if terms is not None:
        return moved, {"diagonal": terms[1], "tdiagonal": terms[2]}
    if _softcap_mod(problem) is not None:
        return moved, {}
    return moved, _program_args(problem, None, slope=True)


class FusedAttention(AttentionFunction):
    """`AttentionFunction` of strategy "fused" (FusedAttentionBackward in the graph)."""


class FusedForwardTangent(ForwardTangentFunction):
    """`ForwardTangentFunction` of strategy "fused" (FusedForwardTangentBackward in the graph)."""


class Fused(KeepsOutput[Tiles]):
    """flash's tiles as C++ CPU kernels (see the module docstring)."""

    name = "fused"
    function = FusedAttention
    tangent_function = FusedForwardTangent

    def refuses(self, mods: ScoreMods) -> str | None:
        return kernel_refusal(self.name, mods, reads_blocks=True, runs_programs=True)

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Why strategy "fused" cannot run on ``device`` tensors here, or None when it can."""
        if device.type != "cpu":
            return (
                f"strategy='fused' runs on CPU tensors, got {device.type} tensors; "
                "on a CUDA GPU pick strategy='triton' (or 'flash')."
            )
        reason: str | None = build.unavailable_reason()  # constant under torch.compile
        return reason

    def tiles(
        self, shapes: Shapes, dtype: torch.dtype, block_q: int | None, block_k: int | None
    ) -> Tiles:
        """The given block sizes or BLOCK_Q x BLOCK_K (B=1, H=8, N=4096, d=64, float32 measured),
        never beyond Nq and Nk (a tile's scratch is block_q x block_k per thread).

        ArgumentError for a block size below 1.
        """
        for name, size in (("block_q", block_q), ("block_k", block_k)):
            if size is not None and size < 1:
                raise ArgumentError(f"{name}={size}: tiles need at least one row, e.g. 64 or 128.")
        bq = min(block_q or BLOCK_Q, max(1, shapes.seq_q))
        return Tiles(bq, min(block_k or BLOCK_K, max(1, shapes.seq_k)))

    def forward(self, problem: Problem[Tiles]) -> tuple[torch.Tensor, Saved]:
        """O: [B, Hq, Nq, dv] (input dtype) and {"o": O, "stats": [B, Hq, Nq, 2]} (compute dtype)."""
        library = build.load()
        qc, kc, vc = _operands(problem.q, problem.k, problem.v)
        before, after, blocks = _mod_args(problem)
        tiles = problem.tiles
        o, stats = torch.ops.attngrad_fused.forward(
            qc, kc, vc, *before, problem.scale, *after, tiles.block_q, tiles.block_k,
            library.engine_id, **_score_args(problem, _diagonal(problem), None), **blocks,
        )  # fmt: skip
        o = o.to(problem.q.dtype)
        return o, {"o": o, "stats": stats}

    def tangent(
        self,
        problem: Problem[Tiles],
        saved: Saved,
        tangents: tuple[torch.Tensor | None, ...],
        o: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """O' [B, Hq, Nq, dv] (input dtype) and lse' [B, Hq, Nq] (compute dtype) from the
        tangent kernel along tangents = (q', k', v', bias', *captured') (None: zero); None
        for a score function run as a program, which the shared tiled pass runs
        (`_kernel_tangent`).  A relative score function's term moves by D'
        (`_diagonal_tangent`)."""
        if not _kernel_tangent(problem, tangents):
            return None
        library = build.load()
        moved, by_name = _tangent_operands(problem, tangents)
        qc, kc, vc, oc = _operands(problem.q, problem.k, problem.v, o)
        stats = saved["stats"].to(qc.dtype).contiguous()
        before, after, blocks = _mod_args(problem)
        tiles = problem.tiles
        do, dlse = torch.ops.attngrad_fused.tangent(
            qc, kc, vc, oc, stats, *moved, *before, problem.scale, *after,
            tiles.block_q, tiles.block_k, library.engine_id, **blocks, **by_name,
        )  # fmt: skip
        return do.to(problem.q.dtype), dlse

    def one_pass_tangent(
        self, problem: Problem[Tiles], tangents: tuple[torch.Tensor | None, ...]
    ) -> bool:
        """The one-pass kernel takes the calls the tangent kernel takes (`_kernel_tangent`)."""
        return _kernel_tangent(problem, tangents)

    def forward_tangent(
        self, problem: Problem[Tiles], tangents: tuple[torch.Tensor | None, ...]
    ) -> tuple[torch.Tensor, Saved, torch.Tensor, torch.Tensor] | None:
        """(O, saved) as `forward` and (O', lse') as `tangent` from the one-pass kernel
        (``csrc/tangent.h``, `forward_tangent_pass`) along tangents = (q', k', v', bias',
        *captured'); None for a score function run as a program.  O and the statistics are
        `forward`'s bits: the same D (a relative term) and softcap reach the same tile steps.
        Only forward mode reaches it (never torch.compile:
        `attngrad.strategies.base.forward_tangents` declines while compiling), so the op
        has no fake."""
        if not self.one_pass_tangent(problem, tangents):
            return None
        library = build.load()
        moved, by_name = _tangent_operands(problem, tangents)
        qc, kc, vc = _operands(problem.q, problem.k, problem.v)
        before, after, blocks = _mod_args(problem)
        tiles = problem.tiles
        o, stats, do, dlse = torch.ops.attngrad_fused.forward_tangent(
            qc, kc, vc, *moved, *before, problem.scale, *after,
            tiles.block_q, tiles.block_k, library.engine_id, **blocks, **by_name,
        )  # fmt: skip
        o = o.to(problem.q.dtype)
        return o, {"o": o, "stats": stats}, do.to(problem.q.dtype), dlse

    def second_order(
        self,
        problem: Problem[Tiles],
        saved: Saved,
        cotangents: tuple[torch.Tensor | None, ...],
        dout: torch.Tensor,
        dlse: torch.Tensor | None,
        need: tuple[bool, ...],
        sums: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, ...] | None:
        """The second-order kernel (``csrc/second.h``) along the cotangents g = (g_q, g_k,
        g_v, g_bias, *g_captured); None for a score function other than a relative one or a
        softcap (a program), which the shared tiled pass runs.  A relative score function's
        captured tensors move its term by D' (`_diagonal_tangent`) and get their gradients
        from dS and S-hat summed along the diagonals (`Diagonal.second`).  ``sums``: the row
        sums over every key (`second_sums`'s layout) where these keys are some of them."""
        if not _kernel_score(problem):
            return None
        g_captured = cotangents[4:]
        need_dout, need_dlse, need_q, need_k, need_v, need_bias, *need_captured = need
        bias = problem.mods.bias
        need_bias = need_bias and bias is not None
        grad_captured = accumulators(problem.mods.captured, need_captured, problem.dtype)
        need_sums = any(g is not None for g in grad_captured)  # where a relative term holds them
        wanted = [need_dout, need_dlse, need_q, need_k, need_v, need_bias, need_sums, False]
        out, terms = self._second(problem, saved, cotangents, dout, dlse, wanted, sums)
        g_dout, r, grad_q, grad_k, grad_v, s_hat, dd, dd_hat, _ = out
        if need_sums and terms is not None:
            terms[0].second(dd, dd_hat, g_captured, grad_captured)
        grad_bias = s_hat.sum_to_size(bias.shape) if need_bias and bias is not None else None
        results = (g_dout, r, grad_q, grad_k, grad_v)
        return (
            *(t if wanted[n] else None for n, t in enumerate(results)),
            grad_bias,
            *grad_captured,
        )

    def second_sums(
        self,
        problem: Problem[Tiles],
        saved: Saved,
        cotangents: tuple[torch.Tensor | None, ...],
        dout: torch.Tensor,
    ) -> torch.Tensor | None:
        """The second-order kernel's first walk alone: this call's keys' share of the row
        sums [B, Hq, Nq, 4] (compute dtype); None where `second_order` is None."""
        if not _kernel_score(problem):
            return None
        wanted = [False] * 7 + [True]
        return self._second(problem, saved, cotangents, dout, None, wanted, None)[0][-1]

    def _second(
        self,
        problem: Problem[Tiles],
        saved: Saved,
        cotangents: Sequence[torch.Tensor | None],
        dout: torch.Tensor,
        dlse: torch.Tensor | None,
        wanted: list[bool],
        sums: torch.Tensor | None,
    ) -> tuple[tuple[torch.Tensor, ...], Terms | None]:
        """The op ``attngrad_fused.second``'s nine outputs (``csrc/fused.cpp``; ``wanted``
        its eight flags, the diagonal sums' only with a relative term), and the relative
        term's (`_direction_operands`)."""
        library = build.load()
        moved, terms = _direction_operands(problem, cotangents)
        wanted = [*wanted[:6], wanted[6] and terms is not None, wanted[7]]
        by_diagonal = {} if terms is None else {"diagonal": terms[1], "gdiagonal": terms[2]}
        qc, kc, vc, doc = _operands(problem.q, problem.k, problem.v, dout)
        stats = saved["stats"].to(qc.dtype).contiguous()
        dlse_c = None if dlse is None else dlse.to(qc.dtype).contiguous()
        sums_c = None if sums is None else sums.to(qc.dtype).contiguous()
        before, after, blocks = _mod_args(problem)
        tiles = problem.tiles
        out: tuple[torch.Tensor, ...] = torch.ops.attngrad_fused.second(
            doc, qc, kc, vc, stats, dlse_c, *moved, *before, problem.scale, *after,
            tiles.block_q, tiles.block_k, library.engine_id, wanted, **blocks, **by_diagonal,
            sums=sums_c,
        )  # fmt: skip
        return out, terms

    def backward_into(self, backward: Backward[Tiles]) -> None:
        """The backward kernel from backward.dout, its dq, dk, dv (and dS for a bias
        gradient) added into backward.grads (`attngrad.core.interface`).

        Delta = rowsum(dO * O) is formed here from saved["o"], which is `forward`'s O
        or, for ring attention's blocks, the final O of these rows over every key
        (with saved["stats"] likewise).
        """
        library = build.load()
        problem, saved, grads = backward.problem, backward.saved, backward.grads
        qc, kc, vc, doc = _operands(problem.q, problem.k, problem.v, backward.dout)
        stats = saved["stats"].to(qc.dtype).contiguous()
        # Delta = rowsum(dO * O) - dlse: lse's cotangent joins Delta, dS = P * (dP - Delta + dlse)
        delta = ops.delta(doc, saved["o"], backward.dlse, qc.dtype)
        before, after, blocks = _mod_args(problem)
        tiles = problem.tiles
        dcaptured = backward.dcaptured
        diagonal = _diagonal(problem)
        dq, dk, dv, ds, sums, dd = torch.ops.attngrad_fused.backward(
            doc, qc, kc, vc, stats, delta.contiguous(), *before, problem.scale, *after,
            tiles.block_q, tiles.block_k, library.engine_id, grads[3] is not None,
            **_score_args(problem, diagonal, dcaptured), **blocks,
        )  # fmt: skip
        add_kernel_gradients(grads, (dq, dk, dv), ds)
        if diagonal is not None and dd.numel() > 0:
            diagonal[0].pullback(dd, dcaptured)
        for total, part in zip(dcaptured, sums, strict=False):  # sums also holds `made`'s
            if total is not None:
                total += part.view(total.shape)


strategy = Fused()
