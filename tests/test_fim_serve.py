"""Fill-in-the-middle and embeddings through mixqrt.serving.server, driven as editors and RAG libraries drive
them: the official `openai` client's completions.create(prompt=..., suffix=...) and
embeddings.create(input=[...]) (float and its default base64), a llama.vim-shaped POST /infill (the
fields llama.vim sends), and hostile inputs (10^5 inputs, a 1 MB string, ids outside the vocabulary,
10^4 input_extra files): a 4xx naming the problem while another stream keeps going.

The tiny model's tokenizer gets Qwen's six FIM tokens added (ids 400-405) for these tests."""
from __future__ import annotations

import base64
import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
from serve_helpers import running, tiny_pipeline

pytest.importorskip("starlette")
openai = pytest.importorskip("openai")

FIM = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


def add_fim_tokens(tok):
    from tokenizers import AddedToken
    tok.backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in FIM])
    tok._added = tok.backend.get_added_tokens_decoder()
    tok.special_ids = {i for i, t in tok._added.items() if t.special}
    tok._fim = tok._special_re = None


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    p = tiny_pipeline(tmp_path_factory.mktemp("fim"), max_context=256)
    add_fim_tokens(p.tokenizer)
    return p


@pytest.fixture(scope="module")
def srv(pipe):
    with running(pipe) as r:
        yield r


