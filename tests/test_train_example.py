"""examples/train_gpt.py: every strategy trains the same tiny GPT as sdpa does.

The single-process runs call the example's ``main`` in this process (importing
attngrad again in a subprocess costs ~5 s); the 2-rank ring run goes through
``torch.distributed.run`` (torchrun) in a subprocess of its own, with a
timeout that kills its whole process group.

Each run is judged against sdpa's by its loss curve and by its trained
parameters (``--save``), and the bounds come from float32 rounding.  The
paths differ only in the order of their float32 sums (tiled online softmax,
recomputed P, SDPA's kernel, the ring's merge of partial results, the 2-rank
all-reduce), eps = 1.2e-7:

* losses, relative 1e-4: each step's loss agrees to ~1e-7, and Adam carries
  the rounding from step to step; measured over the example's default 30
  steps (three seeds), at most 5e-7.  (Training at a higher lr, 3e-3, turned
  chaotic near step 20 and the curves drifted apart to ~5e-4: the bound is
  for a run that is stable.)  The loss alone is a weak check of attention's
  gradients, though: at init the scores are ~0 and attention ~uniform, so
  even a zero dK moves the first six losses by only ~1e-5.
* parameters, absolute 3e-4 after the 6 AdamW steps below (peak lr 2e-3):
  Adam moves each weight by ~lr * m / sqrt(v) per step, so a component's
  rounding moves it by a small fraction of lr; measured at most 2.2e-5
  (zigzag ring), 1.7e-5 (explicit).  A 1% error in dq, dk or dv moves some
  weight by >= 1.2e-3, a zero one by >= 6.5e-3.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_gpt.py"

RTOL = 1e-4  # on the losses, relative (see the module docstring)
ATOL = 3e-4  # on the trained parameters, absolute
TINY = ["--steps", "6", "--seq", "64", "--batch", "4", "--layers", "2", "--d-model", "64",
        "--heads", "4", "--data-bytes", "65536", "--seed", "3", "--warmup", "1", "--quiet"]  # fmt: skip
RING_TIMEOUT = 180  # seconds: two ranks start in ~10-15 s on 2 cores


def _load_example():
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


train_gpt = _load_example()


Run = tuple[list[float], dict[str, torch.Tensor]]  # losses, trained parameters


def _train(tmp_path: Path, strategy: str) -> Run:
    """One in-process run: the losses written to --losses (and returned), the --save'd model."""
    out, model = tmp_path / f"{strategy}.json", tmp_path / f"{strategy}.pt"
    returned = train_gpt.main(
        [*TINY, "--strategy", strategy, "--losses", str(out), "--save", str(model), "--plot", ""]
    )
    written = json.loads(out.read_text())
    assert written == returned
    return written, torch.load(model)


def _assert_close(got: Run, want: Run, what: str) -> None:
    (losses, params), (want_losses, want_params) = got, want
    assert len(losses) == len(want_losses), what
    worst = max(abs(g - w) / abs(w) for g, w in zip(losses, want_losses, strict=True))
    assert worst <= RTOL, (
        f"{what}: losses differ by {worst:.2e} relative (> {RTOL})\n{losses}\n{want_losses}"
    )
    assert params.keys() == want_params.keys(), what
    diffs = {n: (params[n] - want_params[n]).abs().max().item() for n in want_params}
    name = max(diffs, key=diffs.__getitem__)
    assert diffs[name] <= ATOL, f"{what}: {name} differs by {diffs[name]:.2e} (> {ATOL})"


@pytest.fixture(scope="module")
def sdpa_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _train(tmp_path_factory.mktemp("sdpa"), "sdpa")


def test_the_loss_falls(sdpa_run):
    sdpa_losses, _ = sdpa_run
    assert len(sdpa_losses) == 6
    assert sdpa_losses[0] == pytest.approx(5.55, abs=0.1)  # ~ln 256: uniform over bytes at init
    assert sdpa_losses[-1] < sdpa_losses[0] - 0.3  # measured: 5.53 -> 4.89
    assert sdpa_losses[-1] < min(sdpa_losses[:3])


@pytest.mark.parametrize("strategy", ["explicit", "recompute", "flash"])
def test_every_strategy_trains_as_sdpa_does(tmp_path, sdpa_run, strategy):
    _assert_close(_train(tmp_path, strategy), sdpa_run, strategy)


def test_the_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "curve.png"
    train_gpt.main([*TINY, "--steps", "2", "--strategy", "explicit", "--plot", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ring_needs_a_block_kernel_and_torchrun(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--ring", "--strategy", "explicit"])
    assert "block kernel" in capsys.readouterr().err
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="torchrun"):
        train_gpt.main(["--ring", "--plot", ""])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_two_rank_ring_trains_as_a_single_process_does(tmp_path, sdpa_run):
    out, model = tmp_path / "ring.json", tmp_path / "ring.pt"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        str(EXAMPLE), "--ring", *TINY, "--threads", "1", "--losses", str(out), "--save", str(model), "--plot", "",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # a session of its own: on a timeout the ranks die with torchrun
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        log, _ = proc.communicate(timeout=RING_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"the ring run did not finish in {RING_TIMEOUT} s:\n{log}")
    assert proc.returncode == 0, log
    assert "ring of 2 (zigzag)" in log
    # zigzag shards, flash blocks: positions, loss and gradients as in one process
    _assert_close((json.loads(out.read_text()), torch.load(model)), sdpa_run, "2-rank ring")
