"""The command outputs these pages quote, produced by the commands themselves.

A quoted output is a fenced block whose first line is the command, ``$ attngrad ...``, and
whose other lines are what it printed on stdout, under a marker: one or more comment lines
right above the fence, ``<!-- output -->`` alone or each with one option::

    <!-- output: lines 1 /-float64-none / /passed/ -->
    <!-- output: narrow -->
    ```text
    $ attngrad check --strategy explicit --no-gradcheck
    strategy  case                          out  ...
    ...
    ```

`tests/test_doc_outputs.py` runs each command and fails when its block no longer matches
what it prints; one command rewrites the stale ones from real runs:

    python docs/outputs.py --update           every page (docs/*.md, README.md)
    python docs/outputs.py --update docs/commands.md
    python docs/outputs.py --all              every block, its measurements taken afresh too
    python docs/outputs.py                    check only: a diff per stale block, exit 1

``--update`` leaves a block alone while it shows what the command prints, measurements aside
(its numbers stay those of the run that wrote it).

The commands run in this process, each once, in an empty folder holding a copy of
``docs/inputs/`` (the files a command reads: ``my_kernel.py``, an exercise solution).

How a block matches the run, line by line and in order:

* a line ``...`` stands for lines left out (any number); a line ending in `` ...`` for the
  rest of that line; every other line is a line the command printed;
* runs of spaces compare as one space (a block may narrow a table's columns);
* a number with a decimal point or an exponent is a measurement: any number written the
  same way (as many decimals, an exponent or not) matches it; so does a percentage, starred
  or not (or ``busy*``, what a rate above the machine's peak prints), and the processor's
  name, thread count, GEMM size and vector width of a ``machine:`` line; integers, words
  and headers must be equal;
* what a block's ``vary`` patterns match, on either side, matches anything.

The options, one a marker line:

``lines SPEC``
    The lines ``--update`` keeps, in order (default: all); the lines between are written
    as ``...``.  Items, separated by spaces: ``N`` (1-based), ``/REGEX/`` (every line it
    matches), or a range ``A-B`` / ``A-`` of those, each end the first line it names.
``vary REGEX``
    Spans that differ from run to run or machine to machine (a choice made by timing, a
    path); repeatable.
``optional REGEX``
    Lines a run may print or not (a warning on a busy machine); dropped from both sides
    before matching; repeatable.
``width N``
    ``--update`` cuts a longer line at a space and ends it with `` ...``.
``narrow``
    ``--update`` narrows the table: in the lines that hold two spaces in a row, a run of
    more than two blank columns (blank in all of them) becomes two.
``exit N``
    The exit status the command must return (default 0).
``needs fused``
    Only where the fused kernels are built (``attngrad build``): their rows and rates.

Paths of the machine never reach a page: the cache folder is written ``~/.cache/attngrad``,
the home folder ``~``, the folder the command ran in ``.``, and the fused library's digest
``…``.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import io
import os
import re
import shlex
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
INPUTS = DOCS / "inputs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>.*)$")
MARKER = re.compile(r"^\s*<!-- output(?::\s*(?P<key>\w+)(?:\s+(?P<value>.*?))?)?\s*-->\s*$")
ELLIPSIS = "..."
CONTINUED = " ..."

# Measurements: a number with a decimal point or an exponent, a percentage.
FLOAT = re.compile(r"(?<![\w.])\d+(?:\.(\d+))?(e[+-]\d+)(?![\w.])|(?<![\w.])\d+\.(\d+)(?![\w.])")
PERCENT = re.compile(r"(?<![\w.])\d+(?:\.\d+)?%\*?|\bbusy\*")
# What every block lets vary: the machine line's processor, threads, GEMM size, vector width.
MACHINE = [
    re.compile(r"(?<=^machine: )[^,]+"),
    re.compile(r"\b\d+ threads?\b"),
    re.compile(r"\b\d+²"),
    re.compile(r"\(\d+ x one thread's\)"),
    re.compile(r"\((?:AVX\w*|DEFAULT|default|NEON|SVE\w*|VSX\w*|ZVECTOR)\)"),
]
WILD = "\x00"


class MarkerError(ValueError):
    """A marker this script cannot read (names the page and line)."""


@dataclass
class Block:
    """One quoted output: where it is, the command, the lines shown and the options."""

    page: Path
    start: int  # index of the opening fence's line in the page
    end: int  # index of the closing fence's line
    command: str
    shown: list[str]
    lines: str = ""
    vary: list[re.Pattern[str]] = field(default_factory=list)
    optional: list[re.Pattern[str]] = field(default_factory=list)
    width: int = 0
    narrow: bool = False
    exit: int = 0
    needs: str = ""

    @property
    def where(self) -> str:
        return f"{_relative(self.page)}:{self.start + 1}"


@dataclass(frozen=True)
class Run:
    """What a command printed on stdout (placeholders in), its stderr and exit status."""

    stdout: list[str]
    stderr: str
    status: int


def _relative(page: Path) -> str:
    return page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else str(page)


# ------------------------------------------------------------------------------ the pages


def read_blocks(page: Path) -> list[Block]:
    """The quoted outputs of one page, in page order (MarkerError on a malformed marker)."""
    text = page.read_text(encoding="utf-8").splitlines()
    blocks = []
    i, fence = 0, None
    while i < len(text):
        if fence is not None:  # inside a fenced block that is not a quoted output
            fence = None if text[i].strip() == fence else fence
            i += 1
            continue
        if MARKER.match(text[i]) is None:
            opening = FENCE.match(text[i])
            fence = opening["fence"] if opening is not None else None
            i += 1
            continue
        options = []
        while i < len(text) and (marker := MARKER.match(text[i])) is not None:
            options.append((i, marker["key"], marker["value"] or ""))
            i += 1
        where = f"{_relative(page)}:{i + 1}"
        opening = FENCE.match(text[i]) if i < len(text) else None
        if opening is None:
            raise MarkerError(f"{where}: an output marker must sit right above a fenced block")
        end = next(
            (j for j in range(i + 1, len(text)) if text[j].strip() == opening["fence"]), None
        )
        if end is None:
            raise MarkerError(f"{where}: the fenced block never closes")
        body = [line[len(opening["indent"]) :] for line in text[i + 1 : end]]
        if not body or not body[0].startswith("$ attngrad"):
            raise MarkerError(f"{where}: the block's first line must be the command, $ attngrad")
        block = Block(page, i, end, body[0][2:].strip(), body[1:])
        for line, key, value in options:
            _set_option(block, key, value, f"{_relative(page)}:{line + 1}")
        blocks.append(block)
        i = end + 1
    return blocks


def _set_option(block: Block, key: str | None, value: str, where: str) -> None:
    try:
        if key is None:
            return
        if key == "lines":
            _items(value)  # reads it
            block.lines = value
        elif key in ("vary", "optional"):
            getattr(block, key).append(re.compile(value))
        elif key in ("width", "exit"):
            setattr(block, key, int(value))
        elif key == "narrow" and not value:
            block.narrow = True
        elif key == "needs" and value == "fused":
            block.needs = value
        else:
            raise ValueError(f"unknown option {key} {value}".rstrip())
    except (ValueError, re.error) as e:
        raise MarkerError(f"{where}: {e}") from None


def unmarked(page: Path) -> list[str]:
    """Where a fenced block quotes an ``$ attngrad`` command's output without a marker."""
    text = page.read_text(encoding="utf-8").splitlines()
    found, fence = [], None
    for i, line in enumerate(text):
        opening = FENCE.match(line)
        if fence is not None:
            if line.strip() == fence:
                fence = None
            continue
        if opening is None:
            continue
        fence = opening["fence"]
        first = text[i + 1].strip() if i + 1 < len(text) else ""
        marked = i > 0 and MARKER.match(text[i - 1]) is not None
        if first.startswith("$ attngrad") and not marked:
            found.append(f"{_relative(page)}:{i + 1}")
    return found


