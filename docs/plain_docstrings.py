"""A griffe extension: attngrad's plain-text docstrings, rendered as Markdown.

The package's docstrings are written to be read in a terminal (``help()``, an
editor): RST-style literal blocks introduced by ``::``, doctest lines (``>>>``)
and formulas such as ``2**20``.  Markdown would read a ``>>>`` line as a nested
quote (and a ``# comment`` after it as a heading), flatten a literal block inside
a list item, and turn ``2**20 ... 2**18`` into bold text.  This extension
rewrites each docstring before mkdocstrings renders it:

* a run of doctest lines and their output becomes a ``pycon`` fenced block;
* a paragraph ending in ``::`` ends in ``:`` and the indented block after it
  becomes a ``text`` fenced block, at the indentation of the paragraph's text
  (inside a list item too);
* ``**`` between two word characters, outside code, is escaped.

The source is never changed: only what the site shows.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

BULLET = re.compile(r"^(\s*)([*-] |\d+\. )")
POWER = re.compile(r"(?<=\w)\*\*(?=\w)")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _text_indent(line: str) -> int:
    """Where the text of this line starts: after a list bullet, if it has one."""
    bullet = BULLET.match(line)
    return len(bullet.group(0)) if bullet else _indent(line)


def _escape_powers(line: str) -> str:
    """Escape ``**`` between word characters outside inline code spans."""
    parts = re.split(r"(`+[^`]*`+)", line)
    return "".join(p if p.startswith("`") else POWER.sub(r"\*\*", p) for p in parts)


def _fence(block: list[str], indent: int, language: str) -> list[str]:
    strip = min(_indent(line) for line in block if line.strip())
    pad = " " * indent
    body = [pad + line[strip:] if line.strip() else "" for line in block]
    return [f"{pad}```{language}", *body, f"{pad}```"]


def to_markdown(text: str) -> str:
    """The docstring ``text`` with its literal blocks and doctests fenced."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    paragraph_indent = 0  # text indent of the paragraph being read
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(">>>"):
            start = i
            while i < len(lines) and lines[i].strip():
                i += 1
            out += _fence(lines[start:i], _indent(line), "pycon")
            continue
        if line.rstrip().endswith("::"):
            if not out or not out[-1].strip():
                paragraph_indent = _text_indent(line)
            head = line.rstrip()[:-2].rstrip()
            out.append(head + ":" if head.strip() else "")
            i += 1
            block: list[str] = []
            while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > _indent(line)):
                block.append(lines[i])
                i += 1
            while block and not block[0].strip():
                block.pop(0)
            while block and not block[-1].strip():
                block.pop()
            if any(b.strip() for b in block):
                out += ["", *_fence(block, paragraph_indent, "text"), ""]
            continue
        if line.strip() and (not out or not out[-1].strip()):
            paragraph_indent = _text_indent(line)
        out.append(_escape_powers(line))
        i += 1
    return "\n".join(out)


class PlainDocstrings(griffe.Extension):
    """Rewrite every docstring as Markdown before it is parsed and rendered."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
