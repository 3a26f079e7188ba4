"""`mixqrt serve MODEL [--ray --replicas N]`: argument parsing and the uvicorn settings."""
from __future__ import annotations

import argparse
import os
import sys

from mixqrt.errors import MixqrtError
from mixqrt.quantize.recipes import DEFAULT_RECIPE
from mixqrt.serving.server.guard import BODY_TIMEOUT, HEADER_TIMEOUT, MAX_CLIENT_CONNECTIONS, MAX_CONNECTIONS
from mixqrt.generation.speculative import add_speculative_arguments, speculative_kwargs

DEFAULT_SLOTS = 8
DEFAULT_QUEUE = 64
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def uvicorn_config(app, host: str, port: int, *, max_slots=DEFAULT_SLOTS, max_queue=DEFAULT_QUEUE,
                   limits=None, **kw):
    """A uvicorn.Config whose limits keep every client answered: the listen backlog holds a burst
    of connections (no resets), and limit_concurrency (which counts open connections) sits above
    what the engine admits (running + queued) and above the Guard's connection budget, so the
    engine's 503 + Retry-After and the Guard's shedding answer first; uvicorn's own 503 is the last
    guard. The HTTP protocol is guard.protocol_class's: a header
    deadline and a per-peer connection limit (`limits`, default the app's own), so that stalled
    or hoarded connections cannot fill limit_concurrency; the body deadline is the app's Guard."""
    import uvicorn

    from mixqrt.serving.server.guard import Limits, protocol_class
    if limits is None:
        limits = getattr(getattr(getattr(app, "state", None), "server", None), "limits", None) or Limits()
    # uvicorn's limit counts every connection and every request task: above the Guard's budget, which
    # sheds half-open connections first (guard.protocol_class), and above what the engine admits
    budget = max(limits.max_connections, limits.max_client_connections + 1)
    return uvicorn.Config(app, host=host, port=port, backlog=2048, http=protocol_class(limits),
                          limit_concurrency=max(budget, max_slots + max_queue) + 64, timeout_keep_alive=5,
                          access_log=False, log_level=kw.pop("log_level", "warning"),
                          h11_max_incomplete_event_size=64 * 1024, **kw)


def run(app, host: str = "127.0.0.1", port: int = 8000, **kw) -> None:
    import uvicorn

    from mixqrt.io.atomic import Terminated, was_terminated

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if was_terminated():           # SIGTERM came before uvicorn took the signal over
                self.should_exit = True

    if was_terminated():
        raise Terminated("signal 15")
    _Server(uvicorn_config(app, host, port, **kw)).run()
    if was_terminated():
        raise Terminated("signal 15")


def _require(extra: str, *modules):
    import importlib
    for m in modules:
        try:
            importlib.import_module(m)
        except ImportError:
            raise MixqrtError(f"`mixqrt serve{' --ray' if extra == 'ray' else ''}` needs {m}: "
                              f"pip install 'mixqrt[{extra}]'") from None


def default_hosts(bind: str) -> tuple:
    """Host headers accepted by default: on loopback only this machine's names (stops DNS
    rebinding from a web page); bound to a specific address, that address too; 0.0.0.0: any."""
    from mixqrt.serving.server.guard import LOOPBACK_HOSTS
    if bind in ("0.0.0.0", "::", ""):
        return ("*",)
    return tuple(dict.fromkeys((*LOOPBACK_HOSTS, bind.lower())))


def limits_from_args(a):
    from mixqrt.serving.server.guard import Limits
    keys = api_keys_from_args(a)
    return Limits(api_key=keys[0] if len(keys) == 1 else (keys or None),
                  allowed_hosts=tuple(a.allowed_hosts or default_hosts(a.host)),
                  allowed_origins=tuple(a.allowed_origins or ()), max_body_bytes=a.max_body_bytes,
                  max_tokens=a.max_tokens_cap, write_timeout=a.stall_timeout, header_timeout=a.header_timeout,
                  body_timeout=a.body_timeout, max_client_connections=a.max_client_connections,
                  max_connections=a.max_connections)


MAX_KEY_FILE_BYTES = 1 << 20


