"""The strategy registry: one list of strategies, traits declared by each strategy.

`attngrad.strategies` collects which strategies are tiled from the strategies
themselves; everything else that needs the list (the block-size check, ring
attention's block kernels) derives it from there.  No strategy module imports
another: what they share lives in `attngrad.strategies.common`.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

import attngrad
from attngrad import strategies
from attngrad.core.contract import Shapes
from attngrad.core.interface import Strategy
from attngrad.ring import BLOCK_STRATEGIES
from attngrad.strategies.base import AttentionFunction

STRATEGY_MODULES = {name: type(s).__module__ for name, s in strategies.REGISTRY.items()}


def test_tiled_is_collected_from_the_strategies_in_strategies_order():
    declared = tuple(n for n in strategies.STRATEGIES if strategies.REGISTRY[n].tiled)
    assert strategies.TILED == declared == ("flash", "fused", "triton")
    assert BLOCK_STRATEGIES == strategies.TILED


@pytest.mark.parametrize("name", strategies.STRATEGIES)
def test_each_strategy_declares_its_traits(name):
    strategy = strategies.REGISTRY[name]
    assert isinstance(strategy, Strategy) and strategy.name == name
    assert isinstance(strategy.tiled, bool) and isinstance(strategy.keeps_mods, bool)
    assert issubclass(strategy.function, AttentionFunction)
    assert strategy.function.__name__.lower() == f"{name}attention"
    shapes = Shapes((2,), 4, 2, 5, 7, 8, 6)
    declared = strategy.saves(shapes)
    assert "stats" in declared and set(declared) <= {"p", "o", "stats"}
    assert declared["stats"] == ((2, 4, 5, 2), "stats")


@pytest.mark.parametrize("name", strategies.STRATEGIES)
def test_no_strategy_imports_another(name):
    path = Path(sys.modules[STRATEGY_MODULES[name]].__file__)
    others = set(STRATEGY_MODULES.values()) - {STRATEGY_MODULES[name]}
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
    assert not imported & (others | {"attngrad.strategies"}), sorted(imported & others)


def test_block_sizes_on_an_untiled_strategy_name_the_tiled_ones():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(
        attngrad.ArgumentError, match="tiled strategies 'flash', 'fused' and 'triton'"
    ):
        attngrad.attention(q, q, q, strategy="recompute", block_k=32)
