"""Ring attention against single-process flash on the same total N: time and per-rank peak memory.

    torchrun --nproc_per_node 2 benchmarks/benchmark_ring.py --seq 8192 --heads 4 --head-dim 64
        [--batch 1] [--causal] [--layout contiguous|zigzag|balanced] [--repeats 5] [--csv PATH]
        [--scheme ring|all_to_all] [--strategy NAME] [--penalty] [--documents]

``--scheme all_to_all`` runs `ring_attention`'s all-to-all scheme (H/P heads per
rank over the whole sequence) instead of the ring; ``--strategy`` is then the
local call's strategy and the single process's too (default: flash on both
sides; under the ring scheme the ring's own default per block, fused on CPU,
against single-process flash).  ``--penalty`` times a gradient penalty instead:
forward, the gradients with create_graph=True, then the gradient of the sum of
their squares (the ring's through its second-order ring pass, O(N/P) per rank).
``--documents`` packs 8 documents of mixed lengths (``DOCUMENTS``, scaled to N) under a
causal mask within each: `attngrad.flex_ring_attention` with the BlockMask built for the
full sequence on the ranks, `attngrad.flex_attention` with the same BlockMask in the
single process (``--causal`` is then implied).  ``--layout balanced`` (with ``--documents``)
cuts the ranks' shards from the sequence permuted by `attngrad.ring.balanced_layout` (whole
blocks, each rank's (query block, key block) pairs near equal) and gives the ranks the
BlockMask over the permuted positions: the same problem with its rows and keys reordered, so
the single process keeps the unpermuted sequence and mask.  Rank 0 checks that the gathered
ring output, put back in order, is the single process's.

Both run in this one torchrun job, interleaved round by round after a warm-up
round: each ring rank computes on 1 thread; then rank 0 runs single-process
flash attention over the whole sequence on as many threads as there are ranks
(2 on a 2-core machine) while the other ranks wait at a barrier.  So both
sides use the same cores.  Times are forward+backward medians; ring time is
the slowest rank's (each round ends at a barrier).

Peak memory is what forward+backward allocates beyond its inputs (q, k, v and
dO, already there), measured like `attngrad ledger` does on CPU (the
profiler's allocation events, `attngrad.tools.memory.measure_peak_bytes`): the ring
per rank, the single process for the whole sequence.  "+ inputs" adds the
input bytes each holds (its shard, or the whole sequence).  Rank 0 names its
machine (`attngrad.tools.machine`, on the single process's threads) above the table
and in every CSV row.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

import attngrad
from attngrad.cli.table import write_csv
from attngrad.ring import (
    LAYOUTS,
    balanced_layout,
    flex_ring_attention,
    ring_attention,
    shard,
    unshard,
)
from attngrad.ring.checks import SCHEMES
from attngrad.tools.machine import Machine, probe
from attngrad.tools.memory import measure_peak_bytes
from attngrad.tools.timing import interleaved, medians
from benchmark_cpu import forward_backward

MIB = 2**20
BALANCED = "balanced"  # --layout: balanced_layout's permutation, cut contiguously
DOCUMENTS = (1500, 300, 640, 100, 900, 400, 192, 64)  # lengths at N = 4096, scaled to N


def document_mask(n: int, perm: torch.Tensor | None = None) -> BlockMask:
    """The BlockMask of ``DOCUMENTS`` scaled to n positions, causal within each document; with
    ``perm`` [n] over the permuted sequence, whose position i is the original perm[i]."""
    total = sum(DOCUMENTS)
    ends = torch.tensor([round(sum(DOCUMENTS[: i + 1]) * n / total) for i in range(len(DOCUMENTS))])
    ids = torch.bucketize(torch.arange(n), ends, right=True)
    if perm is None:

        def same_document(b, h, i, j):  # type: ignore[no-untyped-def]
            return (ids[i] == ids[j]) & (i >= j)

    else:
        doc = ids[perm]

        def same_document(b, h, i, j):  # type: ignore[no-untyped-def]
            return (doc[i] == doc[j]) & (perm[i] >= perm[j])

    return create_block_mask(same_document, None, None, n, n, device="cpu")


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--layout", choices=(*LAYOUTS, BALANCED), default="contiguous")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scheme", choices=SCHEMES, default="ring")
    parser.add_argument("--strategy", default=None, help="see above (default: flash)")
    parser.add_argument("--penalty", action="store_true", help="a gradient penalty's time")
    parser.add_argument("--documents", action="store_true", help="packed documents (see above)")
    parser.add_argument("--csv", default=None, help="write the results here (rank 0)")
    args = parser.parse_args()
    if args.layout == BALANCED and not args.documents:
        parser.error("--layout balanced balances packed documents: add --documents")
    return args


def gradient_penalty(fn, q, k, v, dout, **kwargs):
    """A run of forward, first derivatives with create_graph=True, then the penalty's gradient."""

    def run() -> None:
        out = fn(q, k, v, **kwargs)
        grads = torch.autograd.grad((out * dout).sum(), (q, k, v), create_graph=True)
        torch.autograd.grad(sum(g.square().sum() for g in grads), (q, k, v))

    return run


