"""The package's import graph points one way and has no cycles (docs/architecture.md draws it).

Layers, lowest first: ``_version``/``exceptions``/``signals`` → ``engine`` (the pool: no Scrapy) → ``settings`` →
``modes`` (where the engine runs) → ``crawl`` + ``policy`` (the Scrapy side) → ``ops`` (operator tools)
→ the public entry points (``middlewares``, ``addon``, ``__init__``, ``__main__``) → ``reference`` (the tables
the docs are generated from: they may read any layer, nothing imports them). A module imports only
from its own layer or lower ones; ``demo`` (dev tooling) may import anything, and nothing imports it.
Every import counts, including those inside functions: a cycle hidden in a function is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "scrapy_proxy_shard"
NAME = "scrapy_proxy_shard"

RANK = {
    "_version": 0, "exceptions": 0, "signals": 0,
    "engine": 1,
    "settings": 2,
    "modes": 3,
    "crawl": 4,
    "ops": 5,
    "middlewares": 6, "addon": 6, "__init__": 6, "__main__": 6,
    "reference": 7,
    "demo": 9,
}
#: Third-party packages a layer must not import.
FORBIDDEN = {"engine": ("scrapy", "twisted", "parsel")}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, modules: dict[str, Path] | None = None) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file, resolved to absolute names."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    here = _module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            # "from pkg import module" imports that module; "from module import name", the module
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                out.append((sub if modules is not None and sub in modules else mod, node.lineno))
    return out


#: Public modules that belong to a layer below the entry points (``policy`` is the pluggable ban policy
#: users subclass; it lives at the top so ``PROXY_SHARD_BAN_POLICY`` paths stay short).
ALIASES = {"policy": "crawl"}


def _layer(module: str) -> str:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    return ALIASES.get(top, top)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _internal_edges() -> dict[str, set[tuple[str, int]]]:
    modules = _modules()
    edges: dict[str, set[tuple[str, int]]] = {}
    for name, path in modules.items():
        targets = set()
        for mod, line in _imports(path, modules):
            if mod in modules and mod != name:
                targets.add((mod, line))
        edges[name] = targets
    return edges


def test_every_module_belongs_to_a_known_layer():
    unknown = sorted(m for m in _modules() if _layer(m) not in RANK)
    assert not unknown, f"give these a layer in RANK (and docs/architecture.md): {unknown}"


def test_imports_point_down_the_layers():
    upward = []
    for module, targets in _internal_edges().items():
        mine = _layer(module)
        for target, line in targets:
            theirs = _layer(target)
            if RANK[theirs] > RANK[mine] or (RANK[theirs] == RANK[mine] and theirs != mine and mine != "__init__"):
                upward.append(f"{module}:{line} imports {target} ({mine} → {theirs})")
    assert not upward, "imports against the layering:\n" + "\n".join(sorted(upward))


def test_nothing_in_the_runtime_imports_the_demo():
    offenders = [f"{m}:{line} imports {t}" for m, targets in _internal_edges().items() if _layer(m) != "demo"
                 for t, line in targets if _layer(t) == "demo"]
    assert not offenders, offenders


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_keeps_out_of_third_party_frameworks(layer):
    bad = []
    for name, path in _modules().items():
        if _layer(name) != layer:
            continue
        for mod, line in _imports(path):
            if mod.split(".")[0] in FORBIDDEN[layer]:
                bad.append(f"{name}:{line} imports {mod}")
    assert not bad, bad


def test_the_import_graph_has_no_cycles():
    edges = {m: {t for t, _ in ts} for m, ts in _internal_edges().items()}
    # A package's __init__ re-exporting its children is not a cycle of design: drop child→parent-init edges.
    for module, targets in edges.items():
        edges[module] = {t for t in targets if not module.startswith(t + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" → ".join(c) for c in cycles)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The graph is built from real imports: a known downward edge is found (the test cannot pass empty)."""
    edges = _internal_edges()
    assert any(t.startswith(f"{NAME}.engine") for t, _ in edges[f"{NAME}.crawl.runtime"])
    assert any(t.startswith(f"{NAME}.exceptions") for t, _ in edges[f"{NAME}.engine.store"])
