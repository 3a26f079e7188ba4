"""Hostile model files, tried as an attacker would: every case gets a typed error naming the field
(FormatError/ModelError), bounded memory, no file content in messages, and safe concurrent writes."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
from tinymodel import make_tiny_gguf, make_tiny_hf_model, write_safetensors

from mixqrt.errors import FormatError, MixqrtError, ModelError
from mixqrt.io import open_source
from mixqrt.io.gguf import GGUFSource
from mixqrt.io.hf import HFSource, SafetensorsFile
from mixqrt.models.config_limits import FLOAT_LIMITS, INT_LIMITS

TESTS = Path(__file__).resolve().parent
# Subprocesses import the mixqrt this test imported (CI installs it into a venv; the clone's
# mixqrt/ has no built extensions)
import mixqrt  # noqa: E402

PKG_PARENT = Path(mixqrt.__file__).resolve().parent.parent


# ------------------------------------------------------------------ raw GGUF bytes
def _s(x: str) -> bytes:
    b = x.encode()
    return struct.pack("<Q", len(b)) + b


def _kv(key, vtype, raw):
    return _s(key) + struct.pack("<I", vtype) + raw


def _gguf(kvs, tensors=(), data=b"", align=32):
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs)
    for name, dims, ttype, off in tensors:
        out += _s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", ttype, off)
    out += b"\0" * (-len(out) % align)
    return out + data


def _u32(v):
    return struct.pack("<I", v)


def _llama_kvs(**over):
    vals = {"block_count": 1, "context_length": 64, "embedding_length": 8, "feed_forward_length": 16,
            "attention.head_count": 2, "attention.head_count_kv": 2, "vocab_size": 16}
    vals.update(over)
    kvs = [_kv("general.architecture", 8, _s("llama")),
           _kv("llama.attention.layer_norm_rms_epsilon", 6, struct.pack("<f", 1e-5))]
    for k, v in vals.items():
        if isinstance(v, str):
            kvs.append(_kv(f"llama.{k}", 8, _s(v)))
        else:
            kvs.append(_kv(f"llama.{k}", 10, struct.pack("<Q", v)))
    return kvs


def test_block_count_1e9_is_refused_in_bounded_memory(tmp_path):
    """The issue's 409-byte GGUF: block_count = 10^9 used to grow memory without bound."""
    blob = _gguf(_llama_kvs(block_count=10 ** 9),
                 [("token_embd.weight", [8, 16], 0, 0)], b"\0" * 512)
    assert len(blob) < 1024
    p = tmp_path / "huge.gguf"
    p.write_bytes(blob)
    tracemalloc.start()
    try:
        with pytest.raises(ModelError, match=r"llama\.block_count=1000000000 is outside"):
            GGUFSource(p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def test_layer_count_checked_against_tensor_table(tmp_path):
    """A config that stays inside the bounds but claims more layers than the file holds is refused
    before anything is sized from it."""
    d = make_tiny_hf_model(tmp_path / "m", dtype="f32")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 1000
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="config says 1000 layers, the tensor table holds layers 0..1"):
        HFSource(d)


@pytest.mark.parametrize("key", sorted(INT_LIMITS) + sorted(FLOAT_LIMITS))
def test_config_json_bounds(tmp_path, key):
    d = make_tiny_hf_model(tmp_path / "m", dtype="f32")
    cfg = json.loads((d / "config.json").read_text())
    hi = (INT_LIMITS.get(key) or FLOAT_LIMITS[key])[1]
    cfg[key] = hi + 1 if key in INT_LIMITS else hi * 2
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=key):
        HFSource(d)


@pytest.mark.parametrize("key,value", [("hidden_size", "64"), ("num_hidden_layers", 2.0),
                                       ("num_attention_heads", 0), ("num_key_value_heads", 0),
                                       ("rope_theta", "1e6"), ("rms_norm_eps", -1.0),
                                       ("head_dim", "16"), ("max_position_embeddings", True)])
def test_config_json_types(tmp_path, key, value):
    d = make_tiny_hf_model(tmp_path / "m", dtype="f32")
    cfg = json.loads((d / "config.json").read_text())
    cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=key):
        HFSource(d)


def test_model_args_bounds():
    from mixqrt.models import build_model
    cfg = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 10 ** 9, "intermediate_size": 128,
           "num_attention_heads": 4, "vocab_size": 448}
    with pytest.raises(ModelError, match="num_hidden_layers"):
        build_model(cfg, {})


