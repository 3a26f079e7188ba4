"""Files read from a model folder, confined to it.

Every file mixqrt reads from an HF model folder (config.json, generation_config.json, the
safetensors index and shards, tokenizer.json, tokenizer_config.json, chat_template.jinja) goes
through `folder_file`: a name that is a plain file name, a file that is a regular file, and a path
that, symlinks resolved, stays in the folder. A downloaded folder whose `chat_template.jinja` links
to `~/.ssh/id_rsa` would otherwise have that file's text read, and written into the saved .mxq.
The one exception is the hub cache, where `snapshots/<rev>/x` links to `../../blobs/<sha>` by design.
"""
from __future__ import annotations

import os
from pathlib import Path

from mixqrt.errors import FormatError, ModelError


def cache_dir() -> Path:
    """~/.cache/mixqrt, or $MIXQRT_CACHE (created): converted models, hub downloads, lock files."""
    d = Path(os.environ.get("MIXQRT_CACHE") or Path.home() / ".cache" / "mixqrt")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _roots(folder: Path) -> list[Path]:
    roots = [folder.resolve()]
    if folder.parent.name == "snapshots":            # hub cache: snapshots/<rev>/x -> ../../blobs/<sha>
        roots.append(folder.parent.parent.resolve() / "blobs")
    return roots


def folder_file(folder, name, *, required: bool = False, what: str = "", where=None) -> Path | None:
    """`folder / name` if it is a regular file inside `folder` (after symlinks), None when it does
    not exist and is not `required`. FormatError naming the file when `name` is not a plain file
    name, when the file resolves outside the folder (or the hub cache's blobs/), or is not a
    regular file; ModelError when a required file is missing. `where` (default: the folder)
    prefixes the messages, e.g. the index file that listed a shard."""
    folder = Path(folder)
    where = where or folder
    label = what or "file"
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") \
            or "\0" in name:
        raise FormatError(f"{where}: {label} {str(name)[:80]!r} must be a file name inside the model folder")
    f = folder / name
    try:
        real = f.resolve(strict=True)
    except FileNotFoundError:
        if f.is_symlink():
            raise FormatError(f"{where}: {label} {name[:80]} is a symlink to nothing; refused") from None
        if required:
            raise ModelError(f"{where}: {label} {name[:80]} is missing from the folder") from None
        return None
    except (OSError, RuntimeError) as e:             # symlink loops
        raise FormatError(f"{where}: {label} {name[:80]}: cannot resolve ({type(e).__name__})") from None
    if not any(real.parent == r for r in _roots(folder)) or not real.is_file():
        raise FormatError(f"{where}: {label} {name[:80]} resolves outside the model folder or is not a "
                          "regular file; refused")
    return f


MAX_TEXT = 64 << 20          # config / tokenizer_config / chat template: KBs to a few MB in practice


def read_text(path, limit: int = MAX_TEXT) -> str:
    """A (confined) folder file's text: at most `limit` bytes (more is a FormatError, read no
    further), UTF-8 (else a FormatError naming the file)."""
    with open(path, "rb") as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise FormatError(f"{path}: over {limit} bytes, too large for this file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{path}: not UTF-8 text (byte {e.start})") from None
