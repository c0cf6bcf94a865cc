"""The ring's work under a block-sparse mask, and a permutation of the sequence that balances it.

Under a mask that leaves most (query block, key block) pairs empty -- packed
documents, causal or not, or any BlockMask -- the ring scheme computes only
the pairs that hold a kept score (`attngrad.ring.flex_ring_attention`).  With
the sequence cut into P shards of whole blocks, let

    W[r, c] = the pairs of rank r's query blocks against rank c's key blocks

(`rank_pairs`).  Ring step s computes W[r, (r - s) mod P] on rank r, and in
backward the ranks wait on each other at every step (the dK/dV accumulators
that rank r - 1 filled at step s - 1 travel on to rank r for step s), so a
call lasts about

    T = sum over s of max over r of W[r, (r - s) mod P]

pair computations, against sum(W) / P when every step is even.  Rank totals
alone (`rank_work`, the row sums) can be equal while T is not: two documents
whose blocks fall on rank 0 as queries and on rank 1 as keys load step 1 of
rank 0 and step 0 of rank 1.

`balanced_layout` moves whole blocks: largest first into the lightest rank
with room, swaps between the heaviest and the lightest rank while one narrows
their spread (equal totals), then swaps of one block of rank a with one of
rank b that lower T, the best for each two ranks in turn, until none does.  A
swap that lowers T may unsettle the totals: it is taken only where every rank's
total stays within `TOTALS_SLACK` (10%) of the mean, or of the spread the first
stage left where whole blocks allow no closer.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from attngrad.core.contract import ArgumentError
from attngrad.ring.layout import shard

__all__ = ["balanced_layout", "block_work", "rank_pairs", "rank_work"]

TOTALS_SLACK = 0.1  # how far from the mean the step swaps may move a rank's total


def _pair_counts(spec: Any, block: int, is_causal: bool) -> tuple[torch.Tensor, int]:
    """(M, block): M int64 [QB, KB], M[i, j] the (batch entry, head) entries in which query
    block i holds a kept score against key block j (0 or 1 for packed documents), and the
    block size (a BlockMask's own).  ``spec`` as for `block_work`."""
    num = getattr(spec, "kv_num_blocks", None)
    if num is not None:
        block_q, block_k = (int(x) for x in spec.BLOCK_SIZE)
        blocks_k = -(-int(spec.seq_lengths[1]) // block_k)
        counts = torch.zeros(num.shape[-1], blocks_k, dtype=torch.int64)
        for name in ("", "full_"):
            n, idx = getattr(spec, name + "kv_num_blocks"), getattr(spec, name + "kv_indices")
            if n is None:
                continue
            n, idx = n.cpu(), idx.cpu().long()
            listed = torch.arange(idx.shape[-1]) < n[..., None]  # [Bm, Hm, QB, K]
            rows = torch.arange(idx.shape[-2])[:, None].expand(idx.shape[-2:])
            counts.index_put_((rows.expand(idx.shape)[listed], idx[listed]),
                              torch.ones((), dtype=torch.int64), accumulate=True)  # fmt: skip
        return counts, block_q
    bounds = [int(x) for x in (spec.tolist() if isinstance(spec, torch.Tensor) else spec)]
    n = bounds[-1] if bounds else 0
    if len(bounds) < 2 or bounds[0] != 0 or any(a > b for a, b in itertools.pairwise(bounds)):
        raise ArgumentError(
            f"cu_seqlens must rise from 0 to N, [0, ..., N], got {bounds[:8]}"
            f"{' ...' if len(bounds) > 8 else ''}."
        )
    if not isinstance(block, int) or block < 1:
        raise ArgumentError(f"block must be a positive int, got {block!r}.")
    doc = torch.zeros(n, dtype=torch.int64)  # each position's document
    starts = torch.tensor(bounds[1:-1], dtype=torch.int64)
    doc[starts[starts < n]] += 1
    doc = doc.cumsum(0)
    first = torch.tensor(bounds, dtype=torch.int64)[doc]  # each position's document start
    last = torch.tensor(bounds[1:], dtype=torch.int64)[doc] - 1  # and end
    r0 = torch.arange(0, n, block)
    r1 = torch.clamp(r0 + block, max=n) - 1  # the block's rows r0 .. r1 see keys lo .. hi
    lo = first[r0] // block
    hi = (r1 if is_causal else last[r1]) // block
    key = torch.arange(len(r0))
    return ((key >= lo[:, None]) & (key <= hi[:, None])).long(), block


def block_work(spec: Any, block: int = 128, is_causal: bool = True) -> list[int]:
    """The (query block, key block) pairs each query block computes: its key blocks that
    hold a kept score.  ``spec``: packed documents' cumulative lengths [0, ..., N] (a 1-D
    int tensor or a sequence; query i sees the keys of its own document, up to its own
    with ``is_causal``) cut into blocks of ``block``, or a torch BlockMask (its partial and
    full blocks per query block, summed over its batch entries and heads; ``block`` and
    ``is_causal`` are its own then).

    >>> block_work([0, 6, 8], block=2)   # documents 0-5 and 6-7, causal
    [1, 2, 3, 1]
    """
    return _pair_counts(spec, block, is_causal)[0].sum(1).tolist()  # type: ignore[no-any-return]


def _fill(weights: list[int], world: int) -> list[list[int]]:
    """The blocks split into ``world`` groups of equal count, loads near equal: largest
    first into the lightest group with room, then swaps between the heaviest and the
    lightest group while they narrow the spread."""
    per = len(weights) // world
    groups: list[list[int]] = [[] for _ in range(world)]
    loads = [0] * world
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        r = min((r for r in range(world) if len(groups[r]) < per), key=lambda r: (loads[r], r))
        groups[r].append(i)
        loads[r] += weights[i]
    for _ in range(len(weights) ** 2):
        a, b = max(range(world), key=loads.__getitem__), min(range(world), key=loads.__getitem__)
        gap = loads[a] - loads[b]
        best = min(
            ((x, y) for x in groups[a] for y in groups[b] if 0 < weights[x] - weights[y] < gap),
            key=lambda xy: abs(gap - 2 * (weights[xy[0]] - weights[xy[1]])),
            default=None,
        )
        if best is None:
            break
        x, y = best
        groups[a][groups[a].index(x)], groups[b][groups[b].index(y)] = y, x
        moved = weights[x] - weights[y]
        loads[a], loads[b] = loads[a] - moved, loads[b] + moved
    return [sorted(g) for g in groups]


def _ring_time(w: torch.Tensor) -> torch.Tensor:
    """T (module docstring) of each W [..., P, P]: sum over s of max over r of W[r, r - s]."""
    p = w.shape[-1]
    r = torch.arange(p)
    c = (r[None, :] - r[:, None]) % p  # [s, r]: rank r's key rank at step s
    return w[..., r[None, :].expand(p, p), c].amax(-1).sum(-1)


def _even_steps(counts: torch.Tensor, groups: list[list[int]]) -> list[list[int]]:
    """``groups`` after swaps of one block between two ranks that lower the ring's time T
    (module docstring): for each two ranks in turn the swap that lowers it most while every
    rank's total stays within ``TOTALS_SLACK`` of the mean (or of the spread ``groups``
    have, if wider), passes over every two ranks until one swaps nothing.

    A swap of block x of rank a with block y of rank b moves x's pairs as a query from
    row a of W to row b (its counts against each rank's keys, out[x]) and as a key from
    column a to column b (in[x]), y's the other way:

        W' = W + u (out[x] - out[y])^T + (in[x] - in[y]) u^T + u u^T (M[x,x] + M[y,y]
             - M[x,y] - M[y,x]),    u = e_b - e_a,

    evaluated for every (x, y) of the two ranks at once.  Counts in float64: exact.
    """
    world, m = len(groups), counts.double()
    rank = torch.empty(m.shape[0], dtype=torch.int64)
    for r, g in enumerate(groups):
        rank[g] = r
    eye = torch.eye(world, dtype=torch.float64)
    out, into = m @ eye[rank], m.T @ eye[rank]  # [QB, P]: each block's pairs against each rank
    w = eye[rank].T @ out  # [P, P]
    now = float(_ring_time(w))
    mean = float(m.sum()) / world
    spread = max(TOTALS_SLACK * mean, float((w.sum(1) - mean).abs().max()))
    swapped = True
    while swapped:
        swapped = False
        for a, b in itertools.combinations(range(world), 2):
            xs, ys = (rank == a).nonzero()[:, 0], (rank == b).nonzero()[:, 0]
            u = eye[b] - eye[a]
            self_pairs = (m[xs, xs][:, None] + m[ys, ys][None, :] - m[xs][:, ys]
                          - m[ys][:, xs].T)  # fmt: skip
            moved = (
                w
                + u[:, None] * (out[xs][:, None, None, :] - out[ys][None, :, None, :])
                + (into[xs][:, None, :, None] - into[ys][None, :, :, None]) * u[None, :]
                + self_pairs[..., None, None] * (u[:, None] * u[None, :])
            )  # [|xs|, |ys|, P, P]
            times = (
                _ring_time(moved)
                .masked_fill((moved.sum(-1) - mean).abs().amax(-1) > spread, torch.inf)
                .view(-1)
            )
            i = int(times.argmin())
            if float(times[i]) >= now:
                continue
            x, y = int(xs[i // len(ys)]), int(ys[i % len(ys)])
            now, w, swapped = float(times[i]), moved.view(-1, world, world)[i], True
            rank[x], rank[y] = b, a
            for t, along in ((out, m[:, x] - m[:, y]), (into, m[x] - m[y])):
                t[:, a] -= along
                t[:, b] += along
    return [sorted((rank == r).nonzero()[:, 0].tolist()) for r in range(world)]


def balanced_layout(
    spec: Any, world: int, block: int = 128, is_causal: bool = True
) -> torch.Tensor:
    """A permutation of the sequence's positions that gives each ring step of ``world``
    ranks an equal share of the work under a block-sparse mask (`block_work`: packed
    documents, causal or not, or a BlockMask; module docstring).

    Returns perm: int64 [N], whole blocks moved; rank r holds the positions
    ``perm[r N/P : (r+1) N/P]`` (its blocks in their order in the sequence): cut
    ``x.index_select(-2, perm)`` with ``shard(..., layout="contiguous")``, and build the
    mask over the permuted positions (``mask_mod(b, h, perm[i], perm[j])``).  Rank r's
    step s computes its query blocks against rank r - s's key blocks, the pairs that hold
    a kept score: `rank_pairs` counts them, `rank_work` each rank's total.  Under a
    causal mask of packed documents, "zigzag" balances one document but not many of mixed
    lengths; this does, step by step.  Needs N divisible by ``block * world``.

    >>> cu = [0, 8, 12, 16]   # causal documents of 8, 4 and 4 positions
    >>> perm = balanced_layout(cu, 2, block=2)
    >>> rank_pairs(cu, 2, perm, block=2), rank_pairs(cu, 2, "zigzag", block=2)
    ([[6, 2], [2, 6]], [[6, 0], [4, 6]])
    """
    counts, block = _pair_counts(spec, block, is_causal)
    n = int(spec.seq_lengths[0]) if hasattr(spec, "kv_num_blocks") else int(spec[-1])
    if not isinstance(world, int) or world < 1:
        raise ArgumentError(f"world must be an int >= 1, got {world!r}.")
    if n % (block * world):
        raise ArgumentError(
            f"balanced_layout moves whole blocks of {block} and gives each of the {world} "
            f"ranks as many, so N = {n} must be a multiple of {block * world}; pad the "
            "sequence or pick a block size that divides N / world."
        )
    groups = _even_steps(counts, _fill(counts.sum(1).tolist(), world))
    order = [b for group in groups for b in group]
    return (torch.tensor(order, dtype=torch.int64)[:, None] * block + torch.arange(block)).flatten()


def rank_pairs(
    spec: Any, world: int, layout: str | torch.Tensor, block: int = 128, is_causal: bool = True
) -> list[list[int]]:
    """``W``, P × P: the (query block, key block) pairs of rank r's query blocks against rank c's
    key blocks that hold a kept score under ``spec`` (as `block_work`), the sequence cut by
    ``layout``: "contiguous", "zigzag", or a permutation of positions (`balanced_layout`)
    cut contiguously.  Ring step s computes ``W[r][(r - s) mod P]`` on rank r.  Each rank's
    chunks must be whole blocks (else ValueError).

    >>> rank_pairs([0, 16], 2, "contiguous", block=2), rank_pairs([0, 16], 2, "zigzag", block=2)
    ([[10, 0], [16, 10]], [[10, 8], [8, 10]])
    """
    counts, block = _pair_counts(spec, block, is_causal)
    n = counts.shape[0] * block
    positions = torch.arange(n) if isinstance(layout, str) else layout
    if isinstance(layout, str):
        positions = torch.cat([shard(positions[:, None], r, world, layout)[:, 0]
                               for r in range(world)])  # fmt: skip
    per = n // world
    if n % world or (per % block and not isinstance(layout, str)):
        raise ArgumentError(f"N = {n} does not split into {world} shards of whole blocks.")
    owned = [sorted({int(x) // block for x in positions[r * per : (r + 1) * per].tolist()})
             for r in range(world)]  # fmt: skip
    if sum(map(len, owned)) != counts.shape[0]:
        raise ArgumentError(
            f"layout={layout if isinstance(layout, str) else 'a permutation'!r} cuts blocks of "
            f"{block} between two ranks (N = {n}, P = {world}); each rank's chunks must be "
            "whole blocks."
        )
    return [[int(counts[mine][:, theirs].sum()) for theirs in owned] for mine in owned]


def rank_work(
    spec: Any, world: int, layout: str | torch.Tensor, block: int = 128, is_causal: bool = True
) -> list[int]:
    """Each rank's (query block, key block) pairs under ``spec`` (as `block_work`) when the
    sequence is cut by ``layout`` (as `rank_pairs`, whose rows these are the sums of).

    >>> rank_work([0, 16], 2, "contiguous", block=2), rank_work([0, 16], 2, "zigzag", block=2)
    ([10, 26], [18, 18])
    """
    return [sum(row) for row in rank_pairs(spec, world, layout, block, is_causal)]
