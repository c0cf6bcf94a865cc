"""torch.compile: attention traces as two opaque ops (`attngrad.call.compiled`), with no graph break.

``fullgraph=True`` raises on any graph break, so compiling at all is the
check that there is none.  The ops run the eager strategy code, so with the
same inputs and cotangent the compiled forward and backward equal eager's
bit for bit, dropout included (the forward op draws the seed from the
default generator, as eager `attention` does).  Most cases compile with the
"aot_eager" backend (dynamo + AOTAutograd, the part that could break);
one runs Inductor end to end.
"""

from __future__ import annotations

import pytest
import torch

import attngrad
from helpers import TENSOR_STRATEGIES, tiny_llama

B, HQ, HKV, N, D = 2, 4, 2, 40, 8


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    # the parametrized cases compile the same code object: without a reset
    # they would pile up recompiles and reach dynamo's recompile limit
    torch._dynamo.reset()


def _inputs(feature: str) -> tuple[tuple[torch.Tensor, ...], dict[str, object]]:
    q = torch.randn(B, HQ, N, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, HKV, N, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, HKV, N, D, dtype=torch.float64, requires_grad=True)
    kwargs: dict[str, object] = {"enable_gqa": True}
    if feature == "dead rows":
        keep = torch.rand(B, 1, N, N) > 0.4
        keep[:, :, :3] = False  # three rows attend nothing
        kwargs["attn_mask"] = keep
    elif feature == "bias":
        bias = torch.randn(B, 1, N, N, dtype=torch.float64)
        bias[..., :2, :] = torch.finfo(torch.float64).min  # padding-style rows
        kwargs["attn_mask"] = bias.requires_grad_()
    elif feature == "causal":
        kwargs["is_causal"] = True
    elif feature == "window":
        kwargs.update(window=(7, 0), align="bottom-right")
    elif feature == "dropout":
        kwargs.update(dropout_p=0.3, is_causal=True)
    elif feature == "softcap+sinks":
        kwargs.update(softcap=2.0, sinks=torch.randn(HQ, dtype=torch.float64, requires_grad=True))
    elif feature == "packed":
        kwargs.update(cu_seqlens_q=torch.tensor([0, 9, 9, 40]), is_causal=True)
    elif feature == "everything":  # but is_causal and a bool mask, which a float mask excludes
        _, kwargs = _inputs("bias")
        kwargs.update(window=(7, 0), align="bottom-right", dropout_p=0.3, softcap=2.0)
        kwargs.update(sinks=torch.randn(HQ, dtype=torch.float64, requires_grad=True))
        kwargs.update(cu_seqlens_q=torch.tensor([0, 9, 9, 40]))
    return (q, k, v), kwargs


def _run(fn, tensors, kwargs, dout):  # type: ignore[no-untyped-def]
    torch.manual_seed(1234)
    o = fn(*tensors, kwargs)
    wrt = [
        *tensors,
        *(t for t in kwargs.values() if isinstance(t, torch.Tensor) and t.requires_grad),
    ]
    return o, torch.autograd.grad(o, wrt, dout)


FEATURES = ("dead rows", "bias", "causal", "window", "dropout", "softcap+sinks", "packed")


# Under compile a strategy shows only in what its forward op saves (the fake kernel's
# shapes come from the strategy's `saves`); a feature shows in the ops' arguments, which the
# call builds alike for every strategy.  So each strategy compiles once, on every feature at
# once, and each feature once on its own, on flash (the one Inductor and the Llama run below).
@pytest.mark.parametrize(
    ("strategy", "feature"),
    [*((s, "everything") for s in TENSOR_STRATEGIES), *(("flash", f) for f in FEATURES)],
    ids=lambda x: x,
)
def test_fullgraph_matches_eager(strategy: str, feature: str) -> None:
    tensors, kwargs = _inputs(feature)

    def f(q, k, v, kw):  # type: ignore[no-untyped-def]
        return attngrad.attention(q, k, v, strategy=strategy, **kw)

    dout = torch.randn(B, HQ, N, D, dtype=torch.float64)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    o_c, g_c = _run(compiled, tensors, kwargs, dout)
    o_e, g_e = _run(f, tensors, kwargs, dout)
    assert not o_c.isnan().any()
    assert torch.equal(o_c, o_e)
    for a, b in zip(g_c, g_e, strict=True):
        assert not a.isnan().any()
        assert torch.equal(a, b)
    if feature == "dead rows":
        assert (o_c[:, :, :3] == 0).all()


def test_inductor_end_to_end_matches_eager() -> None:
    tensors, kwargs = _inputs("dropout")

    def f(q, k, v, kw):  # type: ignore[no-untyped-def]
        return attngrad.attention(q * 1.5, k, v, strategy="flash", **kw).tanh()

    dout = torch.randn(B, HQ, N, D, dtype=torch.float64)
    o_c, g_c = _run(torch.compile(f, fullgraph=True), tensors, kwargs, dout)
    o_e, g_e = _run(f, tensors, kwargs, dout)
    # Inductor fuses the elementwise ops around the attention op (its tanh and
    # scaling may round differently by an ulp); the op's own output is eager's
    torch.testing.assert_close(o_c, o_e, rtol=1e-13, atol=1e-13)
    for a, b in zip(g_c, g_e, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_graph_holds_the_ops_and_no_sdpa() -> None:
    (q, k, v), _ = _inputs("causal")
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):  # type: ignore[no-untyped-def]
        graphs.append(gm)
        return gm.forward

    f = torch.compile(lambda q, k, v: attngrad.attention(q, k, v, is_causal=True, enable_gqa=True),
                      fullgraph=True, backend=backend)  # fmt: skip
    f(q, k, v)
    targets = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("attngrad.forward" in t for t in targets), targets
    assert not any("scaled_dot_product" in t for t in targets)


