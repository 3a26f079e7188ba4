"""Hub ids ("Qwen/Qwen2-0.5B-Instruct") -> a local snapshot folder that HFSource can open.

Only what mixqrt reads is fetched: config, tokenizer, generation config and safetensors. Pickle
checkpoints (*.bin, *.pt) are never downloaded, so a repo that only has them ends up with a
folder that HFSource refuses with a message saying why.
"""
from __future__ import annotations

import os
from pathlib import Path

from mixqrt.errors import ModelError

ALLOW_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "chat_template.jinja", "*.safetensors",
                  "model.safetensors.index.json"]


def _env_offline() -> bool:
    # read the variable now: huggingface_hub.constants freezes it at import time
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _how_to_get(repo_id: str) -> str:
    return (f"to use it offline, on a machine with network run `hf download {repo_id}` "
            f"(older versions: `huggingface-cli download {repo_id}`) and either pass the downloaded "
            f"folder (`--local-dir DIR`, then open DIR) or copy the cache and point HF_HOME at it with "
            f"HF_HUB_OFFLINE=1")


def resolve_hub(repo_id: str, *, offline: bool | None = None, progress: bool = True,
                cache_dir=None, revision: str | None = None) -> Path:
    """Local folder for `repo_id`: downloaded (safetensors + json only) or taken from the HF cache.

    offline=None follows HF_HUB_OFFLINE. Without network the cache is used when it has a snapshot;
    otherwise ModelError names the repo and says how to get it there.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError)

    if offline is None:
        offline = _env_offline()
    kwargs = dict(repo_id=repo_id, allow_patterns=ALLOW_PATTERNS, cache_dir=cache_dir, revision=revision,
                  local_files_only=bool(offline))
    if not progress:
        from tqdm.auto import tqdm

        class _Silent(tqdm):
            def __init__(self, *a, **k):
                k["disable"] = True
                super().__init__(*a, **k)
        kwargs["tqdm_class"] = _Silent
    try:
        folder = snapshot_download(**kwargs)
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        why = "offline mode (HF_HUB_OFFLINE) forbids downloading" if offline else "the hub cannot be reached"
        raise ModelError(f"{repo_id}: not in the Hugging Face cache and {why}; "
                         f"{_how_to_get(repo_id)} ({type(e).__name__})") from None
    except GatedRepoError:
        raise ModelError(f"{repo_id}: gated repo — accept its license on huggingface.co and log in "
                         f"(`hf auth login`), or {_how_to_get(repo_id)}") from None
    except RepositoryNotFoundError:
        raise ModelError(f"{repo_id}: no such repo on the hub (or it is private)") from None
    except RevisionNotFoundError:
        raise ModelError(f"{repo_id}: revision {revision!r} not found") from None
    except HfHubHTTPError as e:
        raise ModelError(f"{repo_id}: download failed ({e}); {_how_to_get(repo_id)}") from None
    except (OSError, ValueError) as e:               # connection errors, bad repo id syntax
        raise ModelError(f"{repo_id}: cannot resolve on the hub ({type(e).__name__}: {e}); "
                         f"{_how_to_get(repo_id)}") from None
    return Path(folder)