def api_keys_from_args(a) -> tuple:
    """--api-key (repeatable; default $MIXQRT_API_KEY) and the lines of --api-key-file, in order."""
    env = os.environ.get("MIXQRT_API_KEY")
    keys = list(a.api_key or ([env] if env else []))
    if getattr(a, "api_key_file", None):
        try:
            with open(a.api_key_file, "rb") as f:
                raw = f.read(MAX_KEY_FILE_BYTES + 1)
        except OSError as e:
            raise MixqrtError(f"cannot read --api-key-file {a.api_key_file}: {e.strerror or e}") from None
        if len(raw) > MAX_KEY_FILE_BYTES:
            raise MixqrtError(f"--api-key-file {a.api_key_file} is over {MAX_KEY_FILE_BYTES} bytes")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise MixqrtError(f"--api-key-file {a.api_key_file} is not UTF-8 text") from None
        keys += [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if getattr(a, "api_key_file", None) and not keys:
        raise MixqrtError(f"--api-key-file {a.api_key_file} holds no key")
    return tuple(dict.fromkeys(keys))


def engine_kwargs(a) -> dict:
    """Engine settings from the arguments. The GEMM tile cache is off unless --gemm-cache-bytes asks
    for it: a decode step of up to 8 slots reads the packed weights faster than the unpacked tiles
    (docs/engine.md), and Ray replicas would each hold their own copy beside the shared weights."""
    gc = a.gemm_cache_bytes or 0
    return {"max_slots": a.max_slots, "max_queue": a.max_queue, "prefill_chunk": a.prefill_chunk,
            "kv_cache_bytes": a.kv_cache_bytes, "stall_timeout": a.stall_timeout, "threads": a.threads,
            "gemm_cache_bytes": gc, "kv_type": a.kv_type}


def cmd_serve(a):
    _require("serve", "starlette", "uvicorn", "prometheus_client")
    if a.host not in LOOPBACK and not api_keys_from_args(a):
        print(f"mixqrt serve: warning: listening on {a.host} without --api-key: anyone who can reach this "
              "port can use the model", file=sys.stderr)
    if a.ray:
        if speculative_kwargs(a):
            raise MixqrtError("--lookup / --draft are not supported with --ray yet: serve without --ray")
        from mixqrt.serving.server.ray import keep_ray_local
        keep_ray_local(a.host, a.ray_address)      # before Ray is imported
        _require("ray", "ray.serve")
        from mixqrt.pipeline import prepare
        from mixqrt.serving.server.ray import serve_ray
        path = prepare(a.model, a.recipe, offline=True if a.offline else None, progress=not a.quiet)
        return serve_ray(path, host=a.host, port=a.port, address=a.ray_address,
                         model_name=a.model_alias or _model_id(a.model) or path.stem, limits=limits_from_args(a),
                         engine_kwargs=engine_kwargs(a), replicas=a.replicas, min_replicas=a.min_replicas,
                         max_replicas=a.max_replicas, max_context=a.ctx)
    import logging

    from mixqrt.pipeline import Pipeline
    from mixqrt.serving.server.app import create_app
    pipe = Pipeline(a.model, recipe=a.recipe, threads=a.threads, progress=not a.quiet,
                    offline=True if a.offline else None, max_context=a.ctx, weights_in_memory=not a.mmap_weights,
                    kv_type=a.kv_type,
                    **speculative_kwargs(a))
    if not a.quiet:
        logging.basicConfig(level=logging.INFO, format="mixqrt serve: %(message)s")
    app = create_app(pipe, model=a.model_alias or _model_id(a.model), limits=limits_from_args(a),
                     engine_kwargs=engine_kwargs(a))
    print(f"mixqrt serve: {app.state.server.model} at http://{a.host}:{a.port}/v1 ({a.max_slots} slots, "
          f"{a.max_queue} queued; Ctrl-C to stop)", file=sys.stderr)
    try:
        run(app, a.host, a.port, max_slots=a.max_slots, max_queue=a.max_queue)
    except OSError as e:
        raise MixqrtError(f"cannot serve on {a.host}:{a.port}: {e.strerror or e}") from None


def _model_id(model: str | None) -> str | None:
    """The id /v1/models reports: an alias or hub id as given, a local path by its file/folder name."""
    if not model or not os.path.exists(model):
        return model
    name = os.path.basename(os.path.normpath(model))
    for ext in (".mxq", ".gguf"):
        if name.lower().endswith(ext):
            return name[:-len(ext)]
    return name


def _positive(v: str) -> int:
    n = int(v)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _non_negative(v: str) -> int:
    n = int(v)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


from mixqrt.models.config_limits import parse_bytes as _bytes  # noqa: E402  (the byte counts of --kv-cache-bytes, also `mixqrt generate`'s)


def _positive_float(v: str) -> float:
    x = float(v)
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {v}")
    return x


def _csv(v: str) -> list:
    return [x.strip() for x in v.split(",") if x.strip()]


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    s = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (continuous batching; --ray: replicas)",
        description="OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions (suffix: fill-in-the-middle), "
                    "/v1/embeddings, llama.cpp's /infill, /v1/models, /health, /metrics (docs/server.md, "
                    "docs/completion.md).")
    s.add_argument("model", nargs="?", default=None,
                   help="a .mxq, a .gguf, a Hugging Face folder, a hub id or alias (default: the demo model)")
    s.add_argument("--recipe", default=None, help=f"quantization recipe (default {DEFAULT_RECIPE}, or the name's suffix)")
    s.add_argument("-t", "--threads", type=int, default=None, help="kernel threads (default: usable cores)")
    s.add_argument("--ctx", type=int, default=None,
                   help="context length (default: the model's own, e.g. 32768 for Qwen2.5)")
    from mixqrt.models.kv_cache import DEFAULT_KV_TYPE, KV_TYPES
    s.add_argument("--kv-type", default=None, choices=KV_TYPES, metavar="TYPE",
                   help=f"KV cache type: {', '.join(KV_TYPES)} (default {DEFAULT_KV_TYPE}; docs/long-context.md)")
    add_speculative_arguments(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* and /metrics; repeat for several keys, "
                        "each with its own prompt cache (default: $MIXQRT_API_KEY, else no key)")
    s.add_argument("--api-key-file", default=None,
                   help="more keys, one per line ('#' comments), kept out of the process list")
    s.add_argument("--allowed-hosts", type=_csv, default=None,
                   help="comma-separated Host names accepted (default: loopback names when bound to loopback, "
                        "the bind address otherwise, any for 0.0.0.0)")
    s.add_argument("--allowed-origins", type=_csv, default=None,
                   help="comma-separated browser origins allowed, with CORS (default: none, same-origin only)")
    s.add_argument("--max-slots", type=_positive, default=DEFAULT_SLOTS, help="sequences decoded together")
    s.add_argument("--max-queue", type=_positive, default=DEFAULT_QUEUE,
                   help="requests waiting for a slot; more get 503 + Retry-After")
    s.add_argument("--prefill-chunk", type=_positive, default=256, help="prompt tokens per scheduler step")
    s.add_argument("--kv-cache-bytes", type=_bytes, default=None,
                   help="memory bound of the KV caches, prompt cache included (LRU; 50MiB, 2GiB...; a prompt "
                        "that cannot fit gets a 400; 0: no prompt cache and no bound; default: a quarter of "
                        "the memory available at start)")
    s.add_argument("--gemm-cache-bytes", type=_non_negative, default=None,
                   help="bytes of unpacked weight tiles that batched steps of more than 8 rows read "
                        "instead of unpacking (default 0: off; docs/engine.md)")
    s.add_argument("--max-tokens-cap", type=_positive, default=None,
                   help="largest max_tokens accepted (400 above); also the budget of a request that sends none")
    s.add_argument("--max-body-bytes", type=_positive, default=1 << 20, help="largest request body")
    s.add_argument("--stall-timeout", type=float, default=10.0,
                   help="seconds a stream may go unread before it is cancelled")
    s.add_argument("--header-timeout", type=_positive_float, default=HEADER_TIMEOUT,
                   help=f"seconds a connection has to send a request's headers, else 408 and closed "
                        f"(default {HEADER_TIMEOUT:g})")
    s.add_argument("--body-timeout", type=_positive_float, default=BODY_TIMEOUT,
                   help=f"seconds a request's whole body may take after its headers, else 408 and closed "
                        f"(default {BODY_TIMEOUT:g})")
    s.add_argument("--max-client-connections", type=_non_negative, default=MAX_CLIENT_CONNECTIONS,
                   help=f"open connections accepted from one client address; more get 503 and are closed "
                        f"(default {MAX_CLIENT_CONNECTIONS}; 0: no limit, e.g. behind a reverse proxy)")
    s.add_argument("--mmap-weights", action="store_true",
                   help="map the .mxq instead of reading it into private memory (less memory at start, "
                        "but a file replaced or truncated under the server stops it: docs/server.md)")
    s.add_argument("--max-connections", type=_non_negative, default=MAX_CONNECTIONS,
                   help=f"open connections in all (default {MAX_CONNECTIONS}, above --max-client-connections); at "
                        f"it the oldest connection without a request in progress is shed (0: no budget)")
    s.add_argument("--model-alias", default=None, help="model id reported by /v1/models (default: MODEL)")
    r = s.add_argument_group("Ray Serve (pip install 'mixqrt[ray]'; docs/server.md)")
    r.add_argument("--ray", action="store_true", help="serve engine replicas on Ray Serve")
    r.add_argument("--replicas", type=_positive, default=None, help="fixed number of replicas (default 1)")
    r.add_argument("--min-replicas", type=_positive, default=None, help="autoscaling lower bound")
    r.add_argument("--max-replicas", type=_positive, default=None, help="autoscaling upper bound")
    r.add_argument("--ray-address", default=None, help="an existing cluster (default: auto, else a local one)")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bars or request log")
    s.add_argument("--offline", action="store_true", help="never touch the network (like HF_HUB_OFFLINE=1)")
    s.set_defaults(fn=cmd_serve)
    return s
