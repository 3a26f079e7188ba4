"""Fuzzing a model's configs (issue 39, item 3): every field of config.json, generation_config.json,
tokenizer_config.json and GGUF metadata set to hostile values, then the model loaded, quantized,
asked for a chat reply. A case passes when it works or raises a mixqrt error (MixqrtError: typed,
naming the problem); anything else is an untyped error, what the fuzz counts.

    python -m mixqrt.testing.config_fuzz --examples 100000     # the long run (docs/runtime.md)
    tests/test_config_fuzz.py                                   # a few hundred, in CI

Needs hypothesis (the test extra)."""
from __future__ import annotations

import json
import os
import shutil
import traceback
from collections import Counter
from pathlib import Path

from mixqrt.errors import MixqrtError

HF_FILES = ("config.json", "generation_config.json", "tokenizer_config.json")
# keys some architecture reads that the tiny model's files do not carry: set them too
EXTRA_KEYS = {
    "config.json": ["rope_scaling", "sliding_window", "query_pre_attn_scalar", "final_logit_softcapping",
                    "attn_logit_softcapping", "layer_types", "sliding_window_pattern", "rope_local_base_freq",
                    "hidden_activation", "attention_bias", "mlp_bias", "num_experts", "num_experts_per_tok",
                    "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "text_config",
                    "use_sliding_window", "max_window_layers", "partial_rotary_factor", "vocab_size"],
    "generation_config.json": ["min_p", "max_new_tokens", "max_length", "do_sample", "repetition_penalty"],
    "tokenizer_config.json": ["unk_token", "add_eos_token", "added_tokens_decoder", "clean_up_tokenization_spaces"],
}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def hostile_values():
    """A hypothesis strategy of values a lying config holds."""
    from hypothesis import strategies as st
    surrogate = st.sampled_from(["\ud800", "a\udfff", "\udc80x", "ok\ud83d"])
    scalars = st.one_of(
        st.none(), st.booleans(),
        st.sampled_from([0, -1, 1, 2, 3, 7, 2 ** 31, 2 ** 63, -(2 ** 63) - 1, 2 ** 64, 10 ** 30, 10 ** 400]),
        st.integers(-(2 ** 70), 2 ** 70),
        st.sampled_from([0.0, -0.0, 1e-300, 1e308, float("nan"), float("inf"), -float("inf"), 0.5, -1.5]),
        st.floats(allow_nan=True, allow_infinity=True),
        surrogate, st.text(max_size=20), st.sampled_from(["", "silu", "gelu", "linear", "llama3", "<|im_end|>",
                                                           "{{ 1/0 }}", "{{ 'x' * 10**9 }}", "x" * 5000]))
    return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.one_of(st.text(max_size=8), surrogate),
                                                                         inner, max_size=4)), max_leaves=8)


def mutations(files: dict):
    """A hypothesis strategy of 1-3 edits [(file, key, value or DELETE)] to `files` ({name: dict})."""
    from hypothesis import strategies as st
    edits = []
    for name, d in files.items():
        keys = sorted(set(d) | set(EXTRA_KEYS.get(name, ())))
        edits.append(st.tuples(st.just(name), st.sampled_from(keys), st.one_of(st.just(DELETE), hostile_values())))
    return st.lists(st.one_of(*edits), min_size=1, max_size=3)


DELETE = "<delete>"