# ------------------------------------------------------------------------------ the runs


@functools.cache
def run(command: str) -> Run:
    """Run ``attngrad ...`` in this process, in a fresh folder holding docs/inputs/; once."""
    from attngrad.cli.app import main

    argv = shlex.split(command)
    if argv[0] != "attngrad":
        raise ValueError(f"not an attngrad command: {command}")
    out, err = io.StringIO(), io.StringIO()
    here = Path.cwd()
    with tempfile.TemporaryDirectory(prefix="attngrad-docs-") as folder:
        shutil.copytree(
            INPUTS, folder, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
        )
        os.chdir(folder)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    status = main(argv[1:])
                except SystemExit as e:  # argparse
                    status = e.code if isinstance(e.code, int) else 1
        finally:
            os.chdir(here)
        stdout = _placeholders(out.getvalue(), Path(folder))
    return Run(stdout, err.getvalue(), status)


def _placeholders(text: str, folder: Path) -> list[str]:
    """The output with this machine's paths written as any machine's."""
    from attngrad.core.cache import cache_root

    for path in {folder, folder.resolve()}:
        text = text.replace(f"{path}{os.sep}", "").replace(str(path), ".")
    text = text.replace(str(cache_root()), "~/.cache/attngrad")
    if len(str(Path.home())) > 1:
        text = text.replace(str(Path.home()), "~")
    text = re.sub(r"(attngrad/fused/[^/\s]*-)[0-9a-f]{8,}(?=/)", "\\1…", text)
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def fused_built() -> bool:
    """Whether the fused kernels load here without compiling first."""
    from attngrad.strategies.fused import build

    return build.loaded_or_built() is not None


