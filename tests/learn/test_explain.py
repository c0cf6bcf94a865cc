"""`attngrad explain`: the grad_fn graph of each path and the tensors it saves.

The facts checked are the chapter's: which node saves what, how many bytes (against the
saved-bytes formulas and against `saved_tensors_hooks`), and the order backward runs the nodes
(recorded from the autograd engine itself).
"""

from __future__ import annotations

import pytest
import torch

import attngrad
from attngrad.cli import app as cli
from attngrad.cli.explain import explain_text
from attngrad.core.contract import Shapes
from attngrad.core.interface import saved_bytes
from attngrad.learn.explain import BASELINES, NodeReport, PathReport, backward_order, explain
from attngrad.strategies import REGISTRY

# Nq != Nk != d so that a shape mix-up (P^T for P, Nk for Nq) cannot pass; B, H > 1 so
# that per-head counts are multiplied out.
B, H, NQ, NK, D = 2, 3, 5, 7, 4


@pytest.fixture(scope="module")
def reports() -> dict[str, PathReport]:
    return {r.path: r for r in explain(B, H, NQ, NK, D)}


def _custom_node(report: PathReport) -> NodeReport:
    (node,) = [n for n in report.nodes if n.name.endswith("AttentionBackward")]
    return node


def test_paths_are_the_baselines_then_every_strategy(reports: dict[str, PathReport]) -> None:
    assert list(reports) == [*BASELINES, *attngrad.STRATEGIES]


def test_explicit_node_saves_q_k_v_and_the_whole_p(reports: dict[str, PathReport]) -> None:
    node = _custom_node(reports["explicit"])
    assert node.name == "ExplicitAttentionBackward"
    assert [t.role for t in node.saved] == ["q", "k", "v", "P", "stats"]
    assert [t.is_input for t in node.saved] == [True, True, True, False, False]
    p = node.saved[3]
    assert p.shape == (B, H, NQ, NK) and p.nbytes == B * H * NQ * NK * 4
    stats_bytes = B * H * NQ * 2 * 4  # (m, log l) per row: lse, and its gradient, come from them
    assert reports["explicit"].kept_bytes == B * H * NQ * NK * 4 + stats_bytes


def test_recompute_node_saves_row_stats_of_b_h_n_2_float32(reports: dict[str, PathReport]) -> None:
    node = _custom_node(reports["recompute"])
    assert [t.role for t in node.saved] == ["q", "k", "v", "stats"]
    stats = node.saved[3]  # each query row's max m and log l
    assert stats.shape == (B, H, NQ, 2) and stats.dtype == torch.float32
    assert stats.nbytes == B * H * NQ * 2 * 4
    assert node.none_slots == 3  # O (not needed) and the mask tensors of a call without a mask


def test_flash_node_saves_q_k_v_o_and_row_stats(reports: dict[str, PathReport]) -> None:
    node = _custom_node(reports["flash"])
    assert [t.role for t in node.saved] == ["q", "k", "v", "O", "stats"]
    assert node.saved[3].shape == (B, H, NQ, D)
    assert [t.role for t in reports["flash"].kept] == ["O", "stats"]


def test_plain_path_softmax_node_saves_its_result_p(reports: dict[str, PathReport]) -> None:
    (softmax,) = [n for n in reports["pytorch-math"].nodes if n.name == "SoftmaxBackward0"]
    (result,) = softmax.saved
    assert (result.slot, result.role, result.shape) == ("result", "P", (B, H, NQ, NK))
    # the P @ v matmul saves a view of the same P: kept alive once, not twice
    assert [t.role for t in reports["pytorch-math"].kept] == ["P"]


def test_sdpa_math_saves_p_too(reports: dict[str, PathReport]) -> None:
    roles = [t.role for t in reports["sdpa-math"].kept]
    assert "P" in roles
    assert reports["sdpa-math"].kept_bytes >= B * H * NQ * NK * 4


