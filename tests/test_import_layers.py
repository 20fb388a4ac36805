"""The package's import graph: no module cycle, no cycle between its parts, and no import upward.

Every ``import`` statement counts, function-local ones included (a cycle hidden inside a function is still a
cycle). ``LAYERS`` is the layering, written down once (docs/design.md points here): a part may import its own
modules, parts of its layer and parts of the layers below it, never a part above.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvserve"

#: Top to bottom. A part is a subpackage (``engine``) or a top-level module (``config``); ``kvserve`` is the
#: package's own ``__init__`` (the public API, loaded lazily). ``entrypoints.cli`` dispatches to every command.
LAYERS = [
    ["entrypoints.cli"],
    ["bench", "sim"],
    ["kvserve", "entrypoints"],
    ["engine"],
    ["spec_decode", "worker", "distributed"],
    ["core", "sample", "request"],
    ["model"],
    ["attention", "layers"],
    ["kernels", "quant", "batch"],
    ["structured", "config", "sampling_params", "outputs", "validation", "metrics", "extras"],
]


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules its import statements load (``from P import m`` of a submodule ``m`` is an
    edge to ``P.m``; of a name defined in ``P``'s ``__init__``, to ``P``)."""
    mods = _modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name and t.split(".")[0] == "kvserve":
                    edges[name].add(t)
    return edges


def part_of(module: str) -> str:
    """``kvserve.engine.llm_engine`` -> ``engine``; ``kvserve.entrypoints.cli`` -> ``entrypoints.cli``."""
    rest = module.split(".")[1:]
    if not rest:
        return "kvserve"
    if rest[:2] == ["entrypoints", "cli"]:
        return "entrypoints.cli"
    return rest[0]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]
    nodes = set(edges) | {t for ts in edges.values() for t in ts}
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_module_cycle():
    assert _cycles(import_graph()) == []


def test_no_cycle_between_parts():
    parts: dict[str, set[str]] = defaultdict(set)
    for a, targets in import_graph().items():
        for b in targets:
            if part_of(a) != part_of(b):
                parts[part_of(a)].add(part_of(b))
    assert _cycles(parts) == []


def test_every_part_has_a_layer():
    layered = {p for layer in LAYERS for p in layer}
    assert {part_of(m) for m in _modules()} <= layered


@pytest.mark.parametrize("layer", range(len(LAYERS)))
def test_no_upward_import(layer):
    rank = {p: i for i, layer_parts in enumerate(LAYERS) for p in layer_parts}
    upward = sorted(f"{a} -> {b}" for a, targets in import_graph().items() for b in targets
                    if rank.get(part_of(a)) == layer and rank[part_of(b)] < layer)
    assert upward == []


#: Serving code: every HTTP API, the dashboard, the Ray ingress (docs/design: "Above the engine").
SERVING = ("kvserve.entrypoints.openai", "kvserve.entrypoints.anthropic", "kvserve.entrypoints.dashboard",
           "kvserve.entrypoints.ray.ingress", "kvserve.entrypoints.events")
#: The composition roots: the one place each that builds an engine (``AsyncLLM``) for the server or a replica.
ENGINE_BUILDERS = {"kvserve.entrypoints.openai.api_server": {"kvserve.engine.async_llm"}}


def test_serving_reaches_the_engine_only_through_the_client():
    """Serving imports nothing of ``kvserve.engine`` but ``kvserve.engine.protocol`` (the ``EngineClient``)."""
    bad = sorted(f"{a} -> {b}" for a, targets in import_graph().items() if a.startswith(SERVING)
                 for b in targets if b.startswith("kvserve.engine") and b != "kvserve.engine.protocol"
                 and b not in ENGINE_BUILDERS.get(a, ()))
    assert bad == []
