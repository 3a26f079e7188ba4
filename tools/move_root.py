#!/usr/bin/env python3
"""Issue 38, item 3: give the root modules of mixqrt/ folders whose names say what they hold.

    python3 tools/move_root.py [REPO]          # default: the current directory; REPO must be a clean git checkout
    python3 tools/move_root.py REPO --dry-run  # print the moves and the files that would change

What it does, mechanically, on a checkout (nothing is committed: review `git status`, run the tests, commit):

1. `git mv` each module of MOVES to its new place (new packages get an __init__.py with a docstring);
   the root keeps __init__, __main__, cli, errors and pipeline (the public entry points).
2. Rewrites every reference in the tracked text files (mixqrt/, tests/, benchmarks/, docs/, README,
   .ci/, setup files):
   - `from mixqrt import engine, ops` statements (Python files, parsed with ast) become
     `from mixqrt import ops` + `from mixqrt.generation import engine`; a renamed module keeps its old
     local name (`from mixqrt.serving import protocol as oai`), so the code that uses it is unchanged;
   - dotted names anywhere (`mixqrt.serving.protocol`, `import mixqrt.generation.engine`, `"mixqrt.generation.engine.X"` in monkeypatch
     strings, docs) and paths (`mixqrt/serving/protocol.py`, `mixqrt/serving/server/`) get their new spelling.
3. tests/test_layers.py: LAYERS is rewritten so that each folder is one layer: a `generation` layer
   right above models (the tokenizer, which io reads, lives there), the KV cache and the config bounds
   in models, names in quantize, commands in pipeline, serving in app; names of no module (a stale
   `mixqrt.server`) are dropped; any other entry (a module added by someone else) is kept.
4. Prints what is left at the root that is neither kept nor moved (a module added after this script
   was written: place it by hand), and any reference to an old name it could not rewrite.

Exit status 1 when the checkout is dirty or old names remain (a module of MOVES that is missing is
skipped with a warning).
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

# old module (under mixqrt.) -> new module; a package moves with its folder
MOVES = {
    # generation: the engine, its prompt cache, sampling, the request object, speculation,
    # constrained decoding, tool calls, the tokenizer and the chat template, generate
    "engine": "generation.engine",
    "engine_cache": "generation.prompt_cache",
    "generate": "generation.generate",
    "sample_utils": "generation.sampling",
    "params": "generation.params",
    "validate": "generation.validate",
    "speculative": "generation.speculative",
    "grammar": "generation.grammar",
    "tools": "generation.tool_calls",
    "tokenizer": "generation.tokenizer",
    "chat_template": "generation.chat_template",
    "fim": "generation.fim",                 # fill-in-the-middle prompts (the tokenizer's FIM tokens)
    "embed": "generation.embed",             # embeddings: pooling, normalization, the Embedder the engine runs
    # serving: OpenAI's request and reply shapes, the llama-cpp-python-shaped Python API, the HTTP server
    "oai": "serving.protocol",
    "api": "serving.api",
    "serve": "serving.server",
    # commands: the measuring and diagnosing commands behind `mixqrt bench / eval / doctor / inspect`
    "bench": "commands.bench",
    "evaluate": "commands.evaluate",
    "doctor": "commands.doctor",
    "inspect": "commands.inspect_model",      # no longer shadows the standard library's inspect
    # the model side: the KV cache, the bounds on model hyperparameters
    "cache": "models.kv_cache",
    "limits": "models.config_limits",
    # a model name -> its source and its cached .mxq (aliases, recipe suffixes, cache paths)
    "resolve": "quantize.names",
}
KEEP = {"__init__", "__main__", "cli", "errors", "pipeline"}
NEW_PACKAGES = {
    "generation": '"""Generation: the engine (continuous batching) and its prompt cache, the request object '
                  '(params), sampling, speculative decoding, constrained decoding (grammar) and tool calls, '
                  'the tokenizer and the chat template, fill-in-the-middle prompts, embeddings, and the '
                  'single-sequence generate loop."""\n',
    "serving": '"""The OpenAI layer: request parsing and reply shapes (protocol), the llama-cpp-python-shaped '
               'Python API (api) and the HTTP server (server; the `serve` extra)."""\n',
    "commands": '"""The measuring and diagnosing commands: bench, evaluate (perplexity, KL), doctor, '
                'inspect_model."""\n',
}
TEXT_SUFFIXES = (".py", ".pyx", ".pxd", ".pxi", ".md", ".toml", ".cfg", ".txt", ".yml", ".yaml", ".in", ".sh",
                 ".ini", ".rst", ".json")


def git(repo, *args, check=True) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=check, capture_output=True, text=True).stdout


def dotted(old: str) -> tuple[str, str]:
    return f"mixqrt.{old}", f"mixqrt.{MOVES[old]}"