class Harness:
    """One tiny model per architecture in `work`; run(case) applies edits and exercises the model."""

    def __init__(self, work, archs=("qwen2", "gemma3", "llama")):
        from mixqrt.testing.tiny import make_tiny_gguf, make_tiny_hf_model
        self.work = Path(work)
        import mmap

        from mixqrt.io.gguf import read_gguf_header
        self.base, self.gguf_meta, self.gguf = {}, {}, {}
        for arch in archs:
            d = make_tiny_hf_model(self.work / f"base-{arch}", arch=arch)
            self.base[arch] = {n: json.loads((d / n).read_text()) for n in HF_FILES if (d / n).exists()}
            g = make_tiny_gguf(d, self.work / f"base-{arch}.gguf")
            with open(g, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                meta, tensors = read_gguf_header(m, g)
            self.gguf_meta[arch], self.gguf[arch] = dict(meta), (g, tensors)
        self.case = self.work / "case"
        self.counts: Counter = Counter()
        self.untyped: list = []

    def run_hf(self, arch: str, edits) -> str:
        """-> "ok" | "typed" | "untyped:<Type>"; untyped ones are kept in self.untyped."""
        files = {n: dict(d) for n, d in self.base[arch].items()}
        for name, key, value in edits:
            if name not in files:
                continue
            if value is DELETE or value == DELETE:
                files[name].pop(key, None)
            else:
                files[name][key] = value
        src = self.work / f"base-{arch}"
        if self.case.exists():
            shutil.rmtree(self.case)
        self.case.mkdir(parents=True)
        for f in src.iterdir():
            if f.name not in HF_FILES:
                os.link(f, self.case / f.name)
        for name, d in files.items():
            (self.case / name).write_text(json.dumps(d, ensure_ascii=True, allow_nan=True))
        return self._outcome(("hf", arch, edits), self._load_and_ask)

    def run_gguf(self, arch: str, edits) -> str:
        meta = dict(self.gguf_meta[arch])
        for _, key, value in edits:
            if value is DELETE or value == DELETE:
                meta.pop(key, None)
            else:
                meta[key] = value
        return self._outcome(("gguf", arch, edits), lambda: self._gguf(arch, meta))

    def _outcome(self, case, fn) -> str:
        try:
            fn()
            out = "ok"
        except MixqrtError:
            out = "typed"
        except Exception as e:  # noqa: BLE001 — what the fuzz is looking for
            out = f"untyped:{type(e).__name__}"
            if len(self.untyped) < 50:
                self.untyped.append((repr(case)[:600], traceback.format_exc()[-1500:]))
        self.counts[out.split(":")[0]] += 1
        if out.startswith("untyped"):
            self.counts[out] += 1
        return out

    def _load_and_ask(self) -> None:
        from mixqrt.pipeline import Pipeline
        os.environ["MIXQRT_CACHE"] = str(self.work / "cache")
        try:
            pipe = Pipeline(self.case, recipe="f32", progress=False, offline=True, max_context=64)
            try:
                pipe(MESSAGES, max_new_tokens=1)    # the chat template, the sampling defaults, a step
            finally:
                pipe.close()
        finally:
            shutil.rmtree(self.work / "cache", ignore_errors=True)

    def _gguf(self, arch: str, meta: dict) -> None:
        """GGUFSource over `meta` (the header read stubbed, the rest of the source as it is), then
        its tokenizer, config checks, generation config and a chat render."""
        from unittest import mock

        from mixqrt.io import gguf
        path, tensors = self.gguf[arch]
        with mock.patch.object(gguf, "read_gguf_header", lambda buf, p: (meta, tensors)):
            with gguf.GGUFSource(path) as src:
                tok = src.tokenizer
                from mixqrt.models import get_model_class
                cls = get_model_class(src.arch)
                cls.args_class.from_dict(dict(src.config))
                tok.encode_chat(MESSAGES)
                tok.encode("hello <|im_end|>")


def gguf_mutations(meta: dict):
    from hypothesis import strategies as st
    keys = sorted(k for k in meta if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    return st.lists(st.tuples(st.just("gguf"), st.sampled_from(keys), st.one_of(st.just(DELETE), hostile_values())),
                    min_size=1, max_size=3)


def fuzz(harness: Harness, examples: int, seed: int = 39, progress: bool = False) -> Counter:
    """`examples` cases, alternating HF folders and GGUF metadata over the harness's architectures."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st
    archs = sorted(harness.base)
    done = [0]
    strategies = [st.tuples(st.just("hf"), st.just(a), mutations(harness.base[a])) for a in archs] + \
                 [st.tuples(st.just("gguf"), st.just(a), gguf_mutations(harness.gguf_meta[a])) for a in archs]

    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck), phases=["generate"])
    @hseed(seed)
    @given(st.one_of(*strategies))
    def case(c):
        kind, arch, edits = c
        (harness.run_hf if kind == "hf" else harness.run_gguf)(arch, edits)
        done[0] += 1
        if progress and done[0] % 1000 == 0:
            print(done[0], dict(harness.counts), flush=True)

    case()
    return harness.counts


# ============================================================================ templates, through the server
FRAGMENTS = ["{% for m in messages %}", "{% endfor %}", "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n",
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", "{{ 1/0 }}", "{{ 'x' * 10**9 }}",
             "{{ 'x' * N }}", "{% for i in range(N) %}", "{{ i }}", "{{ [('x' * N)] * N }}", "{{ messages | tojson }}",
             "{% set ns = namespace(s='ab') %}", "{% set ns.s = ns.s ~ ns.s %}", "{% set ns.s = ns.s + ns.s %}",
             "{{ ns.s | length }}", "{{ raise_exception('no') }}", "{{ '%Nd' % 1 }}", "{{ 'x'.ljust(N) }}",
             "{{ messages[N] }}", "{{ messages + 1 }}", "{{ N ** N }}", "{{ ''.__class__ }}", "{% macro f(n) %}{{ f(n) }}{% endmacro %}",
             "{{ f(1) }}", "{{ bos_token }}", "{{ (messages | map(attribute='content') | join(' ')) * N }}",
             "{% if", "}}", "{{ m.content | center(N) }}", "{{ 'a\nb' | indent(N) }}", "{{ strftime_now('%Y') }}",
             "{{ tools | length }}", "{{ 'y'.replace('', 'z' * N) }}", "\ud800", "{{ '\ud800' }}"]


def templates():
    from hypothesis import strategies as st
    n = st.sampled_from(["0", "1", "7", "100", "100000", "10**6", "10**9", "-1", "2**64"])
    piece = st.tuples(st.sampled_from(FRAGMENTS), n).map(lambda fn: fn[0].replace("N", fn[1]))
    return st.lists(piece, min_size=1, max_size=8).map("".join)


_TEMPLATE_SERVER = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
os.environ["MIXQRT_CACHE"] = os.path.join(sys.argv[2], "cache")
import logging
logging.disable(logging.WARNING)
from mixqrt.pipeline import Pipeline
from mixqrt.serving.server.app import create_app
from mixqrt.serving.server.guard import HTTPError
from mixqrt.testing.config_fuzz import MESSAGES, proc_status
from mixqrt.testing.tiny import make_tiny_hf_model
pipe = Pipeline(make_tiny_hf_model(os.path.join(sys.argv[2], "tmpl")), recipe="f32", progress=False, offline=True,
                max_context=256)
app = create_app(pipe, model="tiny")
srv = app.state.server
body = {"messages": MESSAGES, "max_tokens": 1}
srv.prepare("chat", body)
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                        # the peak RSS from here on (VmHWM = VmRSS now)
except OSError:
    pass
print(json.dumps({"idle_rss": proc_status("VmRSS")}), flush=True)
for line in sys.stdin:
    pipe.tokenizer.chat_template = json.loads(line)
    try:
        srv.prepare("chat", body)
        out = [200, ""]
    except HTTPError as e:
        out = [e.status, ""]
    except Exception as e:                  # the app's handler would answer 500
        out = [500, f"{type(e).__name__}: {str(e)[:300]}"]
    print(json.dumps(out), flush=True)
print(json.dumps({"peak_rss": proc_status("VmHWM")}), flush=True)
srv.engine.close()
"""


def proc_status(key: str) -> int:
    """A /proc/self/status memory figure (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def template_fuzz(work, examples: int, progress: bool = False) -> dict:
    """`examples` generated templates on a server's model, in a child process (the server: its RSS
    is the server's, not the fuzzer's), each answering a chat request through the server's own
    request path (Server.prepare: a typed error is its 4xx, anything else would be the app's 500).
    -> {"statuses": {...}, "untyped": [...], "idle_rss", "peak_rss"} (peak: VmHWM since idle)."""
    import subprocess
    import sys

    from hypothesis import HealthCheck, given, settings
    root = str(Path(__file__).resolve().parent.parent.parent)
    child = subprocess.Popen([sys.executable, "-c", _TEMPLATE_SERVER, root, str(work)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    idle = json.loads(child.stdout.readline())["idle_rss"]
    statuses, untyped = Counter(), []

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              phases=["generate"])
    @given(templates())
    def case(t):
        child.stdin.write(json.dumps(t) + "\n")
        child.stdin.flush()
        line = child.stdout.readline()
        if not line:
            raise RuntimeError(f"the server process died (status {child.wait()}) on template {t[:200]!r}")
        status, err = json.loads(line)
        statuses[status] += 1
        if status >= 500 and len(untyped) < 50:
            untyped.append((t[:300], err))
        n = sum(statuses.values())
        if progress and n % 5000 == 0:
            print(n, dict(statuses), flush=True)

    try:
        case()
        child.stdin.close()
        peak = json.loads(child.stdout.readline())["peak_rss"]
    finally:
        if child.poll() is None:
            if not child.stdin.closed:
                child.stdin.close()
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
    return {"statuses": dict(statuses), "untyped": untyped, "idle_rss": idle, "peak_rss": peak}


def main(argv=None) -> None:
    import argparse
    import tempfile
    import time
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=1000)
    ap.add_argument("--templates", type=int, default=0, help="also this many generated chat templates")
    ap.add_argument("--seed", type=int, default=39, help="hypothesis seed (run several with different seeds)")
    ap.add_argument("--out", default=None, help="write the counts and the untyped errors here (JSON)")
    a = ap.parse_args(argv)
    import logging
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="mixqrt-config-fuzz-") as d:
        h = Harness(d)
        t = time.perf_counter()
        counts = fuzz(h, a.examples, seed=a.seed, progress=True) if a.examples else Counter()
        res = {"examples": a.examples, "seconds": round(time.perf_counter() - t, 1), "counts": dict(counts),
               "untyped": h.untyped}
        if a.templates:
            t = time.perf_counter()
            res["templates"] = {"examples": a.templates, **template_fuzz(d, a.templates, progress=True),
                                "seconds": round(time.perf_counter() - t, 1)}
    print(json.dumps({k: v for k, v in res.items() if k != "untyped"}))
    for case, tb in res["untyped"][:10]:
        print(case, "\n", tb)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
