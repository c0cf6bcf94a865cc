"""Train a small byte-level GPT whose causal self-attention runs through attngrad.

The model is a GPT in miniature: byte embeddings (vocabulary 256) plus learned
positions, pre-norm transformer blocks (causal self-attention, a GELU MLP),
a final LayerNorm and a linear head.  Attention is
``attngrad.attention(q, k, v, is_causal=True, strategy=...)``, so its backward
is attngrad's hand-written one; ``--strategy sdpa`` runs PyTorch's
``scaled_dot_product_attention`` instead, as the baseline to compare against.

The text is one every machine has without a download: the Python standard
library's own source, the top-level ``*.py`` files next to ``os.py`` read in
sorted order, the first ``--data-bytes`` bytes of them.  (Different Python
versions ship different files; under ``--ring`` rank 0 reads the text and
broadcasts it, so the ranks always train on the same bytes.)

Everything is float32 and seeded: model init, batches, and (when
``--dropout`` > 0) attention dropout.  With the same ``--seed`` every strategy
and sdpa follow the same loss curve up to float32 rounding, and a ``--ring``
run follows the single-process one.  (With ``--dropout`` the attngrad
strategies and the ring still agree, as they draw one mask from the seed;
sdpa draws a different one.)

Single process::

    python examples/train_gpt.py                           # strategy auto, 30 steps
    python examples/train_gpt.py --strategy flash --losses flash.json
    python examples/train_gpt.py --strategy sdpa --plot sdpa.png

Two processes on one machine (the sequence sharded over the ranks, attention as
``attngrad.ring_attention`` with the zigzag layout)::

    torchrun --nproc-per-node 2 examples/train_gpt.py --ring --losses ring.json

Two machines, one process each (run on both, R = 0 on HOST and 1 on the other)::

    torchrun --nnodes 2 --node-rank R --master-addr HOST --master-port 29500 \\
        --nproc-per-node 1 examples/train_gpt.py --ring

Under ``--ring`` every rank holds the same batch and model; each rank keeps its
shard of the sequence (tokens, targets and position ids cut alike with
``attngrad.ring.shard``), the loss is the mean over the full sequence (the
ranks' sums of token losses all-reduced), and the parameter gradients are
summed over the ranks, which gives exactly the single-process gradient of
that mean.  Only rank 0 prints, writes ``--losses`` and plots.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import attngrad
from attngrad.ring import BLOCK_STRATEGIES, LAYOUTS, shard

VOCAB = 256  # bytes
# the model runs on CPU: triton's kernels need a CUDA GPU
STRATEGIES = ("sdpa", "auto", *(s for s in attngrad.STRATEGIES if s != "triton"))

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# -- data ------------------------------------------------------------------------------


def stdlib_text(n_bytes: int) -> torch.Tensor:
    """The first ``n_bytes`` bytes of the standard library's top-level ``*.py`` files,
    concatenated in sorted order, as int64 token ids [n_bytes]."""
    root = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for name in sorted(os.listdir(root)):
        if not name.endswith(".py") or total >= n_bytes:
            continue
        with open(os.path.join(root, name), "rb") as f:
            data = f.read(n_bytes - total)
        chunks.append(data)
        total += len(data)
    text = b"".join(chunks)
    if len(text) < n_bytes:
        raise SystemExit(f"only {len(text)} bytes of *.py under {root}; lower --data-bytes")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def batches(
    data: torch.Tensor, batch: int, seq: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (x, y) batches [batch, seq] of random windows, y = x shifted by one byte."""
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(len(data) - seq - 1, (batch, 1), generator=g)
        idx = start + torch.arange(seq + 1)
        window = data[idx]
        yield window[:, :-1], window[:, 1:]


