"""``attngrad explain [--strategy NAME ...] [--order 1|2]``.

The grad_fn graph of each path and the tensors it saves (`attngrad.learn.explain`),
shown as text by `explain_text`: per path its nodes in the order backward runs them,
then a summary of what each path keeps alive.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

import torch

from attngrad.cli.args import add_size, add_sizes, add_strategy, chosen_strategies, sizes
from attngrad.core.contract import DTYPES, dtype_name
from attngrad.learn.explain import PathReport, SavedTensor, explain
from attngrad.strategies import STRATEGIES
from attngrad.tools.memory import format_bytes
from attngrad.tools.paths import PYTORCH_MATH

__all__ = ["add_explain", "explain_text", "run_explain"]


def _per_head(t: SavedTensor, nq: int, nk: int) -> str:
    """The tensor's size per (batch, head) in symbols: N×N for P, N×2 for (m, log l), N×d for O."""
    n_q, n_k = ("N", "N") if nq == nk else ("Nq", "Nk")
    base = t.role.split("*")[0].split(" ")[0]
    if base in ("P", "S"):
        return f"{n_q}×{n_k} per head"
    if base == "stats":
        return f"{n_q}×2 per head: m, log l"
    if base in ("O", "q"):
        return f"{n_q}×d per head"
    if base in ("k", "v"):
        return f"{n_k}×d per head"
    if base == "scalar":
        return "one number"
    return "shape " + "×".join(map(str, t.shape))


def _kept_line(r: PathReport) -> str:
    _, _, nq, nk, _ = r.shape
    parts = [
        f"{t.role} ({_per_head(t, nq, nk)}, {dtype_name(t.dtype)}) {format_bytes(t.nbytes)}"
        for t in r.kept
    ]
    return " + ".join(parts) if parts else "nothing"


def _explain_path(r: PathReport) -> list[str]:
    lines = [f"== {r.path}: {r.description} =="]
    width = max((len(n.name) + 2 * n.depth for n in r.nodes), default=0) + 8
    for n in r.nodes:
        pad = "  " * (n.depth + 1)
        head = f"{pad}#{n.step} {n.name}" + (f" -> {n.leaf}.grad" if n.leaf else "")
        nxt = ", ".join(f"#{s}" for s in n.next_steps)
        lines.append((f"{head:<{width}}" + (f" then {nxt}" if nxt else "")).rstrip())
        for t in n.saved:
            kind = "input" if t.is_input else "computed"
            shape = "[" + ", ".join(map(str, t.shape)) + "]"
            note = (
                ""
                if t.hooked
                else ("  (saved by forward)" if t.forward else "  (not seen by hooks)")
            )
            lines.append(
                f"{pad}    saved {t.slot:<17} {shape:<15} {dtype_name(t.dtype):<9}"
                f" {format_bytes(t.nbytes):>10}  {t.role} ({kind}){note}"
            )
        if n.none_slots:
            lines.append(f"{pad}    saved {n.none_slots} × None (optional inputs not given)")
    check = "agree" if r.graph_bytes == r.hooked_bytes else "differ"
    by = "" if r.order == 1 else " by the create_graph backward"
    lines.append(
        f"  total: {r.graph_count} saved tensors{by}, {format_bytes(r.graph_bytes)} found on "
        f"the graph; saved_tensors_hooks packed {r.hooked_count}, "
        f"{format_bytes(r.hooked_bytes)} ({check})"
    )
    forward = [t for t in r.saved if t.forward]
    if forward:
        lines.append(
            f"  and {len(forward)} saved by forward, {format_bytes(sum(t.nbytes for t in forward))}: "
            "the gradients' graph reaches forward's nodes, which keep them"
        )
    if r.unhooked:
        extra = format_bytes(sum(t.nbytes for t in r.unhooked))
        lines.append(
            f"  the {extra} difference: {len(r.unhooked)} 0-dim tensor(s) wrapping a "
            "Python scalar, which PyTorch saves without calling the hooks"
            if all(not t.shape for t in r.unhooked)
            else f"  the {extra} difference: tensors the hooks did not see"
        )
    lines.append(
        f"  inputs saved by reference (no new memory): {', '.join(r.inputs_saved) or 'none'}"
    )
    until = "backward" if r.order == 1 else "the second backward"
    lines.append(
        f"  kept alive for {until} besides the inputs: {format_bytes(r.kept_bytes)} = "
        f"{_kept_line(r)}"
    )
    return lines


