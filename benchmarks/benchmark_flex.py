"""What FlexAttention's score and mask functions cost on attngrad's strategies, as ratios.

    python benchmarks/benchmark_flex.py [--seq 4096] [--strategy auto] [--repeats 5]
                                        [--memory-seq 16384] [--no-memory] [--no-torch]
                                        [--mask-seq 2048] [--masks-only]
                                        [--csv results/benchmark_flex.csv]

Forward+backward (O, then dq, dk, dv and the captured tensors' gradients) of
``attngrad.flex_attention`` on one strategy ("auto": fused's kernels on CPU, with score
functions compiled into them), B=1, H=8, d=64, float32, every variant timed once per
round and the rounds interleaved (`attngrad.tools.timing.interleaved`), so the machine's
noise falls on all alike; a ratio is the fastest round over its baseline's.

    causal       attention(q, k, v, is_causal=True)                     the baseline
    blockmask    flex_attention(block_mask=causal BlockMask)            target <= 1.15x causal
    packed       flex_attention(block_mask=8 causal documents of N/8)   target <= 0.25x causal
    alibi        score_mod=ALiBi, fixed slopes, causal                  (reported)
    alibi-learn  ALiBi with learnable slopes [H]                        target <= 1.15x blockmask
    relative     a learnable relative-position table [H, 2N-1]          target <= 1.15x blockmask
    buckets      a learnable T5 bucket table [H, 32]                    target <= 1.15x blockmask
    gate         score * sigmoid(g[h]), g learnable                     target <= 1.15x blockmask
    softcap-mod  softcap written as a score_mod, c * tanh(s / c)        target <= 1.15x blockmask

Beside them: the forward alone with ALiBi and with the relative table against torch's own
compiled CPU ``flex_attention`` (``torch.compile(flex_attention)``, the one CPU path torch
has, forward only: it has no CPU backward), target <= 0.7x each; forward+backward against
SDPA's FLASH_ATTENTION kernel on the causal mask (reported); and the first call of a new
score function (its trace and programs) against a later call, target <= 20 s more.

Masks that are no band (``--mask-seq``, default 2048; B=1, H=8, d=64, float32,
forward+backward; ``--masks-only`` runs this part alone), time and peak bytes beyond the
inputs, each against the same BlockMask read as a dense keep [B, H, Nq, Nk] (its mask
program turned off: fused's path before mask programs; reported):

    dilated      (kv_idx % 3 == 0) & causal: every block below the diagonal partial
    global       16 global tokens and a causal window of 512: empty blocks inside each
                 row's span, skipped

Memory (``--memory-seq``, default 16384; B=1, H=4, d=64): the peak bytes beyond the inputs
of forward+backward and of double backward with a learnable relative-position table
[H, 2N-1], against the same strategy without a score function (both causal); target
within 2x.  Exit 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex

import attngrad
from attngrad.strategies.fused import strategy as fused_strategy
from attngrad.tools.memory import format_bytes, measure_peak_bytes
from attngrad.tools.timing import interleaved, spreads

DOCUMENTS = 8
BUCKETS = 32
SCORE_TARGET = 1.15  # each learnable score function against the BlockMask alone
TARGETS = {
    "blockmask": ("causal", 1.15), "packed": ("causal", 0.25),
    **{name: ("blockmask", SCORE_TARGET)
       for name in ("alibi-learn", "relative", "buckets", "gate", "softcap-mod")},
}  # fmt: skip
FORWARD_TARGET = 0.7  # forward with ALiBi or the relative table against torch's compiled flex
FIRST_CALL_TARGET = 20.0  # seconds a new score function's first call may add
GLOBAL_TOKENS, WINDOW = 16, 512  # the "global" mask: Longformer's shape, made causal


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def causal(b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    return i >= j


def t5_bucket(distance: torch.Tensor, buckets: int = BUCKETS, reach: int = 128) -> torch.Tensor:
    """T5's causal relative-position bucket of i - j (0 for j > i): exact below buckets/2,
    logarithmic above, the last bucket from ``reach`` on."""
    distance = distance.clamp(min=0)
    exact = buckets // 2
    far = (
        exact
        + (
            torch.log(distance.float().clamp(min=1) / exact)
            / math.log(reach / exact)
            * (buckets - exact)
        ).long()
    )
    return torch.where(distance < exact, distance.long(), far.clamp(max=buckets - 1))


def variants(n: int, heads: int, strategy: str) -> dict[str, Callable[..., torch.Tensor]]:
    """{variant: q, k, v -> O} (module docstring)."""
    mask = create_block_mask(causal, None, None, n, n, device="cpu")
    doc = torch.arange(n) // (n // DOCUMENTS)

    def packed_mask(
        b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor
    ) -> torch.Tensor:
        return (doc[i] == doc[j]) & (i >= j)

    docs = create_block_mask(packed_mask, None, None, n, n, device="cpu")
    fixed = torch.exp2(-8 * torch.arange(1, heads + 1) / heads)
    slopes = fixed.clone().requires_grad_()
    table = (0.1 * torch.randn(heads, BUCKETS)).requires_grad_()
    relative_table = (0.1 * torch.randn(heads, 2 * n - 1)).requires_grad_()
    gates = torch.randn(heads).requires_grad_()

    def alibi(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return s - fixed[h] * (i - j)

    def alibi_learn(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return s - slopes[h] * (i - j)

    def relative(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return s + relative_table[h, i - j + n - 1]

    def buckets(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return s + table[h, t5_bucket(i - j)]

    def gate(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return s * torch.sigmoid(gates[h])

    def softcap(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return 20.0 * torch.tanh(s / 20.0)

    def flex(**kw: object) -> Callable[..., torch.Tensor]:
        return lambda q, k, v: attngrad.flex_attention(q, k, v, strategy=strategy, **kw)

    return {
        "causal": lambda q, k, v: attngrad.attention(q, k, v, is_causal=True, strategy=strategy),
        "blockmask": flex(block_mask=mask),
        "packed": flex(block_mask=docs),
        "alibi": flex(score_mod=alibi, block_mask=mask),
        "alibi-learn": flex(score_mod=alibi_learn, block_mask=mask),
        "relative": flex(score_mod=relative, block_mask=mask),
        "buckets": flex(score_mod=buckets, block_mask=mask),
        "gate": flex(score_mod=gate, block_mask=mask),
        "softcap-mod": flex(score_mod=softcap, block_mask=mask),
        "sdpa-flash": _sdpa_flash,
    }


def dilated(b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    return (j % 3 == 0) & (i >= j)


def global_window(
    b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor
) -> torch.Tensor:
    return (i < GLOBAL_TOKENS) | (j < GLOBAL_TOKENS) | ((i >= j) & (i - j < WINDOW))


MASKS = {"dilated": dilated, "global": global_window}


@contextlib.contextmanager
def dense_keep() -> Iterator[None]:
    """fused reads a BlockMask that is no band as a dense keep [B, H, Nq, Nk], as before mask
    programs (its mask_mod taken for one that does not compile)."""
    with mock.patch.object(fused_strategy, "_mask_program", lambda blocks: None):
        yield


def mask_calls(n: int, strategy: str) -> dict[str, Callable[[], object]]:
    """{variant: forward+backward}: the causal BlockMask, each of `MASKS` through its mask
    program and as a dense keep ("<name>-dense"); B=1, H=8, d=64, float32."""
    heads, d = 8, 64
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, heads, n, d, generator=g).requires_grad_() for _ in range(3))
    do = torch.randn(1, heads, n, d, generator=g)
    blocks = {name: create_block_mask(fn, None, None, n, n, device="cpu")
              for name, fn in {"blockmask": causal, **MASKS}.items()}  # fmt: skip

    def call(mask: object, dense: bool = False) -> Callable[[], object]:
        def run() -> object:
            with dense_keep() if dense else contextlib.nullcontext():
                out = attngrad.flex_attention(q, k, v, block_mask=mask, strategy=strategy)
                return torch.autograd.grad(out, (q, k, v), do)

        return run

    calls = {"blockmask": call(blocks["blockmask"])}
    for name in MASKS:
        calls[name] = call(blocks[name])
        calls[f"{name}-dense"] = call(blocks[name], dense=True)
    return calls


def time_masks(n: int, strategy: str, repeats: int) -> dict[str, float]:
    """Fastest forward+backward round of each of `mask_calls`, seconds."""
    times = interleaved(mask_calls(n, strategy), repeats=repeats, warmup=1)
    return {name: s.low for name, s in spreads(times).items()}


def mask_peaks(n: int, strategy: str) -> dict[str, int]:
    """Peak bytes beyond the inputs of each of `mask_calls`."""
    out = {}
    for name, run in mask_calls(n, strategy).items():
        _note(f"memory: {name} at N={n}")
        out[name] = measure_peak_bytes(run)
    return out


def report_masks(
    n: int, strategy: str, repeats: int
) -> list[tuple[str, str, float, float | None, str]]:
    """Rows (what, against, ratio, target, verdict) of the masks that are no band."""
    best, peak = time_masks(n, strategy, repeats), mask_peaks(n, strategy)
    print(f"\nmasks that are no band, forward+backward, {strategy}, B=1 H=8 N={n} d=64 "
          f"float32, fastest of {repeats} interleaved rounds; peak bytes beyond the inputs")  # fmt: skip
    for name, seconds in best.items():
        print(f"  {name:14s} {seconds * 1e3:9.1f} ms  {format_bytes(peak[name]):>12s}")
    rows: list[tuple[str, str, float, float | None, str]] = []
    for name in MASKS:
        rows.append((f"{name} time", f"{name}-dense", best[name] / best[f"{name}-dense"], None, ""))
        rows.append((f"{name} peak", f"{name}-dense", peak[name] / peak[f"{name}-dense"], None, ""))
        rows.append((f"{name} time", "blockmask", best[name] / best["blockmask"], None, ""))
    return rows


def _sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def time_variants(n: int, strategy: str, repeats: int) -> dict[str, float]:
    """Fastest forward+backward round of every variant, seconds."""
    heads, d = 8, 64
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, heads, n, d, generator=g) for _ in range(4))
    inputs = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_())
    calls = {
        name: (lambda fn=fn: torch.autograd.grad(fn(*inputs), inputs, do))
        for name, fn in variants(n, heads, strategy).items()
    }
    times = interleaved(
        calls, repeats=repeats, warmup=1, on_round=lambda r: _note(f"round {r + 1}")
    )
    return {name: s.low for name, s in spreads(times).items()}


def time_forward_vs_torch(n: int, strategy: str, repeats: int) -> dict[str, float]:
    """{score function: attngrad's fastest forward over torch's compiled flex_attention's}
    for causal ALiBi and a relative-position table [H, 2N-1], no grad."""
    heads, d = 8, 64
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, heads, n, d, generator=g) for _ in range(3))
    mask = create_block_mask(causal, None, None, n, n, device="cpu")
    fixed = torch.exp2(-8 * torch.arange(1, heads + 1) / heads)
    table = 0.1 * torch.randn(heads, 2 * n - 1, generator=g)

    def alibi(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return s - fixed[h] * (i - j)

    def relative(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return s + table[h, i - j + n - 1]

    compiled = torch.compile(torch_flex)
    calls = {}
    for name, fn in (("alibi", alibi), ("relative", relative)):
        calls[f"ours {name}"] = torch.no_grad()(
            lambda fn=fn: attngrad.flex_attention(q, k, v, fn, mask, strategy=strategy)
        )
        calls[f"torch {name}"] = torch.no_grad()(
            lambda fn=fn: compiled(q, k, v, score_mod=fn, block_mask=mask)
        )
        _note(f"compiling torch's flex_attention for {name} (once)")
        calls[f"torch {name}"]()
    times = spreads(interleaved(calls, repeats=repeats, warmup=1))
    return {
        name: times[f"ours {name}"].low / times[f"torch {name}"].low
        for name in ("alibi", "relative")
    }


def first_call(n: int, strategy: str) -> tuple[float, float]:
    """(seconds, seconds): forward+backward of a score function never seen before in this
    process (its trace and programs made on the way), and of the same call again."""
    heads, d = 8, 64
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, heads, n, d, generator=g).requires_grad_() for _ in range(3))
    mask = create_block_mask(causal, None, None, n, n, device="cpu")
    w = torch.randn(heads, 16, generator=g).requires_grad_()

    def fresh(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return s * torch.sigmoid(w[h, (i - j).abs() % 16]) + torch.log(1 + torch.exp(-s.abs()))

    def run() -> float:
        start = time.perf_counter()
        out = attngrad.flex_attention(q, k, v, fresh, mask, strategy=strategy)
        torch.autograd.grad(out.sum(), (q, k, v, w))
        return time.perf_counter() - start

    return run(), run()


def peaks(n: int, strategy: str) -> dict[str, int]:
    """Peak bytes beyond the inputs: forward+backward and double backward, with and
    without a learnable relative-position table [H, 2N-1] (both causal)."""
    heads, d = 4, 64
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, heads, n, d, generator=g).requires_grad_() for _ in range(3))
    table = torch.zeros(heads, 2 * n - 1, requires_grad=True)
    mask = create_block_mask(causal, None, None, n, n, device="cpu")

    def relative(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return s + table[h, i - j + n - 1]

    def call(score: object) -> torch.Tensor:
        if score is None:
            return attngrad.attention(q, k, v, is_causal=True, strategy=strategy)
        return attngrad.flex_attention(q, k, v, score, mask, strategy=strategy)

    def first(score: object) -> Callable[[], object]:
        wrt = (q, k, v) if score is None else (q, k, v, table)
        return lambda: torch.autograd.grad(call(score).sum(), wrt)

    def second(score: object) -> Callable[[], object]:
        wrt = (q, k, v) if score is None else (q, k, v, table)

        def run() -> object:
            grads = torch.autograd.grad(call(score).square().sum(), wrt, create_graph=True)
            return torch.autograd.grad(sum(gr.square().sum() for gr in grads), wrt)

        return run

    out = {}
    for name, run in (("first plain", first(None)), ("first table", first(relative)),
                      ("second plain", second(None)), ("second table", second(relative))):  # fmt: skip
        _note(f"memory: {name} at N={n}")
        out[name] = measure_peak_bytes(run)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory-seq", type=int, default=16384)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-torch", action="store_true", help="skip torch's compiled flex")
    parser.add_argument("--mask-seq", type=int, default=2048)
    parser.add_argument("--masks-only", action="store_true", help="only the masks of no band")
    parser.add_argument("--csv", help="write the rows here (none by default; '' for none)")
    args = parser.parse_args()
    if args.seq % DOCUMENTS:
        parser.error(f"--seq must be a multiple of {DOCUMENTS} (the packed documents)")
    rows: list[tuple[str, str, float, float | None, str]] = []  # what, against, ratio, ...
    met = True if args.masks_only else _other_variants(args, rows)
    rows += report_masks(args.mask_seq, args.strategy, args.repeats)
    print("\nratios (fastest rounds):")
    for what, against, ratio, target, verdict in rows:
        goal = "" if target is None else f"  target <= {target}: {verdict}"
        print(f"  {what} / {against}: {ratio:.3f}{goal}")
    if args.csv:
        path = Path(args.csv)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["variant", "baseline", "ratio", "target", "verdict"])
            w.writerows(rows)
    return 0 if met else 1


def _other_variants(
    args: argparse.Namespace, rows: list[tuple[str, str, float, float | None, str]]
) -> bool:
    """The score functions' variants, torch's compiled flex, the first call and memory
    (module docstring), their rows added to ``rows``; whether every target was met."""
    best = time_variants(args.seq, args.strategy, args.repeats)
    print(f"\nforward+backward, {args.strategy}, B=1 H=8 N={args.seq} d=64 float32, fastest of "
          f"{args.repeats} interleaved rounds")  # fmt: skip
    for name, seconds in best.items():
        print(f"  {name:12s} {seconds * 1e3:9.1f} ms")
    met = True
    for name, (base, target) in TARGETS.items():
        ratio = best[name] / best[base]
        ok = ratio <= target
        met = met and ok
        rows.append((name, base, ratio, target, "met" if ok else "MISSED"))
    rows.append(("alibi", "blockmask", best["alibi"] / best["blockmask"], None, ""))
    rows.append(("causal", "sdpa-flash", best["causal"] / best["sdpa-flash"], None, ""))
    rows.append(("blockmask", "sdpa-flash", best["blockmask"] / best["sdpa-flash"], None, ""))
    if not args.no_torch:
        for name, ratio in time_forward_vs_torch(args.seq, args.strategy, args.repeats).items():
            ok = ratio <= FORWARD_TARGET
            met = met and ok
            rows.append((f"{name} forward", "torch compiled flex", ratio, FORWARD_TARGET,
                         "met" if ok else "MISSED"))  # fmt: skip
    first, again = first_call(args.seq, args.strategy)
    added = first - again
    ok = added <= FIRST_CALL_TARGET
    met = met and ok
    print(f"  a new score function: first call {first:.2f} s, again {again:.2f} s")
    rows.append(("new score_mod, first call s - later call s", "-", added, FIRST_CALL_TARGET,
                 "met" if ok else "MISSED"))  # fmt: skip
    if not args.no_memory:
        p = peaks(args.memory_seq, args.strategy)
        for order in ("first", "second"):
            ratio = p[f"{order} table"] / p[f"{order} plain"]
            ok = ratio <= 2.0
            met = met and ok
            print(f"  peak {order}: table {format_bytes(p[f'{order} table'])}, "
                  f"plain {format_bytes(p[f'{order} plain'])}")  # fmt: skip
            rows.append((f"peak {order} order, table [H, 2N-1], N={args.memory_seq}",
                         "no score_mod", ratio, 2.0, "met" if ok else "MISSED"))  # fmt: skip
    return met


if __name__ == "__main__":
    raise SystemExit(main())
