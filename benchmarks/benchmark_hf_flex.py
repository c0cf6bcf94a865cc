"""How long a Hugging Face model with ``attn_implementation="flex_attention"`` waits, cold.

    python benchmarks/benchmark_hf_flex.py [--rounds 1] [--steps 3] [--threads 1]
                                           [--csv results/benchmark_hf_flex.csv]

A tiny Llama (2 layers, hidden 64, 4 heads, 2 kv heads, vocab 128, random weights from its
config), batch 2, trained with SGD under `attngrad.patch_flex_attention()`, in a fresh
process per run with a fresh, empty ``TORCHINDUCTOR_CACHE_DIR`` (a cold compile cache):

    first step    the first training step at N = 32 (forward, backward, optimizer step)
    again         a second step at N = 32
    new length    the first step at N = 48
    steady        the mean of ``--steps`` more steps at N = 48

two ways, one after the other, ``--rounds`` times:

    attngrad      the patch as it is: transformers' ``create_block_mask(_compile=True)``
                  calls build the BlockMask with `attngrad.create_block_mask`, no compiler
    compiled      the same patch with transformers' BlockMask builder left as it is
                  (torch's ``create_block_mask`` under ``torch.compile``: an Inductor
                  compile of the mask per new shape), the baseline

Each run also counts the frames Dynamo compiled.  Prints every run and, per measure, the
fastest run of each way and compiled / attngrad; the CSV holds the same with the machine's
columns (`attngrad.tools.machine.probe`).  The fused strategy's C++ kernels are built
first, once, when this machine has none ("auto" may use them; they are not a compile
cache and are not what is measured).  Targets: first step <= 3 s and new length <= 1 s
on 2 cores; exit 1 when one is missed.  ``--threads`` sets torch's intra-op threads in every
run (default torch's): a model this small gains nothing from a second thread, and on a
machine other work keeps busy, two threads spin-wait on each other in every op.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

MEASURES = ("first step", "again", "new length", "steady")
TARGETS = {"first step": 3.0, "new length": 1.0}  # seconds, attngrad's way
WAYS = ("attngrad", "compiled")
FIRST_N, NEW_N, BATCH = 32, 48, 2


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def child(way: str, steps: int, threads: int | None) -> None:
    """One cold run: prints a JSON line of the measures (seconds) and Dynamo's frame count."""
    start = time.perf_counter()
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    import transformers.integrations.flex_attention as hf_flex
    import transformers.masking_utils as masking_utils
    from torch._dynamo.utils import counters
    from torch.nn.attention import flex_attention as torch_flex
    from transformers import LlamaConfig, LlamaForCausalLM

    import attngrad

    imported = time.perf_counter() - start
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128)  # fmt: skip
    model = LlamaForCausalLM._from_config(config, attn_implementation="flex_attention")
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(n: int) -> float:
        ids = torch.randint(0, config.vocab_size, (BATCH, n))
        begin = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - begin

    torch_builder = torch_flex.create_block_mask  # before the patch rebinds it
    with attngrad.patch_flex_attention():
        if way == "compiled":  # transformers' own builder: torch's, with _compile=True
            masking_utils.create_block_mask = torch_builder
            hf_flex.create_block_mask = torch_builder
        out = {"first step": step(FIRST_N), "again": step(FIRST_N), "new length": step(NEW_N)}
        out["steady"] = sum(step(NEW_N) for _ in range(steps)) / steps
    out["import"] = imported
    out["dynamo frames"] = counters["frames"]["total"]
    print(json.dumps(out))


def run(way: str, steps: int, threads: int | None) -> dict[str, float]:
    """One fresh process with an empty Inductor cache of its own."""
    command = [sys.executable, __file__, "--child", way, "--steps", str(steps)]
    if threads is not None:
        command += ["--threads", str(threads)]
    with tempfile.TemporaryDirectory(prefix="hf-flex-inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        done = subprocess.run(
            command,
            env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the {way} run failed:\n{done.stderr}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _build_fused() -> None:
    """The fused kernels, built now if this machine has none (announced by the build)."""
    from attngrad.strategies.fused import build

    try:
        build.load()
    except build.BuildError as err:  # "auto" then runs without them
        _note(f"fused kernels unavailable ({str(err).splitlines()[0]}); runs go without them")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=1, help="runs of each way")
    parser.add_argument("--steps", type=int, default=3, help="steady steps at the new length")
    parser.add_argument(
        "--threads", type=int, help="intra-op threads of every run (default torch's)"
    )
    parser.add_argument("--csv", default="results/benchmark_hf_flex.csv")
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1:
        parser.error(f"--rounds and --steps must be at least 1, got {args.rounds}, {args.steps}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    if args.child:
        child(args.child, args.steps, args.threads)
        return 0

    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)

    from attngrad.cli.table import write_csv
    from attngrad.tools.machine import probe

    _build_fused()
    machine = probe(torch.float32)
    print(machine.line(), flush=True)
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    for r in range(args.rounds):
        for way in WAYS:
            if way == "compiled":
                _note(f"round {r + 1}: compiled -- transformers' BlockMask builder, an Inductor "
                      "compile per new shape: tens of seconds on a CPU ...")  # fmt: skip
            else:
                _note(f"round {r + 1}: attngrad ...")
            result = run(way, args.steps, args.threads)
            runs[way].append(result)
            shown = ", ".join(f"{m} {result[m]:.2f} s" for m in MEASURES)
            print(f"  {way:9s} {shown}, Dynamo frames {result['dynamo frames']:.0f}", flush=True)
    print(f"\ntiny Llama, batch {BATCH}, N = {FIRST_N} then {NEW_N}, cold Inductor cache, "
          f"{torch.get_num_threads()} thread(s), fastest of {args.rounds} run(s):")  # fmt: skip
    print(f"  {'':12s} {'attngrad':>10s} {'compiled':>10s} {'compiled/attngrad':>18s}")
    records: list[dict[str, object]] = []
    met = True
    for m in MEASURES:
        ours, theirs = (min(x[m] for x in runs[way]) for way in WAYS)
        target = TARGETS.get(m)
        verdict = "" if target is None else ("met" if ours <= target else "MISSED")
        met = met and verdict != "MISSED"
        goal = "" if target is None else f"   target <= {target:g} s: {verdict}"
        print(f"  {m:12s} {ours:9.2f}s {theirs:9.2f}s {theirs / ours:17.1f}x{goal}")
        records.append({"measure": m, "attngrad_s": round(ours, 4), "compiled_s": round(theirs, 4),
                        "compiled_over_attngrad": round(theirs / ours, 2),
                        "target_s": "" if target is None else target, "verdict": verdict})  # fmt: skip
    frames = {way: max(x["dynamo frames"] for x in runs[way]) for way in WAYS}
    print(f"  Dynamo frames compiled per run: attngrad {frames['attngrad']:.0f}, "
          f"compiled {frames['compiled']:.0f}")  # fmt: skip
    if args.csv:
        write_csv(records, args.csv, machine)
        print(f"wrote {args.csv}")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