@pytest.mark.parametrize("path", [*BASELINES, *attngrad.STRATEGIES])
def test_hooks_total_equals_graph_total(reports: dict[str, PathReport], path: str) -> None:
    r = reports[path]
    # the only tensors hooks never see are Python scalars wrapped as 0-dim tensors (the
    # `* scale` of the plain path); everything else was packed exactly once
    assert all(t.shape == () for t in r.unhooked)
    assert r.graph_count == r.hooked_count + len(r.unhooked)
    assert r.graph_bytes == r.hooked_bytes + sum(t.nbytes for t in r.unhooked)
    if path in attngrad.STRATEGIES:
        assert r.unhooked == [] and r.graph_bytes == r.hooked_bytes


@pytest.mark.parametrize(
    "dtype",
    [torch.float64, torch.float32, torch.float16, torch.bfloat16],
    ids=["float64", "float32", "float16", "bfloat16"],
)
def test_saved_bytes_follow_each_strategys_declaration(dtype: torch.dtype) -> None:
    # what each graph keeps is what its strategy module declares (`saves`); the
    # declarations themselves are checked against the design table in test_ledger
    by_path = {r.path: r.graph_bytes for r in explain(B, H, NQ, NK, D, dtype=dtype)}
    shapes = Shapes((B,), H, H, NQ, NK, D, D)
    for path in ("explicit", "recompute", "flash"):
        assert by_path[path] == saved_bytes(REGISTRY[path], shapes, dtype), path