# ------------------------------------------------------------------------------ matching


def _mask(line: str, vary: Sequence[re.Pattern[str]]) -> str:
    """A line as it compares: varying spans, measurements and runs of spaces made alike."""
    for pattern in [*vary, *MACHINE]:
        line = pattern.sub(WILD, line)
    line = PERCENT.sub("%", line)
    line = FLOAT.sub(_float_form, line)
    return " ".join(line.split())


def _float_form(number: re.Match[str]) -> str:
    decimals = number[1] if number[2] else number[3]
    return f"<{len(decimals or '')}{'e' if number[2] else ''}>"


def _same(shown: str, printed: str, vary: Sequence[re.Pattern[str]]) -> bool:
    want = _mask(shown.removesuffix(CONTINUED), vary)
    got = _mask(printed, vary)
    if shown.endswith(CONTINUED):  # the rest of the line left out
        return re.match(_pattern(want), got.replace(WILD, "")) is not None
    if WILD not in want and WILD not in got:
        return want == got
    # a varying span, on either side, matches any text on the other
    return any(
        re.fullmatch(_pattern(a), b.replace(WILD, "")) is not None
        for a, b in ((want, got), (got, want))
    )


def _pattern(masked: str) -> str:
    return ".*".join(re.escape(piece) for piece in masked.split(WILD))


def matches(block: Block, printed: Sequence[str]) -> bool:
    """Whether every line the block shows is a line the command printed, in order, with
    ``...`` for lines left out."""
    drop = block.optional

    def kept(lines: Sequence[str]) -> list[str]:
        return [line for line in lines if not any(p.search(line) for p in drop)]

    shown, got = kept(block.shown), kept(printed)

    @functools.cache
    def fits(i: int, j: int) -> bool:
        if i == len(shown):
            return j == len(got)
        if shown[i] == ELLIPSIS:
            return any(fits(i + 1, k) for k in range(j, len(got) + 1))
        return j < len(got) and _same(shown[i], got[j], block.vary) and fits(i + 1, j + 1)

    return fits(0, 0)


