"""The compile report (`attngrad kernels`): the triton kernels built for sm_90 and sm_80, no GPU.

The suite runs in Triton's interpreter, so what needs the compiler runs in a
child process with TRITON_INTERPRET=0: the report over the quick grid for
each target, once per run, whichever xdist worker asks first, and one
known-spilling configuration, which must be reported as such.

Compiled results go to the cache `attngrad kernels` keeps for its users
(`attngrad.core.cache.cache_root` / kernels: ATTNGRAD_CACHE_DIR, else
~/.cache/attngrad, beside the fused kernels `attngrad build` keeps there),
filed under Triton's own compile key: the kernel's source and everything it
calls, the signature and its specializations, the options, the target and
the ptxas version.  A run whose kernels, tables or Triton changed compiles
what changed (about two minutes of CPU for both quick reports from nothing);
one where nothing did reads the verdicts of the binaries it would build
again.  That the cache is read back, and nothing compiles when every binary
is in it, is tested (`test_a_second_report_compiles_nothing`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from attngrad.cli import app as cli
from attngrad.strategies.triton import configs, ptxas
from attngrad.strategies.triton.ptxas import Resources, parse_ptxas_log
from attngrad.tools.kernel_report import (
    FLOAT64_SPILL_BYTES,
    MASKS,
    SHARED_FRACTION,
    TARGETS,
    Row,
    Variant,
    grid,
    launches,
)

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")


def _kind(dtype: str, precision: str) -> str:
    size = torch.finfo(getattr(torch, dtype)).bits // 8
    return configs.dot_kind(size, precision == "tf32")


def _compiled_env() -> dict[str, str]:
    return {**os.environ, "TRITON_INTERPRET": "0"}


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of this run that every xdist worker shares (the workers' base temp's
    parent), so that each report runs once in the run, not once per worker."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    """Where `attngrad kernels` files its compiled results, kept between runs (docstring)."""
    return ptxas.default_cache_dir()


def _kernels_report(
    target: str, out: Path, *options: str, script: str = ""
) -> subprocess.CompletedProcess[str]:
    """``attngrad kernels --target T --quick --json OUT [options]`` in a child with the
    compiler on, after the Python code ``script`` (in the child)."""
    argv = ["kernels", "--target", target, "--quick", "--json", str(out), *options]
    run = f"{script}\nfrom attngrad.cli import app\nraise SystemExit(app.main({argv!r}))"
    return subprocess.run(
        [sys.executable, "-c", run], env=_compiled_env(), capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip


@pytest.fixture(scope="session", params=["sm_90", "sm_80"])
def quick_report(request, shared_dir):
    """(target, exit status, output, JSON) of ``attngrad kernels --target T --quick``: run by
    the first worker that asks, under a lock, and read back by the other."""
    target = request.param
    out, run = shared_dir / f"report-{target}.json", shared_dir / f"report-{target}.run.json"
    with FileLock(f"{run}.lock"):
        if not run.exists():
            done = _kernels_report(target, out)
            fields = {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
            run.write_text(json.dumps(fields))
    done = subprocess.CompletedProcess(target, **json.loads(run.read_text()))
    payload = json.loads(out.read_text()) if out.exists() else None
    return target, done, payload


# slow: the report compiles for a minute or two where the cache lacks its binaries
@pytest.mark.slow
def test_quick_report_has_no_spill_and_no_shared_overrun(quick_report):
    target, done, payload = quick_report
    assert payload is not None, done.stderr
    assert payload["target"] == target
    assert payload["triton"] == configs.triton_version_text()  # whose table it checked
    limit = TARGETS[target].shared_limit
    bad = [c for c in payload["configs"] if not c["ok"]]
    assert not bad, f"{target}: {bad}\n{done.stdout}"
    assert done.returncode == 0, done.stderr
    for c in payload["configs"]:
        assert c["spill_bytes"] == 0, c
        assert 0 < c["shared_bytes"] <= SHARED_FRACTION * limit, c
        assert 0 < c["registers"] <= 255, c


def test_quick_report_covers_every_kernel_dtype_and_head_dim(quick_report):
    _, done, payload = quick_report
    assert payload is not None, done.stderr
    rows = payload["configs"]
    keys = {"kernel", "dtype", "head_dim", "mask", "shared_bytes", "registers", "spill_bytes", "ok"}
    assert all(keys <= set(c) for c in rows)
    assert {c["kernel"] for c in rows} == {"forward", "delta", "dkdv", "dq"}
    assert {(c["dtype"], c["precision"]) for c in rows} == {
        ("float16", "ieee"),
        ("float32", "ieee"),
        ("float32", "tf32"),
    }
    assert {c["head_dim"] for c in rows} == {64, 128, 256}
    # the tiles are the table's
    for c in rows:
        kind = _kind(c["dtype"], c["precision"])
        arch = TARGETS[payload["target"]].arch
        want = configs.choose(c["kernel"], kind, c["head_dim"], arch)
        assert (c["num_warps"], c["num_stages"]) == (want.num_warps, want.num_stages)
    assert "rows, 0 not ok" in done.stdout


# one target: the cache is the same code for both
@pytest.mark.parametrize("quick_report", ["sm_80"], indirect=True)
def test_a_second_report_compiles_nothing(quick_report, cache_dir, tmp_path):
    # every binary of the first report is in the cache now: the second reads each one back
    # and compiles none (a compile would raise: --jobs 1 compiles in the child, patched)
    target, first, payload = quick_report
    assert payload is not None, first.stderr
    refuse = (
        "from attngrad.strategies.triton import ptxas\n"
        "def _compile(bound):\n"
        "    raise AssertionError(f'compiled {bound.kernel} again')\n"
        "ptxas._compile = _compile"
    )
    out = tmp_path / "again.json"
    again = _kernels_report(target, out, "--jobs", "1", script=refuse)
    assert again.returncode == first.returncode == 0, again.stderr
    assert json.loads(out.read_text())["configs"] == payload["configs"]
    assert any(cache_dir.glob("*.json"))


def test_a_spilling_configuration_is_reported_as_not_ok():
    # float16, d = 64, every mask feature, with 128 x 64 tiles on 4 warps: the forward
    # kernel needs more than 255 registers a thread and spills (not a shape the table takes)
    script = textwrap.dedent(
        """
        from attngrad.strategies.triton import ptxas
        from attngrad.tools import kernel_report as kr
        variant = kr.Variant("float16", "ieee", 64, "all", 4)
        name, args, fn = kr.launches(variant, 90)[0]
        args = {**args, "BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
        got = ptxas.compile_bound(ptxas.bind(fn, args, 90), ptxas.default_cache_dir())
        row = kr.Row("forward", variant, 128, 64, 4, 3, got, kr.TARGETS["sm_90"])
        print(name, got.spill_stores, got.registers, row.ok, row.verdict)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=_compiled_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    name, spill, registers, ok, *verdict = done.stdout.split()
    assert name == "attention_forward"
    assert int(spill) > 0 and int(registers) == 255 and ok == "False"
    assert " ".join(verdict).startswith("spills")


def test_under_the_interpreter_it_says_it_needs_the_compiler(capsys):
    assert os.environ["TRITON_INTERPRET"] == "1"
    assert cli.main(["kernels", "--target", "sm_90"]) == 2
    assert "needs Triton's compiler" in capsys.readouterr().err


def test_unknown_target_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        cli.main(["kernels", "--target", "sm_75"])
    assert "sm_80" in capsys.readouterr().err


def test_full_grid_covers_dtypes_precisions_head_dims_masks_and_gqa():
    variants = grid()
    assert {(v.dtype, v.precision) for v in variants} == {
        ("float16", "ieee"),
        ("bfloat16", "ieee"),
        ("float32", "ieee"),
        ("float32", "tf32"),
        ("float64", "ieee"),
    }
    assert {v.head_dim for v in variants} == {64, 80, 128, 256}  # 80: not a power of two
    assert {v.mask for v in variants} == set(MASKS)
    gqa = {(v.mask, v.groups) for v in variants if v.groups > 1}
    assert gqa == {("none", 4), ("masks", 4), ("all", 4)}
    assert {(v.mask, v.head_dim) for v in variants if v.seq % 16} == {("none", 128), ("all", 128)}
    assert len(variants) == len(set(variants))


@pytest.mark.parametrize("mode", MASKS)
def test_each_mask_mode_launches_what_it_says(mode):
    recorded = {
        name: args for name, args, _ in launches(Variant("float16", "ieee", 128, mode, 1), 90)
    }
    assert list(recorded) == [
        "attention_forward",
        "attention_delta",
        "attention_dkdv",
        "attention_dq",
    ]
    flags = {
        "HAS_BIAS": mode in ("bias", "masks", "all"),
        "HAS_KEEP": mode in ("bool", "masks", "all"),
        "HAS_BAND": mode in ("causal", "window", "masks", "all"),
        "HAS_SOFTCAP": mode in ("softcap", "all"),
        "HAS_DROPOUT": mode in ("dropout", "all"),
    }
    for name in ("attention_forward", "attention_dkdv", "attention_dq"):
        assert {f: recorded[name][f] for f in flags} == flags
    assert recorded["attention_dq"]["STORE_DS"] == (mode in ("bias", "masks", "all"))
    # a softcap or dropout takes the heavy tier of the table
    heavy = mode in ("softcap", "dropout", "all")
    want = configs.choose("dq", "mma16", 128, 90, heavy)
    assert (recorded["attention_dq"]["BLOCK_M"], recorded["attention_dq"]["num_warps"]) == (
        want.block_m,
        want.num_warps,
    )


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_launches_take_the_tables_tiles_warps_and_stages(dtype, arch):
    for name, args, _ in launches(Variant(dtype, "ieee", 256, "none", 4), arch):
        kernel = name.removeprefix("attention_")
        want = configs.choose(kernel, _kind(dtype, "ieee"), 256, arch)
        assert (args["num_warps"], args["num_stages"]) == (want.num_warps, want.num_stages)
        assert args["BLOCK_M"] == want.block_m
        if kernel != "delta":
            assert args["BLOCK_N"] == want.block_n
            assert args["groups"] == 4


def test_tf32_variant_launches_tf32_dots_and_restores_the_flag():
    before = torch.backends.cuda.matmul.fp32_precision
    recorded = launches(Variant("float32", "tf32", 64, "none", 1), 90)
    assert {args["PRECISION"] for name, args, _ in recorded if name != "attention_delta"} == {
        "tf32"
    }
    assert torch.backends.cuda.matmul.fp32_precision == before


PTXAS_LOG = """\
ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function 'attention_forward' for 'sm_90a'
ptxas info    : Function properties for attention_forward
    6584 bytes stack frame, 28156 bytes spill stores, 42308 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers, 6584 bytes cumulative stack size
"""


def test_ptxas_log_is_parsed():
    assert parse_ptxas_log(PTXAS_LOG) == (32, 28156, 42308, 6584)
    with pytest.raises(ValueError, match="no resource usage"):
        parse_ptxas_log("ptxas info    : 11 bytes gmem\n")


def _row(dtype="float16", shared=1000, spill=0, error="", target="sm_90"):
    resources = Resources(shared, 128, spill, spill, spill, error)
    return Row(
        "dq", Variant(dtype, "ieee", 64, "none", 1), 64, 32, 4, 2, resources, TARGETS[target]
    )


def test_verdicts():
    limit = TARGETS["sm_80"].shared_limit
    assert _row().ok and _row().verdict == "ok"
    assert not _row(spill=4).ok and "spills 4 B" in _row(spill=4).verdict
    assert _row("float64", spill=FLOAT64_SPILL_BYTES).ok
    assert "spills" in _row("float64", spill=FLOAT64_SPILL_BYTES).verdict
    assert not _row("float64", spill=FLOAT64_SPILL_BYTES + 1).ok
    near = _row(shared=int(0.95 * limit), target="sm_80")
    assert not near.ok and "> 90%" in near.verdict
    over = _row(shared=limit + 1, target="sm_80")
    assert not over.ok and "exceeds" in over.verdict
    assert _row(shared=int(0.95 * limit), target="sm_90").ok  # sm_90 has more
    broken = _row(error="CompilationError: boom")
    assert not broken.ok and "does not compile" in broken.verdict