@pytest.mark.parametrize("over,field", [
    ({"attention.head_count": 0}, "llama.attention.head_count"),
    ({"attention.head_count_kv": 0}, "llama.attention.head_count_kv"),
    ({"block_count": "12"}, "llama.block_count"),
    ({"embedding_length": "8"}, "llama.embedding_length"),
    ({"context_length": 1 << 40}, "llama.context_length"),
    ({"feed_forward_length": 0}, "llama.feed_forward_length"),
])
def test_gguf_bad_config_values(tmp_path, over, field):
    p = tmp_path / "bad.gguf"
    p.write_bytes(_gguf(_llama_kvs(**over)))
    with pytest.raises(ModelError, match=field.replace(".", r"\.")):
        GGUFSource(p)


def test_gguf_string_typed_epsilon(tmp_path):
    kvs = [k for k in _llama_kvs() if b"epsilon" not in k]
    kvs.append(_kv("llama.attention.layer_norm_rms_epsilon", 8, _s("1e-5")))
    p = tmp_path / "eps.gguf"
    p.write_bytes(_gguf(kvs))
    with pytest.raises(ModelError, match=r"layer_norm_rms_epsilon must be a finite number"):
        GGUFSource(p)


def test_gguf_deeply_nested_arrays(tmp_path):
    depth = 100_000
    raw = (struct.pack("<IQ", 9, 1)) * depth + struct.pack("<IQ", 4, 0)
    p = tmp_path / "nest.gguf"
    p.write_bytes(_gguf([_kv("general.architecture", 8, _s("llama")), _kv("evil", 9, raw)]))
    with pytest.raises(FormatError, match="evil: arrays nested deeper"):
        GGUFSource(p)


def test_gguf_bad_tokenizer_metadata(tmp_path):
    """Token ids, token lists and merges of the wrong type: typed errors, not IndexError/TypeError."""
    d = make_tiny_hf_model(tmp_path / "hf", dtype="f32")
    good = make_tiny_gguf(d, tmp_path / "good.gguf")
    with GGUFSource(good) as src:
        meta = dict(src.metadata)
    from mixqrt.generation.tokenizer import Tokenizer
    for key, val, words in [("tokenizer.ggml.bos_token_id", 10 ** 6, "bos_token_id"),
                            ("tokenizer.ggml.eos_token_id", "2", "eos_token_id"),
                            ("tokenizer.ggml.merges", np.arange(3), "merges"),
                            ("tokenizer.ggml.tokens", np.arange(3), "tokens"),
                            ("tokenizer.ggml.token_type", ["x"], "token_type")]:
        m = dict(meta, **{key: val})
        with pytest.raises(FormatError, match=words):
            Tokenizer.from_gguf_metadata(m, where="t.gguf")


# ------------------------------------------------------------------ safetensors / HF folders
SECRET = b"root:x:0:0:TOPSECRET-CONTENT\n"


def _secret(tmp_path) -> Path:
    s = tmp_path / "outside" / "passwd"
    s.parent.mkdir(exist_ok=True)
    s.write_bytes(SECRET * 4)
    return s


def _leaks(msg: str) -> bool:
    n = struct.unpack("<Q", SECRET[:8])[0]
    return "TOPSECRET" in msg or "root:x" in msg or str(n) in msg


@pytest.mark.parametrize("how", ["absolute", "dotdot", "subdir", "symlink", "etc-passwd", "not-a-string", "fifo"])
def test_index_cannot_leave_the_model_folder(tmp_path, how):
    d = make_tiny_hf_model(tmp_path / "m", dtype="f32", sharded=True)
    secret = _secret(tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    victim = next(iter(index["weight_map"]))
    target = {"absolute": str(secret), "dotdot": "../outside/passwd", "subdir": "outside/passwd",
              "symlink": "link.safetensors", "etc-passwd": "/etc/passwd", "not-a-string": 7,
              "fifo": "pipe.safetensors"}[how]
    if how == "symlink":
        (d / "link.safetensors").symlink_to(secret)
    if how == "fifo":
        os.mkfifo(d / "pipe.safetensors")
    index["weight_map"][victim] = target
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FormatError, match="shard") as e:
        HFSource(d)
    assert not _leaks(str(e.value))