def problems(block: Block, result: Run) -> list[str]:
    """Why the block is stale: empty when it shows what the command printed."""
    found = []
    if result.status != block.exit:
        found.append(
            f"`{block.command}` exited {result.status}, the block expects {block.exit}"
            + (f"; stderr ends:\n{result.stderr[-2000:]}" if result.stderr else "")
        )
    if not matches(block, result.stdout):
        try:
            now = render(block, result.stdout)
        except ValueError as e:  # the lines spec names a line no longer printed
            now = [f"({e})", *result.stdout]
        diff = difflib.unified_diff(block.shown, now, "on the page", "printed now", lineterm="")
        found.append("\n".join(["the block no longer matches what the command prints:", *diff]))
    return found


def current(block: Block, printed: Sequence[str]) -> bool:
    """Whether the block is what ``--update`` would write, measurements aside (so that an
    update leaves a block alone unless its lines, its options or the output changed)."""
    try:
        now = render(block, printed)
    except ValueError:
        return False
    return len(now) == len(block.shown) and all(
        _mask(a, block.vary) == _mask(b, block.vary) for a, b in zip(now, block.shown, strict=True)
    )


# ------------------------------------------------------------------------------ rendering


ITEM = re.compile(r"\s*(/(?:\\.|[^/])*/|\d+)(?:(-)(/(?:\\.|[^/])*/|\d+)?)?(?=\s|$)")


def _items(spec: str) -> list[tuple[str, str | None, str]]:
    """A ``lines`` spec read: (first, "-" for a range, last) per item (ValueError if unread)."""
    items, at = [], 0
    while spec[at:].strip():
        item = ITEM.match(spec, at)
        if item is None:
            raise ValueError(f"lines: cannot read {spec[at:].strip()!r}")
        for end in (item[1], item[3]):
            if end and end.startswith("/"):
                re.compile(end[1:-1])
        items.append((item[1], item[2], item[3] or ""))
        at = item.end()
    return items


def _spans(spec: str, lines: Sequence[str]) -> list[tuple[int, int]]:
    """The index ranges (inclusive) a ``lines`` spec picks (ValueError when one names none)."""
    spans = []
    for first, dash, last in _items(spec):
        if dash is None and first.startswith("/"):  # every line it matches
            pattern = re.compile(first[1:-1])
            picked = [(i, i) for i, line in enumerate(lines) if pattern.search(line)]
            if not picked:
                raise ValueError(f"lines: {first} names no line of the output")
            spans += picked
            continue
        start = _line(first, lines, 0)
        end = start if dash is None else _line(last, lines, start) if last else len(lines) - 1
        spans.append((start, end))
    return spans


def _line(end: str, lines: Sequence[str], start: int) -> int:
    """The index of the line ``end`` names: a 1-based number, or the first line at or after
    ``start`` that a /regex/ matches."""
    if end.startswith("/"):
        pattern = re.compile(end[1:-1])
        for i in range(start, len(lines)):
            if pattern.search(lines[i]):
                return i
        raise ValueError(f"lines: {end} names no line of the output")
    if not 1 <= int(end) <= len(lines):
        raise ValueError(f"lines: line {end}, but the output has {len(lines)}")
    return int(end) - 1


def render(block: Block, printed: Sequence[str]) -> list[str]:
    """The block's lines as ``--update`` writes them from what the command printed."""
    if block.lines:
        picked = sorted({i for a, b in _spans(block.lines, printed) for i in range(a, b + 1)})
    else:
        picked = list(range(len(printed)))
    kept = [printed[i] for i in picked]
    if block.narrow:
        kept = _narrow(kept)
    if block.width:
        kept = [_cut(line, block.width) for line in kept]
    out, previous = [], -1
    for i, line in zip(picked, kept, strict=True):
        if i != previous + 1:
            out.append(ELLIPSIS)
        out.append(line)
        previous = i
    if previous != len(printed) - 1:
        out.append(ELLIPSIS)
    return out