# -- model -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    seq: int = 256
    d_model: int = 128
    heads: int = 4
    layers: int = 4
    tie_head: bool = False


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: Config, attend: Attend) -> None:
        super().__init__()
        self.heads, self.attend = cfg.heads, attend
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, H, n, d/H]
        a = self.attend(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + self.proj(a)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config, attend: Attend) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, attend) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, VOCAB, bias=False)
        if cfg.tie_head:
            self.head.weight = self.tok.weight
        self.apply(self._init)
        for blk in self.blocks:  # GPT-2: scale the residual projections by depth
            for lin in (blk.proj, blk.mlp[2]):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * cfg.layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens [B, n], positions [n] (global positions of these tokens) -> logits [B, n, 256]."""
        x = self.tok(tokens) + self.pos(positions)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def make_attend(strategy: str, dropout: float, ring_layout: str | None) -> Attend:
    """Causal attention over [B, H, n, d]: sdpa, one attngrad strategy, or the ring."""
    if ring_layout is not None:
        block = None if strategy == "auto" else strategy  # None: flash on CPU

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = attngrad.ring_attention(
                q, k, v, is_causal=True, layout=ring_layout, strategy=block, dropout_p=dropout
            )
            assert isinstance(out, torch.Tensor)
            return out

    elif strategy == "sdpa":

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)

    else:

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attngrad.attention(q, k, v, dropout_p=dropout, is_causal=True, strategy=strategy)

    return attend


# -- distributed -----------------------------------------------------------------------


@dataclass(frozen=True)
class Dist:
    """This process's place in the ring: rank 0 of 1 without --ring."""

    rank: int = 0
    world: int = 1
    layout: str = "zigzag"

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a [..., N] sequence (positions, tokens, targets)."""
        if self.world == 1:
            return x
        return shard(x.unsqueeze(-1), self.rank, self.world, self.layout).squeeze(-1)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t)
        return t


def init_ring(layout: str) -> Dist:
    """Join the default process group (gloo) from torchrun's environment variables."""
    if "RANK" not in os.environ:
        raise SystemExit(
            "--ring needs torchrun's environment: "
            "torchrun --nproc-per-node 2 examples/train_gpt.py --ring"
        )
    dist.init_process_group("gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), layout)


def sum_grads_(params: list[nn.Parameter], ring: Dist) -> None:
    """Sum every gradient over the ranks, in one all-reduce of a flat buffer."""
    if ring.world == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


# -- training --------------------------------------------------------------------------


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return n


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", default="auto", choices=STRATEGIES,
                   help="attngrad strategy, or sdpa for torch's scaled_dot_product_attention "
                        "(with --ring: the per-block kernel, flash or triton; auto = flash on CPU)")  # fmt: skip
    p.add_argument("--steps", type=_positive, default=30)
    p.add_argument(
        "--seq", type=int, default=256, help="sequence length (the full one under --ring)"
    )
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=5, help="steps of linear warmup, then cosine")
    p.add_argument("--min-lr", type=float, default=0.1, help="final lr, a fraction of --lr")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tie-head", action="store_true", help="share the head with the embedding")
    p.add_argument("--dropout", type=float, default=0.0, help="attention dropout_p (default 0)")
    p.add_argument("--data-bytes", type=int, default=1 << 20, help="bytes of stdlib source")
    p.add_argument("--ring", action="store_true", help="shard the sequence over torchrun's ranks")
    p.add_argument("--layout", default="zigzag", choices=LAYOUTS, help="ring layout")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--losses", default=None, help="write the per-step losses here (JSON list)")
    p.add_argument("--save", default=None, help="write the trained model's state_dict here")
    p.add_argument("--plot", default="train_gpt_loss.png", help="loss-curve PNG ('' to skip)")
    p.add_argument(
        "--compare",
        nargs="*",
        default=[],
        metavar="LABEL=PATH",
        help="other runs' --losses files to draw in the same plot",
    )
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    args = p.parse_args(argv)
    if args.ring and args.strategy not in ("auto", *BLOCK_STRATEGIES):
        p.error(f"--ring runs ring_attention, whose block kernel is one of "
                f"auto, {', '.join(BLOCK_STRATEGIES)}; got --strategy {args.strategy}")  # fmt: skip
    if args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    return args


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Step 1..steps: linear warmup to --lr over --warmup steps, then a cosine to --min-lr."""
    if step <= args.warmup:
        return args.lr * step / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr + (1 - args.min_lr) * 0.5 * (1 + math.cos(math.pi * progress)))


def plot(curves: dict[str, list[float]], path: str, title: str) -> None:
    """One loss curve per run: this one and any ``--compare`` runs, on the same axes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path} (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (label, losses) in enumerate(curves.items()):
        # later curves thinner and dashed, so identical curves stay visible
        style = {"lw": 2.5, "alpha": 0.5} if i == 0 else {"lw": 1, "ls": "--"}
        ax.plot(range(1, len(losses) + 1), losses, label=label, **style)
    ax.legend()
    ax.set(xlabel="step", ylabel="loss (nats per byte)", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"loss curve written to {path}")


def main(argv: list[str] | None = None) -> list[float]:
    """Train; returns the per-step losses (every rank gets them under --ring)."""
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    ring = init_ring(args.layout) if args.ring else Dist()
    try:
        return train(args, ring)
    finally:
        if args.ring:
            dist.destroy_process_group()


def train(args: argparse.Namespace, ring: Dist) -> list[float]:
    say = print if ring.rank == 0 else (lambda *a, **k: None)
    parts = ring.world * (2 if args.layout == "zigzag" else 1)
    if args.ring and args.seq % parts:
        raise SystemExit(
            f"--seq {args.seq} must be a multiple of {parts} ({args.layout}, {ring.world} ranks)"
        )
    if ring.rank == 0:
        data = stdlib_text(args.data_bytes)
    else:  # rank 0's text for all ranks, whatever Python each machine has
        data = torch.empty(args.data_bytes, dtype=torch.int64)
    if ring.world > 1:
        dist.broadcast(data, src=0)

    torch.manual_seed(args.seed)  # the same init on every rank
    cfg = Config(args.seq, args.d_model, args.heads, args.layers, args.tie_head)
    attend = make_attend(args.strategy, args.dropout, args.layout if args.ring else None)
    model = GPT(cfg, attend)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    positions = ring.local(torch.arange(args.seq))  # global positions of the local shard
    tokens_per_step = args.batch * args.seq

    where = f"ring of {ring.world} ({args.layout})" if args.ring else "single process"
    # what runs: under --ring, auto is ring_attention's default block kernel (flash on CPU)
    name = "flash" if args.ring and args.strategy == "auto" else args.strategy
    n_params = sum(p.numel() for p in params)
    say(f"train_gpt: strategy={name} {where}, {n_params / 1e6:.2f}M params, "
        f"{cfg.layers}x{cfg.d_model} ({cfg.heads} heads), batch {args.batch} x seq {args.seq}, "
        f"{torch.get_num_threads()} threads, {len(data)} bytes of {os.path.dirname(os.__file__)}")  # fmt: skip

    losses: list[float] = []
    times: list[float] = []
    stream = batches(data, args.batch, args.seq, args.seed)
    for step in range(1, args.steps + 1):
        x, y = (ring.local(t) for t in next(stream))
        t0 = time.perf_counter()
        logits = model(x, positions)
        loss_sum = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
        # d(global mean)/d(params) = sum over ranks of d(local sum / global count)/d(params)
        (loss_sum / tokens_per_step).backward()
        sum_grads_(params, ring)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, args)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total, count = ring.sum_(torch.tensor([loss_sum.item(), y.numel()], dtype=torch.float64))
        dt = time.perf_counter() - t0
        loss = (total / count).item()
        losses.append(loss)
        times.append(dt)
        if not args.quiet:
            say(f"step {step:3d}  loss {loss:.4f}  {dt * 1e3:7.1f} ms/step  "
                f"{tokens_per_step / dt:8.0f} tokens/s")  # fmt: skip

    steady = times[1:] or times
    mean = statistics.fmean(steady)
    say(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps; "
        f"mean step {mean * 1e3:.1f} ms (excluding the first), {tokens_per_step / mean:.0f} tokens/s, "
        f"total {sum(times):.1f} s")  # fmt: skip
    if ring.rank == 0:
        if args.losses:
            with open(args.losses, "w") as f:
                json.dump(losses, f)
        if args.save:
            torch.save(model.state_dict(), args.save)
        if args.plot:
            curves = {f"{name}, {where}": losses}
            for spec in args.compare:
                label, _, file = spec.partition("=") if "=" in spec else ("", "", spec)
                with open(file) as f:
                    curves[label or file] = json.load(f)
            plot(curves, args.plot, f"train_gpt: {args.steps} steps, seq {args.seq}")
    return losses


if __name__ == "__main__":
    main(sys.argv[1:])
