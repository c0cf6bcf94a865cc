"""The README's install: PyTorch's CPU build first, then attngrad (CI runs it: .ci/readme-install).

A bare ``pip install .`` on a CPU-only Linux machine takes PyPI's torch, a CUDA build of several
GB; the block a new user copies must put the CPU build in first, and CI must find that block.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _install_block(page: Path) -> list[list[str]]:
    """The commands of the console block after ``<!-- install: cpu -->``, as argv lists."""
    text = page.read_text(encoding="utf-8")
    found = re.search(r"<!-- install: cpu -->\n```console\n(.*?)```", text, re.DOTALL)
    assert found, f"{page.name} has no ```console block under <!-- install: cpu -->"
    return [shlex.split(line, comments=True) for line in found[1].splitlines() if line.strip()]


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_install_takes_the_cpu_build_of_torch_before_attngrad(page: str) -> None:
    commands = _install_block(ROOT / page)
    torch_at = next(
        i
        for i, c in enumerate(commands)
        if c[:2] == ["pip", "install"] and any(a.startswith("torch") for a in c[2:])
    )
    torch = commands[torch_at]
    assert torch[torch.index("--index-url") + 1].endswith("/whl/cpu"), torch
    attngrad_at = commands.index(["pip", "install", "."])
    assert torch_at < attngrad_at  # the other order resolves torch from PyPI: CUDA


def test_ci_follows_the_readme_install_and_rejects_cuda_wheels() -> None:
    script = (ROOT / ".ci" / "readme-install").read_text(encoding="utf-8")
    assert "<!-- install: cpu -->" in script and "nvidia-" in script
    assert "torch.version.cuda is None" in script
    assert "bash .ci/readme-install" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
