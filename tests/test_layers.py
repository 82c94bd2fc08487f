"""rayapp's packages import only downwards: the layer order below, with no import up or across a layer.

A package may import itself and any package of a lower layer; nothing else. So the package graph
has no cycle, and a low package (block identity, the engine) never depends on a high one (the
router, the Serve deployments). `rayapp/__init__.py`, the public facade that loads names lazily,
is not a layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import rayapp

# Lowest first. Each entry is a layer: the packages (or top-level modules) of rayapp in it.
# The engine's core sits below its features (sparse retrieval, layer-wise compression, the cluster tier), which it
# finds by name through its registry; the drivers run an engine with whatever features its config turns on.
LAYERS = [
    {"config"},
    {"blocks", "observability", "kernels"},
    {"models"},
    {"engine"},
    {"sparse", "layerwise", "kvtier", "prefix_router"},
    {"drivers", "llm"},
    {"vllm_ext"},
    {"deployments", "integrations"},
    {"cli"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
ROOT = Path(rayapp.__file__).parent


def _component(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return parts[0]


def _imports(path: Path) -> set[str]:
    """The rayapp components `path` imports, anywhere in it (functions and TYPE_CHECKING blocks too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names if node.module == "rayapp"]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "rayapp" and len(parts) > 1:
                found.add(parts[1])
    return found


def _modules() -> list[Path]:
    return [p for p in sorted(ROOT.rglob("*.py")) if p != ROOT / "__init__.py"]


def test_every_package_has_a_layer():
    assert {_component(p) for p in _modules()} == set(RANK)


def test_no_import_runs_up_or_across_the_layers():
    wrong = []
    for path in _modules():
        source = _component(path)
        for target in _imports(path) - {source}:
            if RANK.get(target, len(LAYERS)) >= RANK[source]:
                wrong.append(f"{path.relative_to(ROOT.parent)} ({source}) imports rayapp.{target}")
    assert not wrong, "\n".join(wrong)


def test_no_module_is_over_400_lines():
    long = [f"{p.relative_to(ROOT.parent)}: {n}" for p in _modules() if (n := len(p.read_text().splitlines())) > 400]
    assert not long, "split these modules along a seam:\n" + "\n".join(long)