def _narrow(lines: list[str]) -> list[str]:
    table = [i for i, line in enumerate(lines) if "  " in line.strip()]
    if not table:
        return lines
    width = max(len(lines[i]) for i in table)
    blank = [all(c >= len(lines[i]) or lines[i][c] == " " for i in table) for c in range(width)]
    drop, run = set(), 0
    for c in range(width):
        run = run + 1 if blank[c] else 0
        if run > 2 and c >= run:  # never the indent at column 0
            drop.add(c)
    out = list(lines)
    for i in table:
        out[i] = "".join(ch for c, ch in enumerate(lines[i]) if c not in drop).rstrip()
    return out


def _cut(line: str, width: int) -> str:
    if len(line) <= width:
        return line
    head = line[: width - len(CONTINUED)]
    head = head[: head.rfind(" ")] if " " in head.strip() else head
    return head.rstrip() + CONTINUED


def rewrite(page: Path, rendered: dict[int, list[str]]) -> bool:
    """Write the given blocks' new lines (by opening fence) into the page; True if it changed."""
    text = page.read_text(encoding="utf-8")
    lines = text.splitlines()
    for block in sorted(read_blocks(page), key=lambda b: b.start, reverse=True):
        if block.start in rendered:
            indent = FENCE.match(lines[block.start])["indent"]  # type: ignore[index]
            body = [f"$ {block.command}", *rendered[block.start]]
            lines[block.start + 1 : block.end] = [(indent + line).rstrip() for line in body]
    new = "\n".join(lines) + ("\n" if text.endswith("\n") else "")
    if new != text:
        page.write_text(new, encoding="utf-8")
    return new != text


# ------------------------------------------------------------------------------ the command


def all_blocks(pages: Sequence[Path] = PAGES) -> list[Block]:
    """Every page's quoted outputs, in page order."""
    return [block for page in pages for block in read_blocks(page)]


def _check_page(page: Path, update: bool, everything: bool = False) -> int:
    """Check (or update) one page's blocks, saying what it found; the number left stale.
    ``everything``: update every block, its measurements too, not only a stale one."""
    stale = 0
    for where in unmarked(page):
        print(f"{where}: quotes an attngrad command's output without <!-- output -->")
        stale += 1
    new: dict[int, list[str]] = {}
    for block in read_blocks(page):
        if block.needs == "fused" and not fused_built():
            print(f"{block.where}: skipped, the fused kernels are not built (attngrad build)")
            continue
        result = run(block.command)
        found = problems(block, result)
        if not found and (not update or (current(block, result.stdout) and not everything)):
            print(f"{block.where}: ok  $ {block.command}")
            continue
        if update and result.status == block.exit:
            try:
                new[block.start] = render(block, result.stdout)
            except ValueError as e:
                found.append(str(e))
            else:
                print(f"{block.where}: updated  $ {block.command}")
                continue
        stale += 1
        print(f"{block.where}: stale  $ {block.command}")
        for problem in found:
            print("  " + problem.replace("\n", "\n  "))
    if new:
        rewrite(page, new)
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Check the command outputs the pages quote against real runs."
    )
    parser.add_argument("pages", nargs="*", type=Path, help="only these pages (default: all)")
    parser.add_argument(
        "--update", action="store_true", help="rewrite each stale block from its run"
    )
    parser.add_argument(
        "--all", action="store_true", help="rewrite every block, its measurements too"
    )
    args = parser.parse_args(argv)
    pages = [p.resolve() for p in args.pages] or PAGES
    stale = sum(_check_page(page, args.update or args.all, args.all) for page in pages)
    if stale:
        print(f"{stale} stale; `python docs/outputs.py --update` rewrites them from real runs")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
