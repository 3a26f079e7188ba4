"""Model sources (GGUF, HF safetensors folders, hub snapshots) behind one contract; see source.py."""
from mixqrt.io.dispatch import open_source  # noqa: F401
from mixqrt.io.source import Source  # noqa: F401


def resolve_hub(repo_id, *, offline=None, progress=True, cache_dir=None):
    """Local snapshot folder for a hub id (downloads config, tokenizer and safetensors only)."""
    from mixqrt.io.hub import resolve_hub as _resolve
    return _resolve(repo_id, offline=offline, progress=progress, cache_dir=cache_dir)


__all__ = ["Source", "open_source", "resolve_hub"]
