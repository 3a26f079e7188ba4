"""Dependencies point down: every mixqrt module imports only modules of its own layer or below.

Read from the source (AST), so imports inside functions count too: a lazy import still couples the
layers. Within a layer, imports are allowed but cycles are not. The order, bottom first, is
described in docs/architecture.md ("Layers"). A new module must be placed in LAYERS (longest
prefix wins); the test says so when one is missing.
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import mixqrt

ROOT = Path(mixqrt.__file__).parent

LAYERS = [
    ("platform", ["mixqrt.errors", "mixqrt._kernels", "mixqrt.isa", "mixqrt.perf", "mixqrt.ops_ref",
                  "mixqrt.runtime.topology", "mixqrt.runtime.affinity"]),
    ("quant.layout", ["mixqrt.quant.layout", "mixqrt.quant.kmeans"]),
    ("quant.qtensor", ["mixqrt.quant.qtensor"]),
    ("quant.formats", ["mixqrt.quant.formats", "mixqrt.quant.__init__"]),
    ("ops", ["mixqrt.ops"]),
    ("spec", ["mixqrt.models.base", "mixqrt.models.spec"]),
    ("quant.policy", ["mixqrt.quant"]),                    # recipes, auto, imatrix, ...
    ("io", ["mixqrt.io", "mixqrt.tokenizer", "mixqrt.chat_template"]),
    ("models", ["mixqrt.models", "mixqrt.cache"]),
    ("runtime", ["mixqrt.runtime"]),
    ("generate", ["mixqrt.sample_utils", "mixqrt.generate", "mixqrt.evaluate", "mixqrt.convert",
                  "mixqrt.engine"]),
    ("pipeline", ["mixqrt.resolve", "mixqrt.pipeline", "mixqrt.bench", "mixqrt.inspect", "mixqrt.doctor"]),
    ("app", ["mixqrt.api", "mixqrt.server", "mixqrt.serve", "mixqrt.cli", "mixqrt.__main__",
             "mixqrt.__init__"]),
]


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT.parent).with_suffix("")
        out[".".join(rel.parts)] = p
    return out


MODULES = _modules()


def _is_module(name: str) -> bool:
    return name in MODULES or name + ".__init__" in MODULES


def _canonical(name: str) -> str:
    return name + ".__init__" if name + ".__init__" in MODULES else name


def layer_of(mod: str) -> int:
    best, found = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for pre in prefixes:
            if (mod == pre or mod.startswith(pre + ".")) and len(pre) > best:
                best, found = len(pre), i
    if found is None:
        raise AssertionError(f"{mod} is in no layer: add it to LAYERS in tests/test_layers.py "
                             "(and to the layer list in docs/architecture.md)")
    return found


def imports_of(mod: str) -> set[str]:
    """The mixqrt modules `mod` imports, anywhere in its source (package __init__s named as such)."""
    path = MODULES[mod]
    pkg = mod.rsplit(".", 1)[0] if not mod.endswith(".__init__") else mod[: -len(".__init__")]
    if mod.endswith(".__init__"):
        pkg = mod[: -len(".__init__")]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # `from pkg import sub` imports the submodule; `from mod import name` the module
            names = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base for a in node.names]
        else:
            continue
        for n in names:
            if n == "mixqrt" or n.startswith("mixqrt."):
                while not _is_module(n) and "." in n:
                    n = n.rsplit(".", 1)[0]
                out.add(_canonical(n))
    out.discard(mod)
    return out


GRAPH = {m: imports_of(m) for m in MODULES}


def test_every_module_has_a_layer():
    for m in MODULES:
        layer_of(m)


def test_imports_point_down():
    bad = []
    for m, deps in sorted(GRAPH.items()):
        lm = layer_of(m)
        for d in sorted(deps):
            if d == "mixqrt.__init__":
                continue          # the package itself: its imports are lazy (mixqrt.load, Pipeline)
            ld = layer_of(d)
            if ld > lm:
                bad.append(f"{m} ({LAYERS[lm][0]}) imports {d} ({LAYERS[ld][0]})")
    assert not bad, "upward imports:\n  " + "\n  ".join(bad)


def test_no_import_cycles():
    # Tarjan's strongly connected components over the module graph
    index, low, stack, on, sccs = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH.get(v, ()):
            if w not in GRAPH:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index and v != "mixqrt.__init__":
            visit(v)
    assert not sccs, f"import cycles: {sccs}"


@pytest.mark.parametrize("layer", [name for name, _ in LAYERS])
def test_layers_import_bottom_up(layer):
    """Importing the layers in order works: each layer's modules import with only lower layers loaded
    before (a missing module or an import-time error shows up here, named by layer)."""
    i = [n for n, _ in LAYERS].index(layer)
    for m in sorted(MODULES):
        if layer_of(m) == i and not m.endswith("__main__"):
            importlib.import_module(m[: -len(".__init__")] if m.endswith(".__init__") else m)
