"""torch.compile against eager, per strategy, on a small causal transformer's training step.

    python benchmarks/benchmark_compile.py [--seq 512] [--batch 4] [--dim 256] [--heads 4]
                                           [--layers 2] [--repeats 7] [--threads 2]

Each contender is forward+backward of the same model (pre-norm blocks: causal
self-attention through `attngrad.attention(..., strategy=s)`, or torch's SDPA as
the baseline, then an MLP), eager and under ``torch.compile`` (Inductor,
``fullgraph=True``: attngrad's attention is one op of the graph,
`attngrad.call.compiled`, and Inductor fuses the projections, norms and MLP around
it).  All contenders run once per round, rounds repeat
(`attngrad.tools.timing.interleaved`), after one warm-up round that also compiles.
Printed: the median step time, compiled/eager per strategy, and each over eager
SDPA, all from the same run.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import attngrad
from attngrad.tools.timing import interleaved, medians

STRATEGIES = ("sdpa", "explicit", "recompute", "flash")


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, strategy: str) -> None:
        super().__init__()
        self.heads, self.strategy = heads, strategy
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (t.view(b, n, self.heads, c // self.heads).transpose(1, 2) for t in (q, k, v))
        if self.strategy == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = attngrad.attention(q, k, v, is_causal=True, strategy=self.strategy)
        x = x + self.proj(y.transpose(1, 2).reshape(b, n, c))
        return x + self.mlp(self.norm2(x))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    x = torch.randn(args.batch, args.seq, args.dim)
    steps = {}
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        model = nn.Sequential(*(Block(args.dim, args.heads, strategy) for _ in range(args.layers)))
        compiled = torch.compile(model, fullgraph=True)
        for mode, m in (("eager", model), ("compiled", compiled)):

            def step(m: nn.Module = m) -> None:
                m(x).square().mean().backward()

            steps[(strategy, mode)] = step
    print(f"B={args.batch} N={args.seq} dim={args.dim} H={args.heads} layers={args.layers}, "
          f"{torch.get_num_threads()} threads; compiling (warm-up round) ...", flush=True)  # fmt: skip
    named = {f"{s} {m}": fn for (s, m), fn in steps.items()}
    t = medians(interleaved(named, repeats=args.repeats, warmup=1))
    base = t["sdpa eager"]
    print(f"{'strategy':10} {'eager ms':>9} {'compiled ms':>12} {'compiled/eager':>15} "
          f"{'eager/sdpa':>11} {'compiled/sdpa':>14}")  # fmt: skip
    for s in STRATEGIES:
        e, c = t[f"{s} eager"], t[f"{s} compiled"]
        print(
            f"{s:10} {e * 1e3:9.1f} {c * 1e3:12.1f} {c / e:15.3f} {e / base:11.3f} {c / base:14.3f}"
        )


if __name__ == "__main__":
    main()