def _gathered(
    out: torch.Tensor, world: int, layout: str, perm: torch.Tensor | None
) -> torch.Tensor:
    """Every rank's shard of the output, [B, H, N/P, d], as the full output in the sequence's
    order, [B, H, N, d] (on every rank)."""
    shards = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(shards, out)
    whole = unshard(shards, layout)
    return whole if perm is None else torch.empty_like(whole).index_copy_(-2, perm, whole)


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def main() -> None:
    args = _args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    threads = world  # the single process gets the cores the ring ranks use together

    torch.manual_seed(0)  # every rank draws the same full inputs, then keeps its shard
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    full = [torch.randn(shape) for _ in range(4)]  # q, k, v, dO
    blocks = document_mask(args.seq) if args.documents else None
    perm = balanced_layout(blocks, world) if args.layout == BALANCED else None
    layout = "contiguous" if perm is not None else args.layout  # how the ranks' shards are cut
    mine = [shard(t if perm is None else t.index_select(-2, perm), rank, world, layout)
            for t in full]  # fmt: skip
    if rank != 0:
        del full  # only rank 0 runs the single-process baseline
    q, k, v = (t.requires_grad_() for t in mine[:3])
    measure = gradient_penalty if args.penalty else forward_backward
    single_strategy = args.strategy or "flash"
    ring_strategy = args.strategy or (single_strategy if args.scheme == "all_to_all" else None)
    ring_call: Callable[..., torch.Tensor]
    if args.documents:
        ring_mask = blocks if perm is None else document_mask(args.seq, perm)
        ring_call = functools.partial(
            flex_ring_attention, block_mask=ring_mask, layout=layout, scheme=args.scheme,
            strategy=ring_strategy or "auto",
        )  # fmt: skip
    else:
        ring_call = functools.partial(
            ring_attention, is_causal=args.causal, layout=layout, scheme=args.scheme,
            strategy=ring_strategy,
        )  # fmt: skip
    ring = measure(ring_call, q, k, v, mine[3])
    with torch.no_grad():
        ring_out = _gathered(ring_call(q, k, v), world, layout, perm)

    def ring_round() -> None:
        torch.set_num_threads(1)
        ring()
        dist.barrier()  # the round lasts until the slowest rank is done

    if rank == 0:
        fq, fk, fv = (t.requires_grad_() for t in full[:3])
        if args.documents:
            single_call = functools.partial(
                attngrad.flex_attention, block_mask=blocks, strategy=single_strategy
            )
        else:
            single_call = functools.partial(
                attngrad.attention, is_causal=args.causal, strategy=single_strategy
            )
        single = measure(single_call, fq, fk, fv, full[3])
        with torch.no_grad():
            error = float((ring_out - single_call(fq, fk, fv)).abs().max())
        print(f"gathered {args.scheme} output against the single process's: max |diff| {error:.1e}")
        if not error < 1e-4:  # float32 sums in another order differ by ~1e-6
            raise SystemExit("the ranks and the single process computed different problems")

    def single_round() -> None:
        if rank == 0:
            torch.set_num_threads(threads)
            single()
        dist.barrier()  # the other ranks wait here, idle

    times = medians(interleaved({"ring": ring_round, "single": single_round}, args.repeats))

    torch.set_num_threads(1)
    ring_peak = torch.tensor(measure_peak_bytes(ring))
    dist.barrier()
    peaks = [torch.zeros_like(ring_peak) for _ in range(world)]
    dist.all_gather(peaks, ring_peak)
    if rank == 0:
        torch.set_num_threads(threads)
        single_peak = measure_peak_bytes(single)
        machine = probe(torch.float32)
        peaks_ = [int(p) for p in peaks]
        names = (f"single {single_strategy}", f"{args.scheme} P={world}")
        _report(args, world, threads, times, peaks_, single_peak, full, mine, machine, names)
    dist.barrier()
    dist.destroy_process_group()


def _report(
    args, world, threads, times, ring_peaks, single_peak, full, mine, machine: Machine, names
):
    ring_peak = max(ring_peaks)
    ring_in, single_in = _nbytes(*mine), _nbytes(*full)
    rows = [
        (names[0], threads, times["single"], single_peak, single_peak + single_in),
        (names[1], 1, times["ring"], ring_peak, ring_peak + ring_in),
    ]
    print(machine.line())
    print(
        f"B={args.batch} H={args.heads} N={args.seq} d={args.head_dim} float32 "
        f"causal={args.causal or args.documents} documents={args.documents} "
        f"layout={args.layout} scheme={args.scheme} "
        f"{'gradient penalty' if args.penalty else 'forward+backward'}; "
        f"{world} ranks x 1 thread, "
        f"single process: {threads} threads; medians of {args.repeats}"
    )
    print(f"{'path':<18}{'threads':>8}{'time':>12}{'peak':>15}{'+ inputs':>12}")
    for name, n_threads, t, peak, with_inputs in rows:
        print(
            f"{name:<18}{n_threads:>8}{t * 1e3:>9.0f} ms{peak / MIB:>11.1f} MiB"
            f"{with_inputs / MIB:>8.1f} MiB"
        )
    print(f"peak per rank: {', '.join(f'{p / MIB:.1f} MiB' for p in ring_peaks)}")
    ratios = {
        "time": times["ring"] / times["single"],
        "peak": ring_peak / single_peak,
        "peak_with_inputs": (ring_peak + ring_in) / (single_peak + single_in),
    }
    print(
        f"{args.scheme} / single: time {ratios['time']:.2f} (target <= 1.3), peak per rank "
        f"{ratios['peak']:.2f}, with inputs {ratios['peak_with_inputs']:.2f} (target <= 0.6)"
    )
    if args.csv:
        records = [
            {
                "path": name,
                "compute_threads": n_threads,
                "batch": args.batch,
                "heads": args.heads,
                "seq": args.seq,
                "head_dim": args.head_dim,
                "causal": args.causal or args.documents,
                "documents": args.documents,
                "layout": args.layout,
                "scheme": args.scheme,
                "penalty": args.penalty,
                "median_s": f"{t:.6f}",
                "peak_bytes": peak,
                "peak_with_inputs_bytes": with_inputs,
                **{f"ring_over_single_{key}": f"{r:.4f}" for key, r in ratios.items()},
            }
            for name, n_threads, t, peak, with_inputs in rows
        ]
        write_csv(records, args.csv, machine)
        print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