# ------------------------------------------------------------------------------------------ 1. moves
def move(repo: Path, dry: bool) -> None:
    pkg = repo / "mixqrt"
    for name, doc in NEW_PACKAGES.items():
        d = pkg / name
        if not dry:
            d.mkdir(exist_ok=True)
            init = d / "__init__.py"
            if not init.exists():
                init.write_text(doc)
                git(repo, "add", str(init.relative_to(repo)))
    for old, new in MOVES.items():
        src = pkg / old if (pkg / old).is_dir() else pkg / f"{old}.py"
        parts = new.split(".")
        dst = pkg.joinpath(*parts) if src.is_dir() else pkg.joinpath(*parts[:-1], parts[-1] + ".py")
        print(f"  git mv {src.relative_to(repo)} {dst.relative_to(repo)}")
        if not dry:
            dst.parent.mkdir(parents=True, exist_ok=True)
            git(repo, "mv", str(src.relative_to(repo)), str(dst.relative_to(repo)))


# ------------------------------------------------------------------------------------------ 2. references
def _rewrite_from_mixqrt(text: str) -> str:
    """`from mixqrt import a, b as c` statements naming a moved module -> one statement per target package."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    lines = text.splitlines(keepends=True)
    edits = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and node.module == "mixqrt" and node.level == 0):
            continue
        if not any(a.name in MOVES for a in node.names):
            continue
        indent = lines[node.lineno - 1][:node.col_offset]
        groups: dict[str, list[str]] = {}
        for a in node.names:
            if a.name in MOVES:
                parent, _, leaf = f"mixqrt.{MOVES[a.name]}".rpartition(".")
                local = a.asname or a.name
                groups.setdefault(parent, []).append(leaf if local == leaf else f"{leaf} as {local}")
            else:
                groups.setdefault("mixqrt", []).append(a.name if a.asname is None else f"{a.name} as {a.asname}")
        tail = lines[node.end_lineno - 1][node.end_col_offset:]
        stmts = [f"from {mod} import {', '.join(names)}" for mod, names in groups.items()]
        first = indent + ("\n" + indent).join(stmts)
        edits.append((node.lineno, node.end_lineno, first + tail if tail.strip() else first + "\n"))
    for start, end, new in sorted(edits, reverse=True):
        lines[start - 1:end] = [new]
    return "".join(lines)


def _name_pattern() -> re.Pattern:
    olds = sorted(MOVES, key=len, reverse=True)
    return re.compile(r"\bmixqrt\.(" + "|".join(map(re.escape, olds)) + r")\b(?![\w])")


def _path_pattern() -> re.Pattern:
    olds = sorted(MOVES, key=len, reverse=True)
    return re.compile(r"\bmixqrt/(" + "|".join(map(re.escape, olds)) + r")(\.py\b|/|\b(?![\w.]))")


def rewrite_text(text: str, is_py: bool) -> str:
    if is_py:
        text = _rewrite_from_mixqrt(text)
    text = _name_pattern().sub(lambda m: f"mixqrt.{MOVES[m.group(1)]}", text)

    def path(m):
        old, rest = m.group(1), m.group(2)
        new = "mixqrt/" + MOVES[old].replace(".", "/")
        return new + rest
    return _path_pattern().sub(path, text)


def rewrite_all(repo: Path, dry: bool) -> list[str]:
    changed = []
    for rel in git(repo, "ls-files").splitlines():
        p = repo / rel
        if not p.is_file() or not rel.endswith(TEXT_SUFFIXES) or rel.startswith("mixqrt/_kernels/src/"):
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        new = rewrite_text(text, rel.endswith(".py"))
        if new != text:
            changed.append(rel)
            if not dry:
                p.write_text(new, encoding="utf-8")
    return changed


# ------------------------------------------------------------------------------------------ 3. LAYERS
# A folder is one layer (tests/test_layers.py: test_each_folder_is_one_layer), so the moved modules take
# their folder's layer: generation gets a layer of its own right above models (nothing in it imports io,
# runtime or quantize; io reads the tokenizer from it), the KV cache and the config bounds join models,
# names joins quantize, commands sit with pipeline, serving with the app.
NEW_LAYER = ("generation", ["mixqrt.generation"], "models")        # (name, prefixes, inserted after)
ADD_PREFIX = {"pipeline": "mixqrt.commands", "app": "mixqrt.serving"}
COMMENTS = {
    "platform": "errors, _kernels, platform/",
    "formats": "layout, kmeans, rotation, qtensor, codec",
    "ops": "pool, matmul, attention, elementwise, probes, ref",
    "models": "spec, base, the graphs; the KV cache (kv_cache), the config bounds (config_limits)",
    "generation": "engine, prompt cache, params, sampling, speculative, grammar, tool calls, tokenizer, ...",
    "io": "arena, dispatch, mxq, gguf, hf, hub, source",
    "runtime": "placement, prefetch, the core-slicing scheduler",
    "quantize": "recipes and calibration run the model; names: model name -> cached .mxq",
    "pipeline": "Pipeline, load; the bench / evaluate / doctor / inspect commands",
    "app": "the OpenAI layer (serving/), the CLI, the test models and fuzzers (testing/)",
}


def fix_layers(repo: Path) -> None:
    p = repo / "tests" / "test_layers.py"
    text = p.read_text()
    start = text.index("LAYERS = [")
    end = text.index("\n]\n", start) + 3
    ns: dict = {}
    exec(text[start:end], ns)                         # the list literal alone (names already rewritten)
    existing = set()
    for f in (repo / "mixqrt").rglob("*.py"):
        mod = ".".join(f.relative_to(repo).with_suffix("").parts)
        existing.add(mod)                                 # mixqrt.__init__ as the layering test names it
        existing.add(mod[: -len(".__init__")] if mod.endswith(".__init__") else mod)
    moved = {f"mixqrt.{v}" for v in MOVES.values()}
    covered = lambda x: any(x == q or x.startswith(q + ".") for q in  # noqa: E731
                            ("mixqrt.generation", "mixqrt.serving", "mixqrt.commands", "mixqrt.models",
                             "mixqrt.quantize"))
    out = []
    for name, prefixes in ns["LAYERS"]:
        keep = []
        for x in prefixes:
            if x in moved and covered(x):
                continue                              # its folder's prefix places it
            if x in existing or any(e.startswith(x + ".") for e in existing):
                keep.append(x)
            else:
                print(f"  LAYERS: {name}: dropped {x} (no such module)")
        if name in ADD_PREFIX:
            keep.append(ADD_PREFIX[name])
        if keep:
            out.append((name, keep))
        else:
            print(f"  LAYERS: layer {name} is empty now: removed")
        if name == NEW_LAYER[2]:
            out.append((NEW_LAYER[0], list(NEW_LAYER[1])))
    lines = ["LAYERS = ["]
    for name, prefixes in out:
        item = f"    ({name!r}, {prefixes!r}),".replace("'", '"')
        note = COMMENTS.get(name)
        lines.append(item + (f"   # {note}" if note and len(item) + len(note) < 140 else ""))
    lines.append("]\n")
    p.write_text(text[:start] + "\n".join(lines) + text[end:])


# ------------------------------------------------------------------------------------------ 4. checks
def leftovers(repo: Path) -> tuple[list[str], list[str]]:
    root = sorted(p.stem for p in (repo / "mixqrt").glob("*.py"))     # folders are placed already
    unplaced = [m for m in root if m not in KEEP and m not in MOVES]
    old = re.compile(r"\bmixqrt\.(" + "|".join(map(re.escape, MOVES)) + r")\b(?![\w])|"
                     r"from mixqrt import [^\n]*\b(" + "|".join(map(re.escape, MOVES)) + r")\b")
    stale = []
    for rel in git(repo, "ls-files").splitlines():
        p = repo / rel
        if p.is_file() and rel.endswith(TEXT_SUFFIXES):
            for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                if old.search(line):
                    stale.append(f"{rel}:{i}: {line.strip()[:120]}")
    return unplaced, stale


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("repo", nargs="?", default=".")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    repo = Path(a.repo).resolve()
    if git(repo, "status", "--porcelain", "--untracked-files=no").strip():
        print(f"{repo}: the checkout has uncommitted changes; commit or stash them first", file=sys.stderr)
        return 1
    missing = [m for m in MOVES if not (repo / "mixqrt" / f"{m}.py").exists() and not (repo / "mixqrt" / m).is_dir()]
    if missing:                    # renamed or removed since this script was written: move the rest
        print(f"warning: modules of MOVES that do not exist here, skipped: {missing}", file=sys.stderr)
        for m in missing:
            del MOVES[m]
    print("moves:")
    move(repo, a.dry_run)
    if a.dry_run:
        # the rewrite is computed on the unmoved tree: it reads text only
        print("files whose text would change:", *rewrite_all(repo, True), sep="\n  ")
        return 0
    changed = rewrite_all(repo, False)
    print(f"rewrote references in {len(changed)} files")
    fix_layers(repo)
    unplaced, stale = leftovers(repo)
    if unplaced:
        print("root modules neither kept nor moved (place them by hand, and in tests/test_layers.py LAYERS):",
              unplaced)
    if stale:
        print("references to old names left:", *stale[:50], sep="\n  ")
    print("next: pip install -e . (or copy the built extensions), pytest -q tests, "
          "python3 /work/shared/tools/folder_cycles.py .; docs/architecture.md's \"Layers\" list names modules "
          "by their short names: update it to the folders above")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
