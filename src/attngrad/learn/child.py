r"""The child process of the grader: import the learner's module, grade each stage, report.

`child_main` writes one JSON event per line, which `attngrad.learn.grade`
reads; a crash or an endless loop, at import or in a stage, stays in the
child and is reported by the parent as a failed stage.

This module runs inside the child process that `attngrad.learn.grade` starts,
so it imports nothing but the standard library, torch and the child's other
modules (`attngrad.learn.grade.CHILD_MODULES`; importing the ``attngrad``
package costs seconds): the parent loads them by file path.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import torch

from attngrad.learn.engine import grade_attention, grade_function

__all__ = ["child_main"]


def _load(path: str) -> Any:
    directory = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, directory)
    spec = importlib.util.spec_from_file_location("attngrad_learner", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["attngrad_learner"] = module
    spec.loader.exec_module(module)
    return module


def child_main(argv: Sequence[str]) -> None:
    """``child_main([path, stage, ...])``: one JSON event per line on the original stdout.

    Events: ``{"event": "imported"}`` or ``{"event": "import-failed", "error": ...}``,
    then ``{"event": "start", "stage": name}`` and the stage's result dict per stage.
    The learner's own prints go to stderr.
    """
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    torch.set_num_threads(1)

    def emit(event: dict[str, Any]) -> None:
        out.write(json.dumps(event) + "\n")
        out.flush()

    path, stages = argv[0], list(argv[1:])
    try:
        module = _load(path)
    except BaseException as e:  # SystemExit and friends at import are the learner's too
        tb = traceback.format_exception_only(type(e), e)[-1].strip()
        emit({"event": "import-failed", "error": tb[:300]})
        return
    emit({"event": "imported"})
    failed: list[str] = []
    for stage in stages:
        emit({"event": "start", "stage": stage})
        fn = getattr(module, stage, None)
        if fn is None:
            res: dict[str, Any] = {
                "name": stage,
                "passed": False,
                "diagnosis": "crashed",
                "message": f"the module defines no {stage}",
                "hint": f"keep the name {stage} from the skeleton",
            }
        elif stage == "CustomAttention":
            failed = [s for s in os.environ.get("ATTNGRAD_FAILED", "").split(",") if s] + failed
            res = grade_attention(fn, failed)
        else:
            res = grade_function(stage, fn)
        if not res["passed"] and stage != "CustomAttention":
            failed.append(stage)
        emit({"event": "result", **res})
