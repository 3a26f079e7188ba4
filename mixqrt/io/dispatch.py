"""open_source: which reader opens a path or a hub id (GGUF file, HF folder, hub snapshot).

Kept apart from source.py, the contract the readers subclass, so that the readers import the
contract and this dispatcher imports the readers, with no cycle."""
from __future__ import annotations

import os
from pathlib import Path

from mixqrt.errors import FormatError, ModelError
from mixqrt.io.source import PICKLE_SUFFIXES, Source, refuse_pickle


def _looks_like_repo_id(s: str) -> bool:
    # "org/name" with no filesystem hints; anything else that does not exist is a bad path.
    parts = s.split("/")
    return (len(parts) == 2 and all(parts) and not s.startswith((".", "~"))
            and not os.path.isabs(s) and "\\" not in s)


def open_source(path_or_id, *, offline: bool | None = None, progress: bool = True,
                cache_dir=None) -> Source:
    """Open a .gguf file, an HF folder (config.json + *.safetensors) or a hub id ("Qwen/Qwen2-0.5B").

    offline=None follows HF_HUB_OFFLINE; progress controls the hub's download bars.
    """
    from mixqrt.io.gguf import GGUFSource      # here, not at the top: `import mixqrt.io` (every .mxq
    from mixqrt.io.hf import HFSource          # load) should not pay for the gguf package

    s = os.fspath(path_or_id)
    p = Path(s).expanduser()
    if p.is_file():
        suffix = p.suffix.lower()
        if suffix in PICKLE_SUFFIXES:
            refuse_pickle(p)
        if suffix == ".gguf" or _has_gguf_magic(p):
            return GGUFSource(p)
        if suffix == ".safetensors":
            return HFSource(p.parent)
        if p.name == "config.json":
            return HFSource(p.parent)
        raise FormatError(f"{p}: not a model source mixqrt can open (want a .gguf file, an HF folder "
                          "with config.json + *.safetensors, or a hub id)")
    if p.is_dir():
        return HFSource(p)
    if _looks_like_repo_id(s):
        from mixqrt.io.hub import resolve_hub
        return HFSource(resolve_hub(s, offline=offline, progress=progress, cache_dir=cache_dir))
    raise ModelError(f"{s}: no such file or folder, and not a hub id of the form 'org/name'")


def _has_gguf_magic(p: Path) -> bool:
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"
