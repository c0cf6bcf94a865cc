"""One launch of a group of spawned gloo processes per test session, shared by the workers.

A test module defines its worker, ``worker(rank, store, out_dir)``, which joins the group
through the FileStore ``store`` and saves its results under ``out_dir``; `shared_run`
launches it once per pytest session (pytest-xdist's workers share the launch through a file
lock in their common temporary folder) and returns the folder.  The processes fork from a
server that imported the test module once (torch and attngrad cost ~2.5 s of CPU to
import, a spawned process each), before any thread or computation: each rank then starts in
milliseconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from filelock import FileLock


def join(rank: int, store: str, world: int) -> dict[int, dist.ProcessGroup | None]:
    """In a worker: one thread, join the gloo group of ``world`` ranks through the FileStore
    ``store``; the groups of the first 2 .. world ranks by size (every rank makes each; None
    for the whole group, the default one)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    groups: dict[int, dist.ProcessGroup | None] = {
        w: dist.new_group(list(range(w))) for w in range(2, world)
    }
    groups[world] = None
    return groups


def launch(
    worker: Callable[[int, str, str], None],
    module: str,
    out_dir: Path,
    world: int,
    deadline: float = 90.0,
) -> list[int | None]:
    """Run ``worker`` on ``world`` processes forked from a server that preloaded ``module``;
    their exit codes (a worker still running at ``deadline`` seconds is killed)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([module])
    procs = [
        ctx.Process(target=worker, args=(rank, str(out_dir / "store"), str(out_dir)))
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():  # never leave a worker behind, even when the test fails
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def shared_run(
    tmp_path_factory, worker_id: str, name: str, start: Callable[[Path], list[int | None]]
) -> tuple[Path, list[int | None]]:
    """``start(folder)`` once per session (under a file lock), its exit codes saved beside
    the results; returns (the folder, the exit codes)."""
    root = tmp_path_factory.getbasetemp()
    root = root if worker_id == "master" else root.parent
    out = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not (out / "exits.pt").exists():
            out.mkdir(exist_ok=True)
            torch.save(start(out), out / "exits.pt")
    return out, torch.load(out / "exits.pt")
