"""`attngrad.tools.paths`: each baseline named once, every path run the same way."""

from __future__ import annotations

import pytest
import torch

from attngrad.cli import app as cli
from attngrad.tools.paths import (
    BASELINES,
    SDPA_BASELINES,
    baseline_name,
    hessian_vector_product,
    path_fn,
)


def test_sdpa_baselines_are_the_registered_backends() -> None:
    assert SDPA_BASELINES == ("sdpa-math", "sdpa-flash")
    assert [b.name for b in BASELINES.values()] == list(BASELINES)
    assert BASELINES["pytorch-math"].backend is None


@pytest.mark.parametrize("text", ["math", "sdpa-math"])
def test_baseline_name_takes_the_backend_alone_or_the_one_spelling(text: str) -> None:
    assert baseline_name(text) == "sdpa-math"


@pytest.mark.parametrize("text", ["cudnn", "pytorch-math", "sdpa-"])
def test_baseline_name_refuses_what_is_no_sdpa_baseline(text: str) -> None:
    with pytest.raises(ValueError, match=f"got '{text}'; try sdpa-math"):
        baseline_name(text)


def test_bench_takes_both_spellings_of_a_baseline() -> None:
    for given in ("flash", "sdpa-flash"):
        args = cli._parser().parse_args(["bench", "--baseline", given])
        assert args.baseline == ["sdpa-flash"]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("path", ["pytorch-math", "sdpa-math", "explicit", "flash"])
def test_every_path_computes_the_same_output(path: str, causal: bool, gqa: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 6, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2 if gqa else 4, 6, 8, generator=gen, dtype=torch.float64) for _ in "kv")
    expected = path_fn("sdpa-math", causal, gqa)(q, k, v)
    torch.testing.assert_close(path_fn(path, causal, gqa)(q, k, v), expected)


def test_hessian_vector_product_of_a_quadratic() -> None:
    # L = <x, A x> / 2 with g = A x: the product along w is A w
    a = torch.tensor([[2.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
    x = torch.randn(2, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad((x @ a @ x) / 2, (x,), create_graph=True)
    w = torch.tensor([1.0, -1.0], dtype=torch.float64)
    (hw,) = hessian_vector_product([g], [x], [w])
    torch.testing.assert_close(hw, a @ w)
