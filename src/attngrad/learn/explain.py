r"""`attngrad explain`: the grad_fn graph of each path and the tensors it saves.

Every path computes the same forward and differentiates it with the same formulas
(see `attngrad.core.ops`)::

    dV = P^T dO    dP = dO v^T    dS = P * (dP - rowsum(P * dP))    dq = s dS k    dk = s dS^T q

What differs is the path: which nodes ``O.grad_fn`` chains together, and what each node
saves between forward and backward.  For a small input this module runs forward on

* ``pytorch-math``: ``softmax(q @ k^T * scale) @ v`` written with plain torch ops,
* ``sdpa-math``: ``F.scaled_dot_product_attention`` under ``SDPBackend.MATH``,
* every strategy in `attngrad.STRATEGIES`,

then lists, per grad_fn node reachable from O, each saved tensor: shape, dtype, bytes
(numel * element_size) and whether it is an input q, k, v (same storage) or computed in
forward (P, the row statistics m and log l, O, ...), cross-checked against the bytes
`torch.autograd.graph.saved_tensors_hooks` packed.  Backward then runs once, numbering
the nodes in the order the engine runs them (`backward_order`).  The text:
`attngrad.cli.explain.explain_text`.

With ``order=2`` the graph shown is the double-backward one: the first-order
gradients dq, dk, dv are built with ``create_graph=True`` (upstream gradient dO =
ones), and the walk starts from their grad_fns (``AttentionGradientsBackward`` on
every strategy, whose backward is the tiled `SecondOrder`); each node's saved tensors
are what that backward packed, cross-checked against the hooks in the same way, and
the numbering is the engine's order in the second backward (from dq, dk, dv with
gradient ones: a Hessian-vector product).

>>> reports = explain(seq_q=8, seq_k=8)
>>> [r.path for r in reports][:3]
['pytorch-math', 'sdpa-math', 'explicit']
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import Node, saved_tensors_hooks

from attngrad.core.contract import DTYPES
from attngrad.strategies import REGISTRY, STRATEGIES, available
from attngrad.tools.paths import BASELINES as PATH_BASELINES
from attngrad.tools.paths import PYTORCH_MATH, SDPA_MATH, path_fn

__all__ = [
    "BASELINES",
    "ORDERS",
    "NodeReport",
    "PathReport",
    "SavedTensor",
    "backward_order",
    "explain",
]

BASELINES: tuple[str, ...] = (PYTORCH_MATH, SDPA_MATH)


_INPUTS = ("q", "k", "v")
# what the caller hands the first backward: saved by reference too, at order 2
_GIVEN = (*_INPUTS, "dO")
ORDERS = (1, 2)


@dataclass(frozen=True)
class SavedTensor:
    """One tensor a node saved for backward.

    ``slot`` names where the node keeps it (``self``, ``result``, ``saved_tensors[3]``);
    ``role`` says what it is: ``q``/``k``/``v`` (an input's storage), ``O`` (the output's
    storage), ``P`` (rows sum to 1), ``S`` (scores), ``stats`` (each query row's max m and
    log l: [..., Nq, 2]), ``q*c copy`` (q times c, maybe in another dtype), ``mask``,
    ``scalar`` (0-dim) or ``tensor``.  ``hooked`` is False when the tensor did not pass
    through ``saved_tensors_hooks`` (PyTorch saves a Python scalar wrapped as a 0-dim
    tensor without calling the hooks).
    """

    slot: str
    role: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    is_input: bool
    hooked: bool
    storage: int  # data_ptr of the storage: two saved views of one tensor share it
    forward: bool = False  # order 2: saved by forward's graph, which the gradients reach


@dataclass(frozen=True)
class NodeReport:
    """One grad_fn node, numbered by the step at which backward runs it (1 = first).

    ``depth`` is the fewest edges from O's grad_fn; ``next_steps`` are the steps of the
    nodes it sends gradients to; ``none_slots`` counts ``saved_tensors`` entries of a custom
    autograd.Function that are None (optional inputs not given); ``leaf`` names the input an
    AccumulateGrad node writes ``.grad`` of.
    """

    step: int
    name: str
    depth: int
    sequence_nr: int
    next_steps: tuple[int, ...]
    saved: tuple[SavedTensor, ...]
    none_slots: int = 0
    leaf: str | None = None


@dataclass(frozen=True)
class PathReport:
    """The graph of one path for q: [B, H, Nq, d], k, v: [B, H, Nk, d].

    ``hooked_count`` / ``hooked_bytes`` are what ``saved_tensors_hooks`` packed during
    forward; the ``graph_*`` properties are what the walk found on the nodes.
    """

    path: str
    description: str
    shape: tuple[int, int, int, int, int]  # (B, H, Nq, Nk, d)
    dtype: torch.dtype
    nodes: tuple[NodeReport, ...]
    hooked_count: int
    hooked_bytes: int
    output_shape: tuple[int, ...] = field(default=())
    order: int = 1  # 2: the graph of the create_graph=True gradients (module docstring)

    @property
    def saved(self) -> list[SavedTensor]:
        """Every saved tensor, node by node in backward order (a view saved twice counts twice)."""
        return [t for n in self.nodes for t in n.saved]

    @property
    def graph_count(self) -> int:
        """Saved tensors on the graph (at order 2 those of the create_graph backward)."""
        return len([t for t in self.saved if not t.forward])

    @property
    def graph_bytes(self) -> int:
        """Sum of numel * element_size over every saved tensor of every node (at order 2
        those of the create_graph backward, which the hooks watched)."""
        return sum(t.nbytes for t in self.saved if not t.forward)

    @property
    def unhooked(self) -> list[SavedTensor]:
        """Saved tensors the hooks did not see: graph_bytes - hooked_bytes of them."""
        return [t for t in self.saved if not t.hooked and not t.forward]

    @property
    def kept(self) -> list[SavedTensor]:
        """The computed (non-input) tensors kept alive for backward, one per storage.

        Of several saved views of one storage the largest stands for it.  0-dim tensors
        (a Python scale wrapped as a tensor) are left out: they are no activation memory.
        """
        by_storage: dict[int, SavedTensor] = {}
        for t in self.saved:
            held = by_storage.get(t.storage)
            if not t.is_input and t.shape and (held is None or t.nbytes > held.nbytes):
                by_storage[t.storage] = t
        return list(by_storage.values())

    @property
    def kept_bytes(self) -> int:
        """Bytes kept alive between forward and backward beyond the inputs q, k, v."""
        return sum(t.nbytes for t in self.kept)

    @property
    def inputs_saved(self) -> list[str]:
        """Which of q, k, v the path saves (by reference: no new memory)."""
        roles = {t.role for t in self.saved if t.is_input}
        return [name for name in _INPUTS if name in roles]


# --- the order backward runs the graph in ------------------------------------------------


def backward_order(out: torch.Tensor | Sequence[torch.Tensor]) -> list[Node]:
    """Run backward from ``out`` (gradient ones) and return the nodes in the order the engine ran them.

    ``out``: one tensor, or several (the gradients dq, dk, dv of a ``create_graph=True``
    backward) run in one backward.  A pre-hook on every node reachable from their
    grad_fns appends the node when the engine calls it (AccumulateGrad included), so
    this is the engine's own order, not a model of its scheduling.  Backward frees the
    saved tensors: read them first.
    """
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    if not outs or any(o.grad_fn is None for o in outs):
        raise ValueError(
            "out has no grad_fn; pass the output of a forward on leaves that require grad"
        )
    ran: list[Node] = []

    def recorder(node: Node) -> Callable[..., None]:
        return lambda *_: ran.append(node)

    roots = [o.grad_fn for o in outs]
    handles = [node.register_prehook(recorder(node)) for node in _depths(*roots)]  # type: ignore[arg-type]
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    for handle in handles:
        handle.remove()
    return ran


def _depths(*roots: Node) -> dict[Node, int]:
    """Fewest edges from the nearest of ``roots`` to each node reachable from them, roots
    first (breadth first)."""
    depth = dict.fromkeys(roots, 0)
    frontier = list(depth)
    while frontier:
        following: list[Node] = []
        for node in frontier:
            for nxt, _ in node.next_functions:
                if nxt is not None and nxt not in depth:
                    depth[nxt] = depth[node] + 1
                    following.append(nxt)
        frontier = following
    return depth


# --- what a saved tensor is --------------------------------------------------------------


def _storage(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def _scaled_copy(t: torch.Tensor, x: torch.Tensor) -> float | None:
    """c when ``t`` holds c * x laid out like x (a scaled copy, maybe in another dtype).

    ``t`` may be a strided view (e.g. transposed for a matmul) of that copy: x is viewed
    with t's strides and offset before the comparison.  None when it is no such copy.
    """
    elements = t.untyped_storage().nbytes() // t.element_size()
    if elements != x.numel() or not x.is_contiguous() or t.numel() == 0:
        return None
    if not t.dtype.is_floating_point:
        return None
    xv = x.detach().as_strided(t.shape, t.stride(), t.storage_offset()).double()
    tv = t.detach().double()
    i = int(xv.abs().argmax())
    if float(xv.flatten()[i]) == 0.0:
        return None
    c = float(tv.flatten()[i] / xv.flatten()[i])
    tol = 1e-9 if torch.float64 == x.dtype == t.dtype else 1e-2  # 16-bit rounding of c * x
    return c if torch.allclose(tv, c * xv, rtol=tol, atol=tol) else None


def _role(
    t: torch.Tensor,
    named: dict[int, str],
    inputs: dict[str, torch.Tensor],
    b_h_nq_nk: tuple[int, int, int, int],
) -> str:
    """What ``t`` is; see `SavedTensor`.  ``named`` maps storages to q, k, v, O, mask."""
    if _storage(t) in named:
        return named[_storage(t)]
    if t.dim() == 0:
        return "scalar"
    if t.dtype == torch.bool:
        return "mask"
    for name, x in inputs.items():
        c = _scaled_copy(t, x)
        if c is not None:
            copy = name if c == 1.0 else f"{name}*{c:.3g}"
            return f"{copy} copy"
    b, h, nq, nk = b_h_nq_nk
    if t.numel() == b * h * nq * nk and t.shape[-1] == nk and t.dtype.is_floating_point:
        rowsum = t.detach().double().sum(dim=-1)
        return "P" if torch.allclose(rowsum, torch.ones_like(rowsum), atol=1e-2) else "S"
    if t.numel() == 2 * b * h * nq and t.shape[-2:] == (nq, 2):
        return "stats"
    return "tensor"


def _layout(t: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]:
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


def _take(
    unmatched: Counter[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]],
    layout: tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype],
) -> bool:
    """Whether a packed tensor with this layout is still unmatched; if so, match it."""
    if unmatched[layout] <= 0:
        return False
    unmatched[layout] -= 1
    return True


def _saved_of(node: Node) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """(slot, tensor) pairs a node saved, and how many custom-Function slots are None.

    Built-in nodes expose each saved value as an attribute ``_saved_<name>`` (a tensor, a
    tuple/list of tensors, or a non-tensor such as a dim or size); a custom
    autograd.Function's node (a BackwardCFunction) gives ``saved_tensors``.
    """
    if isinstance(node, BackwardCFunction):
        saved = node.saved_tensors
        found = [(f"saved_tensors[{i}]", t) for i, t in enumerate(saved) if t is not None]
        return found, sum(t is None for t in saved)
    found = []
    for attr in sorted(a for a in dir(node) if a.startswith("_saved_")):
        value = getattr(node, attr)
        slot = attr.removeprefix("_saved_")
        if isinstance(value, torch.Tensor):
            found.append((slot, value))
        elif isinstance(value, (tuple, list)):
            found += [
                (f"{slot}[{i}]", x) for i, x in enumerate(value) if isinstance(x, torch.Tensor)
            ]
    return found, 0


# --- the paths -------------------------------------------------------------------------


def _description(path: str) -> str:
    if path in PATH_BASELINES:
        return PATH_BASELINES[path].about
    try:
        doc = sys.modules[type(REGISTRY[path]).__module__].__doc__ or ""
    except ImportError:
        doc = ""
    first = doc.strip().splitlines()[0] if doc.strip() else ""
    return first or f'attngrad.attention(..., strategy="{path}")'


def _run_path(
    path: str,
    base: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    is_causal: bool,
    order: int = 1,
) -> PathReport:
    """Forward ``path`` on fresh leaves copied from ``base`` (at ``order`` 2 also the
    create_graph backward), read what each node saved, then run backward to number the
    nodes in the engine's order, and report."""
    q, k, v = (x.detach().clone().requires_grad_() for x in base)
    b, h, nq, d = q.shape
    nk = k.shape[2]
    packed: list[torch.Tensor] = []
    before: list[torch.Tensor] = []  # order 2: what forward packed

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t)
        return t

    def forward() -> torch.Tensor:
        return path_fn(path, is_causal)(q, k, v)  # the baselines and strategies, as in ledger

    if order == 1:
        with saved_tensors_hooks(pack, lambda t: t):
            o = forward()
        outs = [o]
    else:
        with saved_tensors_hooks(lambda t: before.append(t) or t, lambda t: t):  # type: ignore[func-returns-value]
            o = forward()
        dout = torch.ones_like(o)
        with saved_tensors_hooks(pack, lambda t: t):
            outs = list(torch.autograd.grad(o, (q, k, v), dout, create_graph=True))
    if any(x.grad_fn is None for x in outs):
        what = "an output" if order == 1 else "first-order gradients"
        raise RuntimeError(f"path {path!r} returned {what} without grad_fn")
    inputs = {"q": q, "k": k, "v": v}
    named = {_storage(x): name for name, x in inputs.items()}
    named[_storage(o)] = "O"
    if order == 2:
        named[_storage(dout)] = "dO"
    leaves = {id(x): name for name, x in inputs.items()}
    # unpacking hands back a new Python tensor over the same memory: match by layout
    unmatched = Counter(_layout(t) for t in packed)
    # order 2: the plain paths' gradients reach forward's nodes, whose tensors forward packed
    by_forward = Counter(_layout(t) for t in before) if order == 2 else Counter()

    saved_by_node = {}
    depth = _depths(*(x.grad_fn for x in outs))  # type: ignore[misc,arg-type]
    for node in depth:
        found, none_slots = _saved_of(node)
        saved = tuple(
            SavedTensor(
                slot=slot,
                role=(role := _role(t, named, inputs, (b, h, nq, nk))),
                shape=tuple(t.shape),
                dtype=t.dtype,
                nbytes=t.numel() * t.element_size(),
                is_input=role in _GIVEN,
                hooked=(hooked := _take(unmatched, _layout(t))),
                storage=_storage(t),
                forward=not hooked and _take(by_forward, _layout(t)),
            )
            for slot, t in found
        )
        saved_by_node[node] = (saved, none_slots)
    ran = backward_order(outs)
    step = {node: i + 1 for i, node in enumerate(ran)}
    nodes = []
    for node in ran:
        saved, none_slots = saved_by_node[node]
        variable = getattr(node, "variable", None)
        nodes.append(
            NodeReport(
                step=step[node],
                name=type(node).__name__,  # name() spells AccumulateGrad with its C++ namespace
                depth=depth[node],
                sequence_nr=int(node._sequence_nr()),  # type: ignore[attr-defined]
                # a node the engine did not need to run (no gradient reaches it) has no step
                next_steps=tuple(step[n] for n, _ in node.next_functions if n in step),
                saved=saved,
                none_slots=none_slots,
                leaf=None if variable is None else leaves.get(id(variable)),
            )
        )
    return PathReport(
        path=path,
        description=_description(path),
        shape=(b, h, nq, nk, d),
        dtype=q.dtype,
        nodes=tuple(nodes),
        hooked_count=len(packed),
        hooked_bytes=sum(t.numel() * t.element_size() for t in packed),
        output_shape=tuple(o.shape),
        order=order,
    )


