"""Shared fixtures.

* Every test starts from a seed derived from its own id, so a failure
  reproduces alone (``pytest -k ...``) and under ``-n 2`` alike, and two
  parametrized cases do not silently share the same random inputs.
* Fresh allocations are filled with NaN (PyTorch's deterministic mode with
  ``fill_uninitialized_memory``), as flash-linear-attention's conftest does:
  a kernel that reads memory it never wrote then fails loudly with NaN
  instead of passing on whatever zeros the allocator happened to hand out.
* One intra-op thread for the session (see below), and one BLAS thread for
  numpy (OPENBLAS_NUM_THREADS, where the environment does not say otherwise),
  whose matmuls run Triton's tl.dot in its interpreter: two workers on two
  cores would otherwise spin-wait on each other's threads there too (the long
  float16 case of the check grid: a third more time).
* Triton's kernels run on CPU tensors in its interpreter: TRITON_INTERPRET=1
  unless the environment says otherwise (the GPU script sets 0).  Triton
  reads it when the kernels are first imported, so it is set here, first.
  (The kernels' module trims the interpreter's dead work when it is imported:
  `attngrad.strategies.triton.interpreter`.)
* The tests marked slow run first (`pytest_collection_modifyitems`), so that
  the two workers end together.
* Inductor compiles into a cache of this session's own: its FX-graph cache keys
  a graph by the custom ops' schemas, not by what their fake kernels return, so a
  cache left by another version of attngrad could hand back a graph compiled for
  another output layout of ``attngrad::forward``.
* Hypothesis draws the same examples on every run: the "repeatable" profile,
  loaded here, is derandomized (each test's examples follow from its own code) and
  keeps no example database (it ignores ``--hypothesis-seed``).
  ``--hypothesis-profile=explore`` (``make explore``) draws fresh ones, from
  ``--hypothesis-seed`` when given.  Either way the draws
  depend on that alone: Hypothesis would also mix in constants it reads from the
  loaded modules of the project, and which are loaded when the property tests
  start differs with the tests a worker ran before (Inductor's generated code
  among them) and with every edit of the source -- a failure's seed would then
  stop reproducing it.  Both profiles print the blob that replays a failure.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# one BLAS thread for numpy (Triton's interpreter runs tl.dot as numpy matmuls), as for torch
# below; set before numpy is first imported, which reads it then
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import atexit
import shutil
import tempfile

if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _inductor_cache = tempfile.mkdtemp(prefix="attngrad-inductor-")
    atexit.register(shutil.rmtree, _inductor_cache, ignore_errors=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _inductor_cache

import zlib
from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings
from hypothesis.internal.conjecture import providers as _hypothesis_providers

settings.register_profile("repeatable", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, database=None, print_blob=True)
settings.load_profile("repeatable")
# no constants from the project's modules (module docstring): an empty pool at every draw
_hypothesis_providers._get_local_constants = _hypothesis_providers.Constants


@pytest.fixture(autouse=True)
def _seed_from_test_id(request: pytest.FixtureRequest) -> int:
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    return seed


@pytest.fixture(autouse=True, scope="session")
def _nan_filled_allocations() -> Iterator[None]:
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_filling = torch.utils.deterministic.fill_uninitialized_memory
    # warn_only: on CPU a missing deterministic kernel should warn, not fail a test
    # about attention; the NaN fill is what this fixture is for.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    # One intra-op thread: the tensors here are small, and `pytest -n 2` on two
    # cores would otherwise run 2 workers x N threads that spin-wait on each
    # other (measured: 45 us per attention call alone, 0.4-20 ms oversubscribed).
    # It also keeps float32 reduction order independent of the machine's cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.utils.deterministic.fill_uninitialized_memory = was_filling  # type: ignore[attr-defined]
    torch.use_deterministic_algorithms(was_deterministic, warn_only=was_warn_only)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked slow first, each group in its own order: `make test`'s workers
    (``--dist worksteal``) take the run in two halves and steal from each other's ends, so a
    long test that started last would keep one core busy after the other has finished."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
