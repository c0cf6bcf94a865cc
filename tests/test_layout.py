"""The package's layout rules, read from the source: roles import only downwards.

attngrad is arranged by role, from the bottom:

    core < autograd < strategies < call < api < ring < integrations
         < verify < tools < learn < cli                    (__init__, __main__ on top)

A module may import its own package and the packages below it, never one above,
so each layer can be read, tested and replaced without the ones that use it.
No module reaches into another's ``_private`` names (a shared piece moves down
into a module both can import), and inside ``tools/`` one tool never imports
another: the tools share only the modules ``tools/__init__`` names as shared.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path

import pytest

import attngrad
import attngrad.tools

PACKAGE = Path(attngrad.__file__).parent
LAYERS = (
    "core",
    "autograd",
    "strategies",
    "call",
    "api",
    "ring",
    "integrations",
    "verify",
    "tools",
    "learn",
    "cli",
)
TOP = ("__init__", "__main__")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted, without "attngrad."
    target: str  # the imported attngrad module, dotted, without "attngrad."
    names: tuple[str, ...]  # names taken from it ("" for a plain import)
    line: int


def _modules() -> dict[str, ast.Module]:
    trees = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)
        trees[name] = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return trees


MODULES = _modules()


def _is_module(dotted: str) -> bool:
    return dotted in MODULES


def _imports(name: str, tree: ast.Module) -> list[Import]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module != "attngrad" and not node.module.startswith("attngrad."):
                continue
            base = node.module.removeprefix("attngrad").lstrip(".")
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                if _is_module(sub):
                    found.append(Import(name, sub, ("",), node.lineno))
                else:
                    found.append(Import(name, base or "__init__", (alias.name,), node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("attngrad."):
                    found.append(
                        Import(name, alias.name.removeprefix("attngrad."), ("",), node.lineno)
                    )
    return found


IMPORTS = [imp for name, tree in MODULES.items() for imp in _imports(name, tree)]


def _layer(module: str) -> int:
    head = module.split(".")[0]
    if head in TOP:
        return len(LAYERS)
    return LAYERS.index(head)


def test_every_module_belongs_to_a_layer() -> None:
    unplaced = [m for m in MODULES if m.split(".")[0] not in (*LAYERS, *TOP)]
    assert not unplaced, f"place these modules in a role package: {unplaced}"


def test_at_most_eight_modules_at_the_top() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top


def _upward(imports: list[Import]) -> list[str]:
    return [
        f"attngrad.{i.module}:{i.line} imports attngrad.{i.target}"
        for i in imports
        if i.target != "__init__" and _layer(i.target) > _layer(i.module)
    ]


def test_roles_import_only_downwards() -> None:
    upward = sorted(set(_upward(IMPORTS)))
    assert not upward, "\n".join(upward)


def test_only_the_command_imports_the_package_root() -> None:
    # `import attngrad` from inside would tie a layer to everything the root re-exports
    rooted = sorted(
        {
            f"attngrad.{i.module}:{i.line}"
            for i in IMPORTS
            if i.target == "__init__" and i.module.split(".")[0] not in (*TOP, "cli")
        }
    )
    assert not rooted, "import from the owning module instead of `attngrad`:\n" + "\n".join(rooted)


def _private_uses(name: str, tree: ast.Module) -> list[str]:
    """`from m import _x` and `m._x` where m is another attngrad module."""
    uses = [
        f"attngrad.{name}:{i.line} takes {n} from attngrad.{i.target}"
        for i in _imports(name, tree)
        if i.target != name
        for n in i.names
        if n.startswith("_") and not n.startswith("__")
    ]
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attngrad"):
            base = node.module.removeprefix("attngrad").lstrip(".")
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                if _is_module(sub) and sub != name:
                    aliases[alias.asname or alias.name] = sub
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            uses.append(
                f"attngrad.{name}:{node.lineno} reads {node.attr} of attngrad.{aliases[node.value.id]}"
            )
    return uses


def test_no_module_reaches_into_another_modules_private_names() -> None:
    uses = [use for name, tree in MODULES.items() for use in _private_uses(name, tree)]
    assert not uses, "\n".join(uses)


def test_tools_do_not_import_one_another() -> None:
    tools = {f"tools.{t}" for t in attngrad.tools.TOOLS}
    assert tools <= set(MODULES), sorted(tools - set(MODULES))
    crossing = [
        f"attngrad.{i.module}:{i.line} imports attngrad.{i.target}"
        for i in IMPORTS
        if i.module in tools and i.target in tools and i.target != i.module
    ]
    assert not crossing, "\n".join(crossing)


@pytest.mark.parametrize(
    "source, planted",
    [
        ("from attngrad.cli.args import positive_int\n", "core.ops"),
        ("from attngrad.core.ops import _secret\n", "learn.grade"),
        ("from attngrad.core import ops\nops._secret()\n", "learn.grade"),
    ],
    ids=["upward", "private-name", "private-attribute"],
)
def test_the_rules_see_a_planted_violation(source: str, planted: str) -> None:
    # a check that cannot fail proves nothing: plant one violation of each rule
    tree = ast.parse(source)
    assert _upward(_imports(planted, tree)) or _private_uses(planted, tree)


@pytest.mark.parametrize("name", sorted(set(MODULES) - {"__main__"}))  # __main__ runs the CLI
def test_every_module_is_reachable_by_its_dotted_path(name: str) -> None:
    # `import a.b.c as m`, monkeypatch's "a.b.c.x" and mkdocstrings walk attributes:
    # a package attribute that shadows a submodule would send them elsewhere
    dotted = "attngrad" if name == "__init__" else f"attngrad.{name}"
    module = importlib.import_module(dotted)
    assert pkgutil.resolve_name(dotted) is module