def explain(
    batch: int = 1,
    heads: int = 2,
    seq_q: int = 8,
    seq_k: int = 8,
    head_dim: int = 4,
    dtype: torch.dtype = torch.float32,
    is_causal: bool = False,
    strategies: Sequence[str] | None = None,
    seed: int = 0,
    order: int = 1,
) -> list[PathReport]:
    """One `PathReport` per path for q: [batch, heads, seq_q, head_dim], k, v: [.., seq_k, ..].

    The baselines `BASELINES` come first, then ``strategies`` (default: every one of
    `attngrad.STRATEGIES` that runs on CPU here, triton in its interpreter included).
    Inputs come from a generator seeded with ``seed``; each path gets its own leaf copies
    of the same values, and runs forward and backward once.  ``order`` 2: the graph of
    the first-order gradients built with ``create_graph=True`` and its second backward
    (module docstring).
    """
    sizes = dict(batch=batch, heads=heads, seq_q=seq_q, seq_k=seq_k, head_dim=head_dim)
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}; try {name}=8")
    if order not in ORDERS or isinstance(order, bool):
        raise ValueError(f"order must be one of {list(ORDERS)}, got {order!r}; try order=2")
    if dtype not in DTYPES.values():
        raise TypeError(f"dtype must be one of {list(DTYPES)}, got {dtype}; try torch.float32")
    if strategies is None:
        strategies = available(torch.device("cpu"), interpreted=True)
    chosen = list(strategies)
    unknown = [s for s in chosen if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; choose from {list(STRATEGIES)}")
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_q, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, heads, seq_k, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, heads, seq_k, head_dim, generator=gen).to(dtype)
    return [_run_path(path, (q, k, v), is_causal, order) for path in [*BASELINES, *chosen]]
