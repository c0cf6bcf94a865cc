"""Grade a learner's solution of the attention-backward exercise (`attngrad.learn.exercise`).

``grade(path)`` imports the learner's module in a child process (so a crash or an
endless loop, at import or in a function, is reported as a failed stage rather
than suffered) and grades each TODO function on its own, fed the reference's
correct inputs, then ``CustomAttention`` end to end.  The stages and their right
answers live in `attngrad.learn.stages`, the catalogue of known mistakes in
`attngrad.learn.mistakes`, the engine that grades a stage in `attngrad.learn.engine`
and the child's loop in `attngrad.learn.child`; the learner's source is never read.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attngrad.learn.stages import STAGES

__all__ = ["CHILD_MODULES", "Report", "Stage", "grade"]

# importing torch in the child is not the learner's time
_BOOT_TIMEOUT = 120.0
# the child's modules, each importing only the ones before it (and torch): the child loads
# them by file path under their own names, so their imports of one another find them loaded
# and the ``attngrad`` package, whose import costs seconds, is never imported
CHILD_MODULES = ("stages", "mistakes", "engine", "child")
_BOOTSTRAP = (
    "import importlib.util, json, os, sys\n"
    "for name in sys.argv[2].split(','):\n"
    "    path = os.path.join(sys.argv[1], name + '.py')\n"
    "    spec = importlib.util.spec_from_file_location('attngrad.learn.' + name, path)\n"
    "    m = importlib.util.module_from_spec(spec)\n"
    "    sys.modules[spec.name] = m\n"
    "    spec.loader.exec_module(m)\n"
    "print(json.dumps({'event': 'boot'}), flush=True)\n"
    "m.child_main(sys.argv[3:])\n"
)


@dataclass
class Stage:
    name: str
    passed: bool
    diagnosis: str | None
    message: str
    hint: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "passed": self.passed,
            "diagnosis": self.diagnosis,
            "message": self.message,
        }


@dataclass
class Report:
    path: str
    stages: list[Stage] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.stages) and all(s.passed for s in self.stages)

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "stages": [s.as_dict() for s in self.stages]}


def _stage(d: dict[str, Any]) -> Stage:
    return Stage(
        d["name"], bool(d["passed"]), d.get("diagnosis"), d.get("message", ""), d.get("hint", "")
    )


def _run_child(
    path: Path, stages: list[str], failed: list[str], timeout: float
) -> tuple[list[Stage], str | None, str]:
    """One child over ``stages``: the stages it finished, the one it hung in (if any),
    and why it ended early ('' when it did not)."""
    env = dict(os.environ, ATTNGRAD_FAILED=",".join(failed), PYTHONUNBUFFERED="1")
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _BOOTSTRAP,
                str(Path(__file__).parent),
                ",".join(CHILD_MODULES),
                str(path),
                *stages,
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=str(path.parent),
        )
        events: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                events.put(line)
            events.put(None)

        threading.Thread(target=read, daemon=True).start()
        done: list[Stage] = []
        current: str | None = "<import>"
        wait = _BOOT_TIMEOUT
        why = ""
        try:
            while True:
                try:
                    line = events.get(timeout=wait)
                except queue.Empty:
                    why = "timeout"
                    break
                if line is None:
                    break
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                kind = event.pop("event", None)
                wait = timeout
                if kind == "import-failed":
                    return [], "<import>", "import failed: " + str(event.get("error", ""))
                if kind == "imported":
                    current = None
                elif kind == "start":
                    current = event["stage"]
                elif kind == "result":
                    done.append(_stage(event))
                    current = None
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if why == "timeout":
            return done, current, "timeout"
        if len(done) < len(stages):
            err.seek(0)
            tail = err.read().strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
            return done, current, "crashed: " + tail[0][:200]
        return done, None, ""


def grade(path: str | os.PathLike[str], timeout: float = 30.0) -> Report:
    """Grade the learner's module at ``path``: each stage gets ``timeout`` seconds."""
    file = Path(path).resolve()
    report = Report(str(path))
    if not file.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    todo = list(STAGES)
    while todo:
        failed = [s.name for s in report.stages if not s.passed]
        done, stuck, why = _run_child(file, todo, failed, timeout)
        report.stages += done
        todo = todo[len(done) :]
        if not why:
            break
        if stuck == "<import>" or stuck is None:
            kind = "timeout" if why == "timeout" else "crashed"
            text = (
                f"importing the module did not finish in {timeout:g} s" if why == "timeout" else why
            )
            hint = (
                "remove the top-level code that never ends"
                if kind == "timeout"
                else "run `python FILE` and fix the error at import"
            )
            report.stages += [Stage(s, False, kind, text, hint) for s in todo]
            break
        if why == "timeout":
            message = f"did not return within {timeout:g} s"
            hint = "look for a loop that never ends"
        else:
            message, hint = why, "run the function yourself and read the traceback"
        report.stages.append(Stage(stuck, False, why.split(":")[0], message, hint))
        todo = todo[todo.index(stuck) + 1 :]
        if why == "timeout" and "CustomAttention" in todo:
            # its backward calls the function that hung: it would hang as well
            todo.remove("CustomAttention")
            report.stages.append(
                Stage(
                    "CustomAttention",
                    False,
                    "timeout",
                    f"not run: backward calls {stuck}, which did not return",
                    f"fix {stuck} first",
                )
            )
    order = {name: i for i, name in enumerate(STAGES)}
    report.stages.sort(key=lambda s: order[s.name])
    return report
