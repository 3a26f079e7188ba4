"""Dependencies point down: every mixqrt module imports only modules of its own layer or below.

Read from the source (AST), so imports inside functions count too: a lazy import still couples the
layers. Within a layer, imports are allowed but cycles are not. A fresh interpreter then imports the
layers bottom up and checks that nothing above is loaded yet. The order, bottom first, is
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
    ("platform", ["mixqrt.errors", "mixqrt._kernels", "mixqrt.platform"]),   # errors, _kernels, platform/
    ("formats", ["mixqrt.formats"]),   # layout, kmeans, rotation, qtensor, codec
    ("ops", ["mixqrt.ops"]),   # pool, matmul, attention, elementwise, probes, ref
    ("models", ["mixqrt.models", "mixqrt.kv"]),   # spec, base, the graphs; the KV cache (kv_cache), the config bounds (config_limits)
    ("generation", ["mixqrt.generation"]),   # engine, prompt cache, params, sampling, speculative, grammar, tool calls, tokenizer, ...
    ("io", ["mixqrt.io"]),   # arena, dispatch, mxq, gguf, hf, hub, source
    ("runtime", ["mixqrt.runtime"]),   # placement, prefetch, the core-slicing scheduler
    ("quantize", ["mixqrt.quantize"]),   # recipes and calibration run the model; names: model name -> cached .mxq
    ("pipeline", ["mixqrt.pipeline", "mixqrt.commands"]),   # Pipeline, load; the bench / evaluate / doctor / inspect commands
    ("app", ["mixqrt.cli", "mixqrt.__main__", "mixqrt.__init__", "mixqrt.testing", "mixqrt.serving"]),
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
    pkg = mod[: -len(".__init__")] if mod.endswith(".__init__") else mod.rsplit(".", 1)[0]
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


_ORDERED_IMPORT = """
import importlib, json, sys
layers = json.loads(sys.argv[1])
for i, mods in enumerate(layers):
    for m in mods:
        importlib.import_module(m)
    later = {m for ms in layers[i + 1:] for m in ms}
    loaded = sorted(m for m in sys.modules if m in later)
    if loaded:
        print(f"after layer {i}: {loaded}")
        sys.exit(1)
"""


def test_layers_import_bottom_up():
    """A fresh interpreter imports the layers in order; after each layer, no module of a higher one
    may be loaded (parent packages excepted: importing a.b runs a/__init__, so those stay light)."""
    import json
    import subprocess
    import sys
    layers = [[] for _ in LAYERS]
    for m in sorted(MODULES):
        if m.endswith("__main__") or m.endswith(".__init__"):
            continue
        layers[layer_of(m)].append(m)
    r = subprocess.run([sys.executable, "-c", _ORDERED_IMPORT, json.dumps(layers)], capture_output=True,
                       text=True, cwd=ROOT.parent, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def _part(mod: str) -> str:
    """The top-level part of mixqrt a module belongs to: its folder (mixqrt.formats.layout -> formats)
    or, for a module directly under mixqrt/, the module itself."""
    return mod.split(".")[1]


def test_each_folder_is_one_layer():
    """A folder of mixqrt/ is one layer: every module in it sits in the same layer, so the folder
    names on disk tell the layering."""
    by_part: dict[str, set[str]] = {}
    for m in MODULES:
        if "." in m[len("mixqrt."):] and not m.startswith("mixqrt.__"):
            by_part.setdefault(_part(m), set()).add(LAYERS[layer_of(m)][0])
    mixed = {p: sorted(ls) for p, ls in by_part.items() if len(ls) > 1 and (ROOT / p).is_dir()}
    assert not mixed, f"folders spanning several layers: {mixed}"


def test_no_folder_cycles():
    """Imports between the top-level parts (folders and root modules) form no cycle, lazy imports
    included: the same rule as the module graph, one level up."""
    edges: dict[str, set[str]] = {}
    for m, deps in GRAPH.items():
        if m in ("mixqrt.__init__", "mixqrt.__main__"):
            continue
        for d in deps:
            if d != "mixqrt.__init__" and _part(d) != _part(m):
                edges.setdefault(_part(m), set()).add(_part(d))
    state: dict[str, int] = {}
    cycle: list[str] = []

    def dfs(v, path):
        state[v] = 1
        for w in sorted(edges.get(v, ())):
            if state.get(w) == 1:
                cycle.extend(path[path.index(w):] + [w] if w in path else [v, w])
                return True
            if w not in state and dfs(w, path + [w]):
                return True
        state[v] = 2
        return False

    for v in sorted(edges):
        if v not in state and dfs(v, [v]):
            break
    assert not cycle, "folder cycle: " + " -> ".join(cycle)
