"""`attngrad.patch_sdpa`: SDPA calls run attngrad inside the block, and only there."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attngrad
from helpers import autograd_nodes, tiny_llama

ORIGINAL = F.scaled_dot_product_attention


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: it calls F.scaled_dot_product_attention itself."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (t.view(b, n, self.heads, c // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


@pytest.mark.parametrize("strategy", ["explicit", "recompute", "flash"])
def test_module_runs_attngrad_inside_the_patch(strategy: str) -> None:
    model = CausalSelfAttention().double()
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    expected = model(x)
    with attngrad.patch_sdpa(strategy):
        assert F.scaled_dot_product_attention is not ORIGINAL
        got = model(x)
    assert F.scaled_dot_product_attention is ORIGINAL
    nodes = autograd_nodes(got)
    assert f"{strategy.capitalize()}AttentionBackward" in nodes, nodes
    assert not any("ScaledDotProduct" in n for n in nodes), nodes
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    g = torch.autograd.grad(got.sum(), list(model.parameters()))
    g_ref = torch.autograd.grad(expected.sum(), list(model.parameters()))
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_no_sdpa_node_in_the_compiled_graph_inside_the_patch() -> None:
    torch._dynamo.reset()
    model = CausalSelfAttention()
    x = torch.randn(2, 16, 32)
    targets: list[str] = []

    def backend(gm, example_inputs):  # type: ignore[no-untyped-def]
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    with attngrad.patch_sdpa("flash"):
        torch.compile(model, fullgraph=True, backend=backend)(x)
    assert any("attngrad.forward" in t for t in targets), targets
    assert not any("scaled_dot_product" in t for t in targets), targets
    torch._dynamo.reset()


def test_restored_when_the_block_raises_and_when_nested() -> None:
    with pytest.raises(RuntimeError, match="boom"), attngrad.patch_sdpa("flash"):
        raise RuntimeError("boom")
    assert F.scaled_dot_product_attention is ORIGINAL
    with attngrad.patch_sdpa("flash"):
        outer = F.scaled_dot_product_attention
        with attngrad.patch_sdpa("explicit"):
            assert F.scaled_dot_product_attention is not outer
        assert F.scaled_dot_product_attention is outer
    assert F.scaled_dot_product_attention is ORIGINAL


def test_as_a_decorator() -> None:
    @attngrad.patch_sdpa("explicit")
    def run(q: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q, q)

    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    assert "ExplicitAttentionBackward" in autograd_nodes(run(q))
    assert F.scaled_dot_product_attention is ORIGINAL


def test_unknown_strategy_is_refused_when_decorating() -> None:
    with pytest.raises(ValueError, match="unknown strategy 'fast'"):
        attngrad.patch_sdpa("fast")


def test_unknown_strategy_is_refused_before_patching() -> None:
    with pytest.raises(ValueError, match="unknown strategy 'fast'"), attngrad.patch_sdpa("fast"):
        pass
    assert F.scaled_dot_product_attention is ORIGINAL


def test_transformers_sdpa_path_runs_attngrad() -> None:
    model = tiny_llama().double().eval()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 64, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0  # left padding: sdpa gets a 4-D bool mask
    expected = model(ids, attention_mask=mask).logits
    with attngrad.patch_sdpa("flash"):
        got = model(ids, attention_mask=mask).logits
    assert "FlashAttentionBackward" in autograd_nodes(got)
    live = mask.bool()
    torch.testing.assert_close(got[live], expected[live], rtol=1e-10, atol=1e-10)
