"""Every ```python block of README.md and docs/*.md runs, in page order, and every
``>>>`` example of the package's docstrings (the API reference shows them).

The blocks of one page share one namespace, as a reader who pastes them one after
another would, so a page runs as one test. A block that needs what the suite does not
have (a CUDA GPU, several processes under torchrun) is preceded by sybil's directive
``<!-- skip: next "why" -->`` and reported here as a skipped test with that reason.
Shell blocks (```console, ```bash) are not run.
"""

from __future__ import annotations

import doctest
import importlib
import re
import unittest
from pathlib import Path

import pytest
from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

import attngrad

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"^[ \t]*<!-- skip: next (?P<reason>.*?) -->", re.MULTILINE)  # as sybil reads it
DOCS = Sybil(parsers=[PythonCodeBlockParser(), SkipParser()])


def _page_id(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _skipped_blocks() -> list[object]:
    """One param per skip directive: where it is (page:line) and the reason it gives."""
    params = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in SKIP.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            where = f"{_page_id(page)}:{line}"
            params.append(pytest.param(where, match["reason"], id=where))
    return params


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_page_examples_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # an example that writes files writes them here
    for example in DOCS.parse(page):
        try:
            example.evaluate()
        except unittest.SkipTest:
            continue  # reported by test_skipped_block_says_why


@pytest.mark.parametrize(("where", "reason"), _skipped_blocks())
def test_skipped_block_says_why(where: str, reason: str) -> None:
    assert re.fullmatch(r'"[^"]+"', reason), (
        f'{where}: a skipped block must say why, as <!-- skip: next "reason" -->; got {reason!r}'
    )
    pytest.skip(f"{where}: {reason.strip(chr(34))}")


def _modules_with_examples() -> list[str]:
    """The package's modules whose docstrings hold ``>>>`` examples (the API pages show them)."""
    src = Path(attngrad.__file__).parent
    names = []
    for path in sorted(src.rglob("*.py")):
        if ">>>" in path.read_text(encoding="utf-8"):
            parts = path.relative_to(src.parent).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


@pytest.mark.parametrize("name", _modules_with_examples())
def test_docstring_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in finder.find(module, name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, result  # a torchrun-only example is all comments: 0 attempted