def _reachable(o: torch.Tensor) -> set[object]:
    seen, stack = set(), [o.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack += [n for n, _ in node.next_functions]
    return seen


@pytest.mark.parametrize("path", ["plain", *attngrad.STRATEGIES])
def test_backward_order_is_recorded_from_the_engine(path: str) -> None:
    q, k, v = (torch.randn(B, H, n, D, requires_grad=True) for n in (NQ, NK, NK))
    if path == "plain":
        o = torch.softmax(q @ k.transpose(-2, -1) * D**-0.5, dim=-1) @ v
    else:
        o = attngrad.attention(q, k, v, strategy=path)
    nodes = _reachable(o)
    order = backward_order(o)
    # backward really ran: every node once, O's grad_fn first, and the gradients arrived
    assert len(order) == len(nodes) and set(order) == nodes
    assert order[0] is o.grad_fn
    assert all(x.grad is not None for x in (q, k, v))
    # a node runs only after every node that sends it a gradient
    position = {node: i for i, node in enumerate(order)}
    for node in order:
        assert all(position[n] > position[node] for n, _ in node.next_functions if n is not None)


def test_backward_order_needs_a_graph() -> None:
    with pytest.raises(ValueError, match="grad_fn"):
        backward_order(torch.ones(3))


@pytest.mark.parametrize("path", [*BASELINES, *attngrad.STRATEGIES])
def test_steps_are_a_topological_order(reports: dict[str, PathReport], path: str) -> None:
    nodes = reports[path].nodes
    assert [n.step for n in nodes] == list(range(1, len(nodes) + 1))
    assert all(s > n.step for n in nodes for s in n.next_steps)
    assert sorted(n.leaf for n in nodes if n.leaf) == ["k", "q", "v"]


def test_causal_plain_path_saves_its_mask_the_strategies_none() -> None:
    by_path = {r.path: r for r in explain(1, 1, 4, 6, 4, is_causal=True)}
    (fill,) = [n for n in by_path["pytorch-math"].nodes if n.name == "MaskedFillBackward0"]
    assert [(t.role, t.shape, t.dtype) for t in fill.saved] == [("mask", (4, 6), torch.bool)]
    for name in attngrad.STRATEGIES:
        assert "mask" not in {t.role for t in by_path[name].saved}


def test_report_text_names_every_path_and_states_the_point(
    reports: dict[str, PathReport],
) -> None:
    text = explain_text(list(reports.values()))
    for name in [*BASELINES, *attngrad.STRATEGIES]:
        assert f"== {name}:" in text
    assert "ExplicitAttentionBackward" in text and "SoftmaxBackward0" in text
    assert "same formulas" in text
    assert "dV = P^T dO" in text and "dS = P∘(dP − rowsum(P∘dP))" in text
    summary = text.split("== summary")[1]
    line = {ln.split()[0]: ln for ln in summary.splitlines() if " keeps " in ln}
    assert f"P (Nq×Nk per head, float32) {B * H * NQ * NK * 4} B" in line["explicit"]
    assert f"stats (Nq×2 per head: m, log l, float32) {B * H * NQ * 2 * 4} B" in line["recompute"]
    # recompute keeps 2 numbers per row where the plain path keeps Nk: the ratio is 2/Nk
    assert f"{2 / NK:.2f}× pytorch-math" in line["recompute"]
    assert "O (Nq×d per head" in line["flash"] and "stats" in line["flash"]


def test_cli_prints_the_report_and_returns_zero(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["explain", "--seq-q", "3", "--seq-k", "5", "--dtype", "float64"]
    assert cli.main([*argv, "--strategy", "flash", "--strategy", "recompute"]) == 0
    out = capsys.readouterr().out
    assert "== flash:" in out and "== recompute:" in out and "== explicit:" not in out
    assert "== pytorch-math:" in out  # the baseline of the ratios always runs
    assert "q [1, 2, 3, 4], k, v [1, 2, 5, 4], float64" in out


@pytest.mark.parametrize(
    "argv",
    [["--seq-q", "0"], ["--dtype", "int8"], ["--strategy", "nope"]],
    ids=["zero-length", "bad-dtype", "bad-strategy"],
)
def test_cli_rejects_bad_options(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["explain", *argv])
    assert info.value.code == 2


def test_library_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="seq_q"):
        explain(seq_q=0)
    with pytest.raises(ValueError, match="nope"):
        explain(strategies=["nope"])
    with pytest.raises(TypeError, match="dtype"):
        explain(dtype=torch.int32)


@pytest.fixture(scope="module")
def second() -> dict[str, PathReport]:
    return {r.path: r for r in explain(B, H, NQ, NK, D, order=2)}


@pytest.mark.parametrize("path", attngrad.STRATEGIES)
def test_order_2_walks_attention_gradients_and_what_it_saves(
    second: dict[str, PathReport], path: str
) -> None:
    r = second[path]
    (node,) = [n for n in r.nodes if n.name == "AttentionGradientsBackward"]
    roles = [t.role for t in node.saved]
    assert roles[:4] == ["dO", "q", "k", "v"]
    want = {"explicit": ["P", "stats"], "recompute": ["stats"]}.get(path, ["O", "stats"])
    assert roles[4:] == want
    # dO and q, k, v by reference; the create_graph backward packed exactly what the node holds
    assert r.order == 2 and r.graph_bytes == r.hooked_bytes and r.unhooked == []
    assert r.kept_bytes == sum(t.nbytes for t in node.saved if not t.is_input)
    assert sorted(n.leaf for n in r.nodes if n.leaf) == ["k", "q", "v"]
    assert all(s > n.step for n in r.nodes for s in n.next_steps)


def test_order_2_plain_path_reaches_forward_and_says_so(second: dict[str, PathReport]) -> None:
    r = second["pytorch-math"]
    names = {n.name for n in r.nodes}
    assert "SoftmaxBackwardDataBackward0" in names and "SoftmaxBackward0" in names
    forward = [t for t in r.saved if t.forward]
    assert "P" in {t.role for t in forward}
    assert all(t.shape == () for t in r.unhooked)
    text = explain_text(list(second.values()))
    assert "order 2" in text.splitlines()[0] and "(saved by forward)" in text
    assert "AttentionGradientsBackward" in text


def test_cli_order_2_and_a_bad_order(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["explain", "--order", "2", "--seq-q", "3", "--strategy", "flash"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "AttentionGradientsBackward" in out and "create_graph=True" in out
    with pytest.raises(SystemExit) as info:
        cli.main(["explain", "--order", "3"])
    assert info.value.code == 2
    with pytest.raises(ValueError, match="order"):
        explain(order=3)
