"""llama.cpp's own `llama-server` as a benchmark anchor: start it, wait for it, ask it, stop it.

Benchmark-only (never a dependency of the package). The binary comes from
benchmarks/llamacpp_build.sh (llama.cpp as vendored by llama-cpp-python's PyPI sdist), found by
`_common.llama_cpp_bin` ($MIXQRT_LLAMA_CPP_BIN, then $PATH). Used by serve_load.py (parallel slots,
continuous batching) and speculative.py (its draft-model and n-gram speculation).
"""
from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from _common import llama_cpp_bin


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    """An OpenAI-compatible server in its own process group, its output in `log`."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path):
        self.name, self.cmd, self.port = name, cmd, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout=300.0):
        t = time.monotonic()
        while time.monotonic() - t < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise SystemExit(f"{self.name} did not come up in {timeout:.0f} s")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def llama_server_cmd(gguf: str, port: int, threads: int, ctx: int, parallel: int = 1,
                     extra: list[str] | None = None) -> list[str]:
    """llama-server on `gguf`: `parallel` slots with continuous batching, `ctx` tokens per slot (the
    KV cache is ctx x parallel, as mixqrt serve gives each slot its own context), no web UI."""
    return [str(llama_cpp_bin("llama-server")), "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-c", str(ctx * parallel), "-np", str(parallel),
            "-cb", "--no-webui"] + list(extra or [])


def start_llama_server(name: str, gguf: str, threads: int, ctx: int, log_dir: Path, parallel: int = 1,
                       extra: list[str] | None = None) -> ServerProc:
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    return ServerProc(name, llama_server_cmd(gguf, port, threads, ctx, parallel, extra), port,
                      log_dir / f"{name}.log")


def complete_ids(url: str, ids: list[int], n_predict: int, timeout: float = 900.0) -> dict:
    """llama-server's native /completion on a token-id prompt, greedy, no prompt cache: its reply
    (`tokens`, `timings` with predicted_per_second, draft_n, draft_n_accepted)."""
    body = {"prompt": [int(i) for i in ids], "n_predict": int(n_predict), "temperature": 0.0, "top_k": 1,
            "cache_prompt": False, "return_tokens": True, "stream": False}
    req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())