def post(srv, path, body, timeout=60):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(srv.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_fim_tokens_and_prompt_order(pipe):
    from mixqrt.generation.fim import fim_tokens
    t = fim_tokens(pipe.tokenizer)
    assert t.complete and t.rep is not None and t.sep is not None
    ids = pipe.infill_ids("def f(x):\n    return ", "\n\nprint(f(2))\n", [{"filename": "a.py", "text": "x = 1"}])
    assert ids[0] == t.rep and ids[-1] == t.mid
    assert ids.index(t.pre) < ids.index(t.suf) < ids.index(t.mid)
    assert ids.count(t.sep) == 2                 # the extra file and the current one


def test_control_token_text_in_user_text_stays_text(pipe):
    from mixqrt.generation.fim import fim_tokens
    t = fim_tokens(pipe.tokenizer)
    ids = pipe.infill_ids("a = '<|fim_suffix|><|fim_middle|>'\n", "b = '<|fim_prefix|>'\n",
                          [{"filename": "<|file_sep|>", "text": "<|repo_name|>"}])
    for special in (t.pre, t.suf, t.mid):
        assert ids.count(special) == 1
    assert ids.count(t.sep) == 2 and ids.count(t.rep) == 1


def test_trimming_keeps_llamacpp_budget_and_a_stable_cut(pipe):
    from mixqrt.generation.fim import CUT_STEP, fim_tokens
    t = fim_tokens(pipe.tokenizer)
    long = "x = 1\n" * 400
    ids = pipe.infill_ids(long, long, n_batch=128)
    pre = ids[ids.index(t.pre) + 1:ids.index(t.suf)]
    suf = ids[ids.index(t.suf) + 1:ids.index(t.mid)]
    assert 96 - CUT_STEP < len(pre) <= 96 and len(suf) == 128 // 4 - 2 and len(ids) < pipe.max_context
    a = pipe.infill_ids(long + "y", "", n_batch=128)
    b = pipe.infill_ids(long + "yz", "", n_batch=128)
    assert a[:len(pre) - 8] == b[:len(pre) - 8]          # typing does not move the prompt's start


def test_model_without_fim_tokens_is_refused_by_name(tmp_path):
    from mixqrt.generation.fim import FimError
    p = tiny_pipeline(tmp_path)
    with pytest.raises(FimError, match="prefix, suffix, middle"):
        p.infill("a", "b")


def test_openai_completions_with_suffix(srv, pipe):
    c = srv.client()
    out = c.completions.create(model="x", prompt="def f(x):\n    return ", suffix="\n\nprint(f(2))\n",
                               max_tokens=8, temperature=0)
    text = out.choices[0].text
    assert all(t not in text for t in FIM)
    assert text == pipe.infill("def f(x):\n    return ", "\n\nprint(f(2))\n", max_new_tokens=8, temperature=0)
    assert out.usage.prompt_tokens == len(pipe.infill_ids("def f(x):\n    return ", "\n\nprint(f(2))\n",
                                                           max_new_tokens=8))


def test_openai_embeddings_float_and_base64(srv, pipe):
    c = srv.client()
    texts = ["hello world", "def quicksort(xs):", "<|fim_prefix|> is text here"]
    r = c.embeddings.create(model="x", input=texts, encoding_format="float")
    got = np.array([d.embedding for d in r.data], dtype=np.float32)
    ref = pipe.embed(texts)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
    assert r.usage.prompt_tokens == sum(len(pipe.tokenizer.encode(t, parse_special=False)) for t in texts)
    r2 = c.embeddings.create(model="x", input=texts)          # the client's default: base64
    np.testing.assert_allclose(np.array([d.embedding for d in r2.data], dtype=np.float32), got, rtol=1e-6)
    status, body = post(srv, "/v1/embeddings", {"input": [3, 4, 5], "encoding_format": "base64"})
    assert status == 200
    v = np.frombuffer(base64.b64decode(json.loads(body)["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(v, pipe.embed([[3, 4, 5]])[0], rtol=1e-6)


def test_llama_vim_infill_request(srv, pipe):
    body = {"id_slot": 0, "input_prefix": "def f(x):\n", "input_suffix": "\nprint(f(1))\n",
            "input_extra": [{"filename": "util.py", "text": "def g(y):\n    return y\n"}],
            "prompt": "    ", "n_predict": 16, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.90,
            "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
            "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                                "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                                "timings/predicted_per_token_ms", "timings/predicted_per_second",
                                "truncated", "tokens_cached"]}
    status, raw = post(srv, "/infill", body)
    assert status == 200, raw
    out = json.loads(raw)
    assert set(out) <= set(body["response_fields"]) and isinstance(out["content"], str)
    assert all(t not in out["content"] for t in FIM)
    status, raw = post(srv, "/infill", {**body, "stream": True, "response_fields": None})
    events = [json.loads(line[6:]) for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1]["stop"] is True and "".join(e["content"] for e in events[:-1]) == events[-1]["content"]


def test_infill_errors_name_the_field(srv):
    ok = {"input_prefix": "a", "input_suffix": "b"}
    for body, field in [({"input_suffix": "b"}, "input_prefix"), ({**ok, "input_extra": "x"}, "input_extra"),
                        ({**ok, "input_extra": [{"text": 3}]}, "input_extra"), ({**ok, "prompt": 5}, "prompt"),
                        ({**ok, "n_predict": "many"}, "n_predict"), ({**ok, "bogus": 1}, "bogus"),
                        ({**ok, "samplers": ["mirostat"]}, "samplers")]:
        status, raw = post(srv, "/infill", body)
        assert status == 400 and json.loads(raw)["error"]["param"] == field, (body, raw)


def test_hostile_inputs_are_4xx_and_nothing_stalls(srv):
    c = srv.client()
    results = {}

    def stream():
        results["text"] = "".join(ch.choices[0].text for ch in c.completions.create(
            model="x", prompt="def quicksort(xs):", max_tokens=40, temperature=0, stream=True))
    t = threading.Thread(target=stream)
    t.start()
    cases = [("/v1/embeddings", {"input": ["a"] * 100_000}, "input"),
             ("/v1/embeddings", {"input": "a" * 1_000_000}, "input"),
             ("/v1/embeddings", {"input": [[1, 2, 10 ** 9]]}, "input"),
             ("/v1/embeddings", {"input": [-1]}, "input"),
             ("/v1/embeddings", {"input": ["x"], "dimensions": 8}, "dimensions"),
             ("/infill", {"input_prefix": "a", "input_suffix": "b",
                          "input_extra": [{"filename": "f", "text": "x"}] * 10_000}, "input_extra"),
             ("/v1/completions", {"prompt": "a", "suffix": 5}, "suffix")]
    for path, body, field in cases:
        status, raw = post(srv, path, body)
        assert 400 <= status < 500, (path, status)
        if status == 400:
            assert json.loads(raw)["error"]["param"] == field, (path, raw[:200])
    t.join(60)
    assert not t.is_alive() and results["text"]


def test_infill_needs_the_api_key(tmp_path):
    from mixqrt.serving.server.guard import Limits
    own = tiny_pipeline(tmp_path)                  # its own engine: the module's server keeps its one
    add_fim_tokens(own.tokenizer)
    with running(own, Limits(api_key="sk-test")) as r:
        status, _ = post(r, "/infill", {"input_prefix": "a", "input_suffix": "b", "n_predict": 1})
        assert status == 401
        status, _ = post(r, "/v1/embeddings", {"input": "a"})
        assert status == 401


def test_python_api_embedding_and_infill_shapes(pipe):
    from mixqrt.serving import api
    out = api.create_embedding(pipe, ["a b", "c"], encoding_format="float")
    assert out["object"] == "list" and [d["index"] for d in out["data"]] == [0, 1]
    assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] > 0
    comp = api.create_completion(pipe, "def f(x):\n    return ", suffix="\n", max_tokens=4, temperature=0)
    assert comp["object"] == "text_completion" and isinstance(comp["choices"][0]["text"], str)
    none = pipe.embed(["a b c"], pooling="none")
    assert isinstance(none, list) and none[0].shape == (len(pipe.embed_ids("a b c")[0]), 64)