def _explain_summary(reports: Sequence[PathReport]) -> list[str]:
    first = reports[0]
    b, h, nq, nk, d = first.shape
    base = next((r for r in reports if r.path == PYTORCH_MATH), first)
    name_w = max(len(r.path) for r in reports)
    between = (
        "between forward and backward besides q, k, v"
        if first.order == 1
        else "from the create_graph backward to the second backward besides q, k, v, dO"
    )
    lines = [
        "== summary: same formulas, different paths ==",
        "  every path differentiates the same forward with the same formulas:",
        "    dV = P^T dO    dP = dO V^T    dS = P∘(dP − rowsum(P∘dP))    dQ = s·dS K    dK = s·dS^T Q",
        f"  what each path keeps alive {between} "
        f"(B={b}, H={h}, Nq={nq}, Nk={nk}, d={d}, {dtype_name(first.dtype)}):",
    ]
    for r in reports:
        ratio = r.kept_bytes / base.kept_bytes if base.kept_bytes else math.nan
        lines.append(
            f"    {r.path:<{name_w}}  keeps {_kept_line(r)}"
            f"  = {format_bytes(r.kept_bytes)}, {ratio:.2f}× {base.path}"
        )
    recompute_like = [r.path for r in reports if r.path in ("recompute", "flash")]
    if recompute_like and first.order == 1:
        lines.append(
            f"  {' and '.join(recompute_like)} pay for the smaller ledger in backward: they "
            "recompute S = s·q k^T and P = exp((S − m) − log l) instead of reading a saved P"
        )
    # the same per-head ledger at a long-context shape, from the same element sizes
    n, dd = 4096, 64
    elem = first.dtype.itemsize
    stat_elem = 8 if first.dtype == torch.float64 else 4
    lines.append(
        f"  P grows as N², O and (m, log l) as N: at N={n}, d={dd} per head, "
        f"P = {format_bytes(n * n * elem)}, O = {format_bytes(n * dd * elem)}, "
        f"(m, log l) = {format_bytes(2 * n * stat_elem)}"
    )
    return lines


def explain_text(reports: Sequence[PathReport]) -> str:
    """Per path its nodes in the order backward ran them (indented by depth from O) with
    their saved tensors and the totals, then a summary comparing what each path keeps."""
    if not reports:
        return ""
    b, h, nq, nk, d = reports[0].shape
    graph = (
        "Each path's grad_fn graph from O, #n = the step at which the autograd engine ran "
        "the node in backward (indent = distance from O); under each node the tensors it "
        "saved for backward."
        if reports[0].order == 1
        else "Each path's double-backward graph: the grad_fn graph of dq, dk, dv from "
        "grad(O, (q, k, v), dO = ones, create_graph=True), #n = the step at which the "
        "autograd engine ran the node in the second backward (indent = distance from "
        "dq, dk, dv); under each node the tensors that backward saved for the second."
    )
    lines = [
        f"attngrad explain: q [{b}, {h}, {nq}, {d}], k, v [{b}, {h}, {nk}, {d}], "
        f"{dtype_name(reports[0].dtype)}" + ("" if reports[0].order == 1 else ", order 2"),
        graph,
        "",
    ]
    for r in reports:
        lines += [*_explain_path(r), ""]
    lines += _explain_summary(reports)
    return "\n".join(lines)


def run_explain(args: argparse.Namespace) -> int:
    """The ``explain`` command: returns the exit status."""
    strategies = chosen_strategies("explain", args.strategy, torch.device("cpu"), interpreted=True)
    if strategies is None:
        return 2
    given = sizes(args, "batch", "heads", "seq_q", "seq_k", "head_dim")
    reports = explain(
        **given,
        dtype=DTYPES[args.dtype],
        is_causal=args.causal,
        strategies=strategies,
        order=args.order,
    )
    print(explain_text(reports))
    return 0


def add_explain(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``explain`` subcommand to ``attngrad``'s subparsers."""
    p = sub.add_parser(
        "explain",
        help="show each path's grad_fn graph and the tensors it saves for backward",
        description=(
            "For a small input, the grad_fn graph of PyTorch's plain math, SDPA's MATH "
            "backend and each strategy, numbered in the order the autograd engine runs "
            "backward, with the tensors each node saved, and what each path keeps alive."
        ),
    )
    add_sizes(p, heads=2, head_dim=4)
    add_size(p, "--seq-q", 8, "Nq, query length (default 8)")
    add_size(p, "--seq-k", 8, "Nk, key length (default 8)")
    p.add_argument("--causal", action="store_true", help="causal mask (top-left aligned)")
    p.add_argument(
        "--order",
        type=int,
        choices=(1, 2),
        default=1,
        help="1: the graph from O (default); 2: the double-backward graph, from dq, dk, dv "
        "built with create_graph=True",
    )
    add_strategy(
        p,
        STRATEGIES,
        "explain only this strategy (repeatable; default all); the baselines always run",
    )
    p.set_defaults(run=run_explain)