def test_bad_segments_raise_when_the_op_runs() -> None:
    (q, k, v), _ = _inputs("none")
    f = torch.compile(
        lambda q, k, v, cu: attngrad.attention(q, k, v, cu_seqlens_q=cu, enable_gqa=True),
        fullgraph=True, backend="aot_eager",
    )  # fmt: skip
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        f(q, k, v, torch.tensor([1, 20, N]))


def test_generator_is_refused_under_compile() -> None:
    (q, k, v), _ = _inputs("none")
    g = torch.Generator().manual_seed(0)

    def f(q, k, v):  # type: ignore[no-untyped-def]
        return attngrad.attention(q, k, v, dropout_p=0.1, generator=g, enable_gqa=True)

    with pytest.raises(Exception, match=r"generator= is not supported under torch\.compile"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
def test_opcheck_fake_and_autograd_registration(strategy: str) -> None:
    # torch.library.opcheck: the fake kernel's shapes, dtypes and strides match
    # the real op's, and the autograd formula is registered and traceable
    # q and k non-contiguous views, as a model's head split gives
    q = torch.randn(B, N, HQ, D, dtype=torch.float64).transpose(1, 2).requires_grad_()
    k = torch.randn(B, N, HKV, D, dtype=torch.float64).transpose(1, 2).requires_grad_()
    v = torch.randn(B, HKV, N, D, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(1, 1, N, N, dtype=torch.float64, requires_grad=True)
    args = (q, k, v, bias, None, None, None, strategy, 0.3, None, 0, "top-left", None, 0.0,
            None, None)  # fmt: skip
    torch.library.opcheck(torch.ops.attngrad.forward.default, args)


@pytest.mark.parametrize("padded", [False, True])
def test_tiny_llama_compiles_without_a_break(padded: bool) -> None:
    model = tiny_llama().double()  # skips without transformers
    from attngrad.integrations.transformers import register

    name = register("attngrad-compiled", strategy="flash")
    model.set_attn_implementation(name)
    ids = torch.randint(0, 64, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    if padded:
        mask[0, :5] = 0  # left padding: a 4-D bool mask with dead rows reaches attngrad

    def loss(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return model(ids, attention_mask=mask, use_cache=False).logits.square().mean()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")  # raises on a break
    got = compiled(ids, mask)
    g_got = torch.autograd.grad(got, list(model.parameters()))
    expected = loss(ids, mask)
    g_exp = torch.autograd.grad(expected, list(model.parameters()))
    assert torch.equal(got, expected)
    for a, b in zip(g_got, g_exp, strict=True):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
def test_only_some_inputs_need_grad(strategy: str, dtype: torch.dtype) -> None:
    # frozen keys (LoRA-style training): the ops return a fresh empty tensor per
    # gradient not wanted, so no two outputs alias
    q = torch.randn(B, HQ, N, D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, HKV, N, D, dtype=dtype)
    v = torch.randn(B, HKV, N, D, dtype=dtype)

    def f(q, k, v):  # type: ignore[no-untyped-def]
        return attngrad.attention(q, k, v, is_causal=True, enable_gqa=True, strategy=strategy)

    (g_c,) = torch.autograd.grad(
        torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v).sum(), q
    )
    (g_e,) = torch.autograd.grad(f(q, k, v).sum(), q)
    assert torch.equal(g_c, g_e)


def test_opcheck_of_the_backward_op() -> None:
    q = torch.randn(B, N, HQ, D, dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(B, HKV, N, D, dtype=torch.bfloat16) for _ in range(2))
    # strategy, scale, (left, right, align: causal), softcap, dropout_p, block_q, block_k
    options = ("flash", 0.3, None, 0, "top-left", None, 0.2, None, None)
    o, _, seed, lo, hi, *saved = torch.ops.attngrad.forward(
        q, k, v, None, None, None, None, *options
    )
    dout = torch.randn_like(o)
    for need in ([True, True, True, False], [True, False, False, False]):
        # the forward op's band (lo, hi) stands in for (left, right, align)
        args = (
            dout,
            None,
            q,
            k,
            v,
            o,
            None,
            None,
            lo,
            hi,
            seed,
            saved,
            *options[:2],
            *options[5:],
            need,
        )
        torch.library.opcheck(torch.ops.attngrad.backward.default, args)


def test_bad_segment_types_raise_while_tracing() -> None:
    (q, k, v), _ = _inputs("none")
    f = torch.compile(
        lambda q, k, v: attngrad.attention(q, k, v, cu_seqlens_q=[0, N], enable_gqa=True),
        fullgraph=True, backend="aot_eager",
    )  # fmt: skip
    with pytest.raises(Exception, match=r"cu_seqlens_q must be a 1-D integer torch\.Tensor"):
        f(q, k, v)