def test_symlinked_weights_outside_the_folder(tmp_path):
    d = make_tiny_hf_model(tmp_path / "m", dtype="f32")
    secret = _secret(tmp_path)
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to(secret)
    with pytest.raises(FormatError, match="outside the model folder") as e:
        open_source(d)
    assert not _leaks(str(e.value))


def test_hub_snapshot_symlinks_still_open(tmp_path):
    """The HF cache links snapshots/<rev>/file -> ../../blobs/<sha>: that is inside the repo's cache."""
    src = make_tiny_hf_model(tmp_path / "src", dtype="f32")
    repo = tmp_path / "models--org--tiny"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        blob = repo / "blobs" / (f.name + ".blob")
        blob.write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(Path("../../blobs") / blob.name)
    with open_source(snap) as s:
        assert s.get("model.norm.weight").shape == (64,)


def test_non_safetensors_content_not_echoed(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(SECRET * 4)
    with pytest.raises(FormatError) as e:
        SafetensorsFile(p)
    assert not _leaks(str(e.value))


@pytest.mark.parametrize("where", ["header", "config", "index", "generation_config", "tokenizer_config"])
def test_deeply_nested_json(tmp_path, where):
    deep = b"[" * 100_000 + b"]" * 100_000
    d = make_tiny_hf_model(tmp_path / "m", dtype="f32", sharded=where == "index")
    if where == "header":
        p = tmp_path / "nest.safetensors"
        p.write_bytes(struct.pack("<Q", len(deep)) + deep)
        with pytest.raises(FormatError, match="not valid UTF-8 JSON"):
            SafetensorsFile(p)
        return
    name = {"config": "config.json", "index": "model.safetensors.index.json",
            "generation_config": "generation_config.json", "tokenizer_config": "tokenizer_config.json"}[where]
    (d / name).write_bytes(b'{"a": ' + deep + b"}")
    with pytest.raises(FormatError, match=name.replace(".", r"\.")):
        src = open_source(d)
        src.tokenizer


# ------------------------------------------------------------------ tokenizer panics
def test_tokenizer_panic_is_a_typed_error(tmp_path):
    """A pre-tokenizer regex that hits Oniguruma's retry limit makes the Rust side panic; pyo3 raises
    PanicException (a BaseException no `except Exception` catches). It must come out typed."""
    from tokenizers import Regex
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models, pre_tokenizers

    from mixqrt.generation.tokenizer import Tokenizer
    tk = HFTok(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"(a|a)+b"), behavior="isolated")
    (tmp_path / "tokenizer.json").write_text(tk.to_str())
    t = Tokenizer.from_folder(tmp_path)
    assert t.encode("ab") == []
    env = dict(os.environ, RUST_BACKTRACE="0")
    code = ("import sys; sys.path[:0] = sys.argv[1:2]\n"
            "from mixqrt.generation.tokenizer import Tokenizer\nfrom mixqrt.errors import ModelError\n"
            f"t = Tokenizer.from_folder({str(tmp_path)!r})\n"
            "try:\n    t.encode('a' * 40 + 'c')\nexcept ModelError as e:\n    print('TYPED', e)\n")
    out = subprocess.run([sys.executable, "-c", code, str(PKG_PARENT)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert "TYPED tokenizer failed while encoding" in out.stdout, out.stdout + out.stderr[-2000:]


# ------------------------------------------------------------------ concurrent / interrupted writes
@pytest.fixture(scope="module")
def tiny_mxq(tmp_path_factory):
    from mixqrt.quantize.convert import quantize_model
    t = tmp_path_factory.mktemp("mxq")
    d = make_tiny_hf_model(t / "hf", dtype="f32")
    out = t / "tiny.mxq"
    quantize_model(d, "2356", out, progress=False)
    return out


def test_concurrent_save_same_path(tmp_path, tiny_mxq):
    """The issue's race: 200 saves from threads to one path gave 19 corrupt files + FileNotFoundErrors."""
    from mixqrt.io.mxq import MxqFile
    from mixqrt.pipeline import Pipeline

    pipe = Pipeline.__new__(Pipeline)
    pipe.path = tiny_mxq
    want = tiny_mxq.read_bytes()
    dest = tmp_path / "out.mxq"
    errors, corrupt = [], 0

    def worker():
        try:
            for _ in range(25):
                pipe.save(dest)
        except BaseException as e:          # noqa: BLE001 - the test counts every failure
            errors.append(repr(e))

    for _ in range(4):
        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        corrupt += dest.read_bytes() != want
        MxqFile(dest).close()
    assert not errors and corrupt == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.mxq"]       # the lock lives in the cache


def test_save_keeps_permissions(tmp_path, tiny_mxq):
    from mixqrt.pipeline import Pipeline
    pipe = Pipeline.__new__(Pipeline)
    pipe.path = tiny_mxq
    dest = pipe.save(tmp_path / "p.mxq")
    assert dest.stat().st_mode & 0o644 == 0o644


_KILLED_WRITER = r"""
import os, signal, sys
sys.path[:0] = [sys.argv[1]]
from mixqrt.io.mxq import MxqWriter
from mixqrt.formats.qtensor import QTensor
import numpy as np
w = MxqWriter(sys.argv[2], {})
w.add("w", QTensor("f32", (4,), np.zeros(4, np.float32).view(np.uint8)))
w._f.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_sigkill_leaves_temp_then_next_run_cleans_it(tmp_path, monkeypatch):
    from mixqrt.io.atomic import clean_stale_temps
    target = tmp_path / "m.mxq"
    r = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(PKG_PARENT), str(target)], timeout=120)
    assert r.returncode == -9
    temps = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(temps) == 1 and temps[0].name.startswith(".m.mxq.")
    # a live writer's temp (our own pid, and a lock held by someone) is never touched
    mine = tmp_path / f".x.mxq.{os.getpid()}.abc.tmp"
    mine.write_bytes(b"x")
    assert clean_stale_temps(tmp_path) == temps
    assert mine.exists() and not temps[0].exists()


def test_stale_temp_of_a_locked_target_is_kept(tmp_path):
    from mixqrt.io.atomic import clean_stale_temps, file_lock
    old = tmp_path / ".m.mxq.999999999.abc.tmp"          # no such pid
    old.write_bytes(b"x")
    with file_lock(tmp_path / "m.mxq"):
        code = ("import sys; sys.path[:0] = sys.argv[1:2]\nfrom mixqrt.io.atomic import clean_stale_temps\n"
                "print(len(clean_stale_temps(sys.argv[2])))")
        out = subprocess.run([sys.executable, "-c", code, str(PKG_PARENT), str(tmp_path)],
                             capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == "0" and old.exists()
    assert clean_stale_temps(tmp_path) == [old]


_PREPARE = r"""
import os, sys, time
sys.path[:0] = [sys.argv[1]]
import mixqrt.quantize.convert as convert
calls = []
real = convert.quantize_model
def counting(*a, **k):
    calls.append(1)
    time.sleep(1.0)            # hold the lock long enough for the other process to arrive
    return real(*a, **k)
convert.quantize_model = counting
from mixqrt.pipeline import prepare
open(sys.argv[3] + f".ready{os.getpid()}", "w").close()
while len([f for f in os.listdir(os.path.dirname(sys.argv[3])) if ".ready" in f]) < 2:
    time.sleep(0.01)
out = prepare(sys.argv[2], "2356", progress=False)
print("QUANTIZED" if calls else "REUSED", out)
"""


def test_two_processes_quantize_one_cache_entry_once(tmp_path):
    d = make_tiny_hf_model(tmp_path / "hf", dtype="f32")
    cache = tmp_path / "cache"
    env = dict(os.environ, MIXQRT_CACHE=str(cache))
    stamp = tmp_path / "sync" / "s"
    stamp.parent.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _PREPARE, str(PKG_PARENT), str(d), str(stamp)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    words = sorted(o[0].split()[0] for o in outs)
    assert words == ["QUANTIZED", "REUSED"], outs
    assert len({o[0].split()[1] for o in outs}) == 1
    assert [p.name for p in cache.iterdir() if p.suffix == ".mxq"] and \
        not [p for p in cache.iterdir() if p.name.endswith(".tmp")]


# ------------------------------------------------------------------ truncated .mxq
def test_truncated_mxq_fails_at_load(tmp_path, tiny_mxq):
    from mixqrt.io.mxq import MxqFile
    data = tiny_mxq.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 4096, 100, 63):
        p = tmp_path / f"cut{cut}.mxq"
        p.write_bytes(data[:cut])
        with pytest.raises(FormatError, match="truncated|too small|bytes"):
            MxqFile(p)


def test_mxq_prefix_lies_about_size(tmp_path, tiny_mxq):
    """A file cut and its prefix patched to agree still fails: the header must end at EOF (its CRC
    covers it) and every span lies inside the data region."""
    from mixqrt.io.mxq import PREFIX, MxqFile
    data = bytearray(tiny_mxq.read_bytes())
    magic, ver, hoff, hlen, fsize, crc = PREFIX.unpack_from(data, 0)
    cut = bytearray(data[:hoff - 4096] + data[hoff:])
    PREFIX.pack_into(cut, 0, magic, ver, hoff - 4096, hlen, len(cut), crc)
    p = tmp_path / "lie.mxq"
    p.write_bytes(bytes(cut))
    with pytest.raises(FormatError):
        MxqFile(p)
    struct, zlib  # noqa: B018


def test_typed_errors_are_value_errors():
    assert issubclass(FormatError, MixqrtError) and issubclass(ModelError, ValueError)
    write_safetensors  # noqa: B018


_TRUNCATE_UNDER_MAP = r"""
import os, sys
sys.path[:0] = [sys.argv[1]]
from mixqrt.io.mxq import MxqFile
f = MxqFile(sys.argv[2])
last = max(f.info.values(), key=lambda t: t.offset)
os.truncate(sys.argv[2], 4096)              # another process cuts the file under the live map
print(int(f.tensors[last.name].raw.sum()))  # touching a vanished page: SIGBUS
"""


def test_truncation_under_a_live_map_is_sigbus_and_atomic_replace_is_not(tmp_path, tiny_mxq):
    """Documented limit (docs/mxq-file.md): cutting a mapped file kills the reader with SIGBUS. mixqrt's
    own writers never do that: they replace by rename, and a map of the old file stays valid."""
    import shutil
    import signal

    from mixqrt.io.mxq import MxqFile
    from mixqrt.pipeline import Pipeline
    victim = tmp_path / "v.mxq"
    shutil.copyfile(tiny_mxq, victim)
    r = subprocess.run([sys.executable, "-c", _TRUNCATE_UNDER_MAP, str(PKG_PARENT), str(victim)],
                       capture_output=True, timeout=120)
    assert r.returncode == -signal.SIGBUS
    live = tmp_path / "live.mxq"
    shutil.copyfile(tiny_mxq, live)
    f = MxqFile(live)
    before = {n: int(t.raw.sum()) for n, t in f.tensors.items()}
    pipe = Pipeline.__new__(Pipeline)
    pipe.path = tiny_mxq
    small = tmp_path / "small.mxq"
    small.write_bytes(b"")
    pipe.path = small                            # save() replaces `live` with a 0-byte file by rename
    pipe.save(live)
    assert live.stat().st_size == 0
    assert {n: int(t.raw.sum()) for n, t in f.tensors.items()} == before
    f.close()


# ------------------------------------------------------------------ typed errors, not Python's own
@pytest.mark.parametrize("template", [[{"name": "default"}], [{"template": "x"}], ["x"], [{"name": 1, "template": "x"}]])
def test_chat_template_list_entries_are_checked(tmp_path, template):
    from mixqrt.generation.tokenizer import Tokenizer
    d = make_tiny_hf_model(tmp_path / "hf", dtype="f32")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    with pytest.raises(FormatError, match=r"chat_template\[0\]"):
        Tokenizer.from_folder(d)


def test_attention_with_no_kv_heads_is_a_kernel_error():
    from mixqrt import ops
    from mixqrt.errors import KernelError
    q = np.zeros((1, 2, 16), np.float32)
    k = np.zeros((0, 4, 16), np.float32)
    with pytest.raises(KernelError):
        ops.attention(q, k, k, 0)
    with pytest.raises(KernelError):            # was a SIGFPE (integer division by zero in C)
        ops.attention_batch(q, [k], [k], [0])


@pytest.mark.parametrize("levels", [[0, 12, 20], [0, 12, 20, 28, 35, 43, 51, 300], [-1] * 8, [0.5] * 8,
                                    [[1], [2, 3]], "abcdefgh"])
def test_bad_q3p_table_is_a_quant_error(levels):
    from mixqrt.errors import QuantError
    from mixqrt.formats import codec as formats
    from mixqrt.formats.qtensor import QTensor
    qt = formats.quantize(np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32), "q3p")
    bad = QTensor(qt.fmt, qt.shape, qt.raw, {**(qt.meta or {}), "q3p_levels": levels})
    for impl in ("ref", "fast"):
        with pytest.raises(QuantError, match="q3p level table"):
            formats.dequantize(bad, impl=impl)


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json", "config.json",
                                  "generation_config.json", "model.safetensors.index.json"])
def test_every_folder_file_is_confined_to_the_folder(tmp_path, name):
    """Each file mixqrt reads from a model folder, moved outside it and linked back: refused with a
    FormatError naming it, its text never read (it would end up in the saved .mxq)."""
    from mixqrt.quantize.convert import quantize_model
    d = make_tiny_hf_model(tmp_path / "m", dtype="f32", sharded=name.endswith("index.json"))
    outside = tmp_path / "outside"
    outside.mkdir()
    if name == "chat_template.jinja":                  # read when tokenizer_config.json has no template
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        (d / name).write_text(cfg.pop("chat_template") + "{# TOPSECRET #}")
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    if name == "generation_config.json" and not (d / name).exists():
        (d / name).write_text('{"temperature": 0.5}')
    os.replace(d / name, outside / name)
    (d / name).symlink_to(outside / name)
    with pytest.raises(FormatError, match=name.replace(".", r"\.") + ".*outside the model folder"):
        quantize_model(d, "2356", tmp_path / "out.mxq", progress=False)
    assert not (tmp_path / "out.mxq").exists()
    os.unlink(d / name)                                 # a plain copy inside the folder is fine
    os.replace(outside / name, d / name)
    quantize_model(d, "2356", tmp_path / "out.mxq", progress=False)


# ------------------------------------------------------------------ killed quantizations leave nothing behind
def _slow_model(d, layers=24) -> Path:
    """The tiny model with `layers` copies of its first layer: a quantize of a second or two."""
    import tinymodel as tm
    d = make_tiny_hf_model(d, dtype="f32")
    cfg = json.loads((d / "config.json").read_text())
    w = tm.tiny_weights("qwen2")
    for i in range(tm.LAYERS, layers):
        w.update({k.replace("layers.0.", f"layers.{i}."): v for k, v in w.items() if k.startswith("model.layers.0.")})
    cfg["num_hidden_layers"] = layers
    (d / "config.json").write_text(json.dumps(cfg))
    write_safetensors(d / "model.safetensors", w, "F32")
    return d


_MAIN = "import sys; sys.path[:0] = [sys.argv[1]]; from mixqrt.cli import main; sys.exit(main(sys.argv[2:]))"


def _temps(folder):
    return sorted(p for p in folder.iterdir() if p.name.endswith(".tmp")) if folder.exists() else []


def _start(args, env):
    return subprocess.Popen([sys.executable, "-c", _MAIN, str(PKG_PARENT), *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("where", ["quantize -o", "serve cache"])
def test_a_killed_quantize_leaves_no_temp_after_the_next_run(tmp_path, sig, where):
    import signal
    src = _slow_model(tmp_path / "src")
    env = dict(os.environ, MIXQRT_CACHE=str(tmp_path / "cache"))
    if where == "quantize -o":
        folder = tmp_path / "out"
        folder.mkdir()
        args = ["quantize", str(src), "--recipe", "2356", "-o", str(folder / "m.mxq"), "-q"]
    else:
        folder = tmp_path / "cache"
        args = ["serve", str(src), "--recipe", "2356", "--port", "0", "-q"]
    p = _start(args, env)
    try:
        deadline = time.monotonic() + 120
        while not [t for t in _temps(folder) if t.stat().st_size] and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert _temps(folder), f"no temp file seen; exit {p.poll()}"
        p.send_signal(getattr(signal, sig))
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    if sig == "SIGTERM":                               # unwinds like Ctrl-C: the writer removed its temp
        assert p.returncode == 143, err.decode()[-2000:]
        assert _temps(folder) == []
    else:
        assert p.returncode == -signal.SIGKILL and len(_temps(folder)) == 1
    p = _start(args, env)                              # the same command again
    try:
        deadline = time.monotonic() + 120
        while not [f for f in folder.iterdir() if f.suffix == ".mxq"] and p.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        if where == "serve cache":
            p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode in (0, 143), err.decode()[-2000:]
    assert [f for f in folder.iterdir() if f.suffix == ".mxq"] and _temps(folder) == []
