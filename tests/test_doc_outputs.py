"""Every command output README.md and docs/*.md quote is what the command prints now.

A quoted output is a fenced block whose first line is ``$ attngrad ...``, under an
``<!-- output -->`` marker; `docs/outputs.py` reads the markers, runs each command in this
process (once, in a folder holding a copy of docs/inputs/) and matches the block against what
it printed: lines in order, ``...`` for lines left out, measurements (decimals, exponents,
percentages, the machine line) as any value written the same way. A block that no longer
matches fails here with the diff; ``python docs/outputs.py --update`` rewrites it from a real
run. A block that needs the fused kernels is skipped where they are not built.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_outputs():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("doc_outputs", ROOT / "docs" / "outputs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


outputs = _load_outputs()
BLOCKS = outputs.all_blocks()


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.where)
def test_quoted_output_is_what_the_command_prints(block) -> None:  # type: ignore[no-untyped-def]
    if block.needs == "fused" and not outputs.fused_built():
        pytest.skip("the fused kernels are not built here (attngrad build)")
    found = outputs.problems(block, outputs.run(block.command))
    assert not found, (
        f"{block.where}: `$ {block.command}` is stale; `python docs/outputs.py --update` "
        "rewrites it from a real run\n" + "\n".join(found)
    )


def test_every_quoted_command_output_is_marked() -> None:
    unmarked = [where for page in outputs.PAGES for where in outputs.unmarked(page)]
    assert not unmarked, f"an attngrad output quoted without <!-- output -->: {unmarked}"
    assert {b.page.name for b in BLOCKS} >= {"getting-started.md", "commands.md", "verify.md"}


# ------------------------------------------- how a block matches, without running a command


def _block(shown: str, **options) -> object:  # type: ignore[no-untyped-def]
    block = outputs.Block(Path("page.md"), 0, 0, "attngrad x", shown.splitlines())
    for key, value in options.items():
        setattr(
            block, key, [re.compile(v) for v in value] if key in ("vary", "optional") else value
        )
    return block


PRINTED = """\
machine: AMD EPYC 7B13, 2 threads, float32 GEMM 1856² 164.2 GFLOP/s (AVX512)
path       saved       of peak
explicit   11.03 MiB     48.5%
flash       4.03 MiB      9.1%
explicit: 109 passed, 0 failed
109 passed, 0 failed (max abs error vs float64 on the inputs as received)""".splitlines()


def test_measurements_match_any_value_written_the_same_way() -> None:
    shown = """\
machine: Intel Xeon, 1 thread, float32 GEMM 1024² 37.0 GFLOP/s (AVX2)
path  saved  of peak
explicit  9.99 MiB  busy*
flash  12.50 MiB  75%
explicit: 109 passed, 0 failed
109 passed, 0 failed (max abs error vs float64 on the inputs as received)"""
    assert outputs.matches(_block(shown), PRINTED)
    # a count, a word, a column or a number's format that changed is stale
    for old, new in [
        ("109 passed, 0 failed\n", "81 passed, 0 failed\n"),
        ("9.99 MiB", "9.99 KiB"),
        ("9.99 MiB", "9.9 MiB"),
        ("12.50 MiB", "12.5e+00 MiB"),
        ("path  saved  of peak", "path  saved"),
    ]:
        assert old in shown
        assert not outputs.matches(_block(shown.replace(old, new, 1)), PRINTED), new


def test_elisions_keep_the_lines_shown_in_order() -> None:
    assert outputs.matches(_block("...\nflash 4.03 MiB 9.1%\n..."), PRINTED)
    assert outputs.matches(_block(f"{PRINTED[0]}\n...\n109 passed, 0 failed (max ..."), PRINTED)
    assert not outputs.matches(_block("flash 4.03 MiB 9.1%\n..."), PRINTED)  # not the first line
    assert not outputs.matches(_block(f"{PRINTED[0]}\nflash 4.03 MiB 9.1%\n..."), PRINTED)
    assert not outputs.matches(
        _block("...\nflash 4.03 MiB 9.1%\nexplicit 11.03 MiB 48.5%\n..."), PRINTED
    )


def test_vary_and_optional() -> None:
    shown = "...\nexplicit: 109 passed, 0 failed (slow)\n..."
    assert not outputs.matches(_block(shown), PRINTED)
    assert outputs.matches(_block(shown, vary=[r" \(slow\)$"]), PRINTED)
    shown = "\n".join([*PRINTED[:3], "warning: the machine was busy", *PRINTED[3:]])
    assert not outputs.matches(_block(shown), PRINTED)
    assert outputs.matches(_block(shown, optional=["^warning: "]), PRINTED)


def test_update_writes_the_lines_picked_narrowed_and_cut() -> None:
    block = _block("", lines="1 /^flash/ /passed,/", narrow=True, width=40)
    rendered = outputs.render(block, PRINTED)
    assert rendered == [
        "machine: AMD EPYC 7B13, 2 threads, ...",
        "...",
        "flash  4.03 MiB  9.1%",
        "explicit: 109 passed, 0 failed",
        "109 passed, 0 failed (max abs error ...",
    ]
    block.shown = rendered
    assert outputs.matches(block, PRINTED) and outputs.current(block, PRINTED)
    with pytest.raises(ValueError, match="names no line"):
        outputs.render(_block("", lines="/^sdpa/"), PRINTED)


def test_no_path_of_this_machine_reaches_a_page(tmp_path: Path) -> None:
    from attngrad.core.cache import cache_root

    library = cache_root() / "fused" / "torch2.13.0+cpu-cpua4207cd0-AVX2-c5e669ce1208"
    text = f"fused CPU kernels: {library}/attngrad_fused.so\nwrote {tmp_path}/results/bench.csv\n"
    assert outputs._placeholders(text, tmp_path) == [
        "fused CPU kernels: ~/.cache/attngrad/fused/torch2.13.0+cpu-cpua4207cd0-AVX2-…/attngrad_fused.so",
        "wrote results/bench.csv",
    ]
