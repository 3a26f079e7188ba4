"""generate_step / stream_generate / generate: stop strings, eos, length, context limits, defaults."""
import numpy as np
import pytest

from mixqrt.errors import GenerationError
from mixqrt.generation.generate import generate, generate_step, resolve_sampling, stream_generate
from mixqrt.models import build_model
from mixqrt.models.qwen2 import ModelArgs
from mixqrt.generation.sampling import make_sampler

from test_model import tiny_config, tiny_weights

# token id -> bytes; "é" is split over two tokens (ids 7, 8) so UTF-8 has to be reassembled
VOCAB = [b"<eos>", b"a", b"b", b"c", b" ", b"EN", b"D!", b"\xc3", b"\xa9", b"\n", b"x", b"#"]


class FakeTokenizer:
    eos_token_ids = {0}

    def encode(self, text):
        return [VOCAB.index(ch.encode()) for ch in text]

    def decode(self, ids):
        return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


class ScriptModel:
    """Emits a fixed token script (one-hot logits), whatever the input; counts what it was fed."""

    def __init__(self, script, ctx=64, generation_config=None):
        self.args = ModelArgs.from_dict({"hidden_size": 8, "num_hidden_layers": 1, "intermediate_size": 8,
                                         "num_attention_heads": 2, "vocab_size": len(VOCAB),
                                         "max_position_embeddings": ctx})
        self.script = list(script)
        self.generation_config = generation_config or {}
        self.fed = []

    def make_cache(self, max_len=None):
        class C:
            offset = 0
        c = C()
        c.max_len = max_len
        self.start = None
        return c

    def __call__(self, tokens, cache, pos0=None, *, last_only=False, chunk_size=512):
        assert last_only
        if self.start is None:
            self.start = len(tokens)
        cache.offset += len(tokens)
        assert cache.offset <= cache.max_len
        self.fed.extend(int(t) for t in tokens)
        logits = np.full(len(VOCAB), -10.0, dtype=np.float32)
        logits[self.script[cache.offset - self.start]] = 10.0
        return logits


def ids_of(s):
    return FakeTokenizer().encode(s)


def run(script, prompt="ab", **kw):
    kw.setdefault("max_new_tokens", 20)
    return list(stream_generate(ScriptModel(script), FakeTokenizer(), prompt, **kw))


def test_length_and_text():
    rs = run(ids_of("abcabc"), max_new_tokens=4)
    assert "".join(r.text for r in rs) == "abca"
    assert [r.finish_reason for r in rs] == [None, None, None, "length"]
    last = rs[-1]
    assert last.prompt_tokens == 2 and last.generation_tokens == 4
    assert last.ttft_s > 0 and last.prompt_tps > 0 and last.peak_rss_bytes > 1 << 20


def test_eos_stops_and_is_not_emitted():
    rs = run(ids_of("ab") + [0] + ids_of("cc"))
    assert "".join(r.text for r in rs) == "ab"
    assert rs[-1].finish_reason == "stop" and rs[-1].token == 0 and rs[-1].generation_tokens == 3
    # explicit eos ids replace the defaults
    rs = run(ids_of("ab") + [0] + ids_of("c"), eos_token_ids=[2], max_new_tokens=5)
    assert "".join(r.text for r in rs) == "a" and rs[-1].finish_reason == "stop"


def test_utf8_split_across_tokens():
    rs = run([1, 7, 8, 2], max_new_tokens=4)
    assert [r.text for r in rs] == ["a", "", "é", "b"]


@pytest.mark.parametrize("stop", ["END!", ["zzz", "END!"], "D!"])
def test_stop_string_split_across_tokens_never_leaks(stop):
    rs = run(ids_of("ab") + [5, 6] + ids_of("cc"), stop=stop)
    pieces = [r.text for r in rs]
    assert "".join(pieces) == "ab" + ("EN" if stop == "D!" else "")
    assert rs[-1].finish_reason == "stop"
    assert not any("EN" in p for p in pieces) or stop == "D!"


def test_stop_prefix_that_does_not_match_is_released():
    # "EN" could start "END!" -> held back; then "a" disambiguates and it is released
    rs = run(ids_of("a") + [5] + ids_of("ab"), stop="END!", max_new_tokens=4)
    assert [r.text for r in rs] == ["a", "", "ENa", "b"] and rs[-1].finish_reason == "length"
    # held text at the length limit is flushed
    rs = run(ids_of("a") + [5], stop="END!", max_new_tokens=2)
    assert "".join(r.text for r in rs) == "aEN" and rs[-1].finish_reason == "length"
    # multi-token stop string inside one token stream: "c\n#"
    rs = run(ids_of("abc") + [9, 11] + ids_of("a"), stop="\n#")
    assert "".join(r.text for r in rs) == "abc"


def test_generate_returns_string_and_accepts_ids():
    assert generate(ScriptModel(ids_of("cab") + [0]), FakeTokenizer(), [1, 2], max_new_tokens=10) == "cab"


def test_context_overflow_and_context_end():
    with pytest.raises(GenerationError, match=r"prompt has 4 tokens.*5 positions.*holds 4"):
        run(ids_of("abc"), prompt="abca", max_context=4)
    # room for 2 new tokens only: finishes with "length" at the context end, never truncates the prompt
    rs = run(ids_of("abcabc"), prompt="abca", max_context=6, max_new_tokens=10)
    assert len(rs) == 2 and rs[-1].finish_reason == "length"
    m = ScriptModel(ids_of("abc"), ctx=3)
    with pytest.raises(GenerationError, match="context"):
        list(stream_generate(m, FakeTokenizer(), "abc", max_new_tokens=1))


@pytest.mark.parametrize("prompt,kw,msg", [
    (3, {}, "prompt must be"), (None, {}, "prompt must be"), ([1, "a"], {}, "token ids"), ("", {}, "empty"),
    ([1, 99], {}, r"\[0, 12\)"), ("ab", {"max_new_tokens": 0}, "max_new_tokens"),
    ("ab", {"temperature": -1.0}, "temperature"), ("ab", {"top_p": 0.0}, "top_p"),
    ("ab", {"stop": ["a", ""]}, "non-empty"), ("ab", {"stop": 5}, "stop"),
    ("ab", {"repetition_penalty": -1.0}, "repetition_penalty"), ("ab", {"eos_token_ids": "x"}, "eos_token_ids")])
def test_bad_arguments(prompt, kw, msg):
    with pytest.raises(GenerationError, match=msg):
        run(ids_of("ab"), prompt=prompt, **kw)


def test_defaults_from_generation_config():
    m = ScriptModel([1], generation_config={"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                            "repetition_penalty": 1.05, "eos_token_id": [3, 4]})
    s = resolve_sampling(m)
    assert s == {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "min_p": 0.0, "repetition_penalty": 1.05}
    assert resolve_sampling(m, temperature=0.0, top_k=0)["top_k"] == 0
    assert resolve_sampling(ScriptModel([1], generation_config={"temperature": 0.7}))["temperature"] == 0.0
    # do_sample is resolved here too (the one home of the greedy default)
    plain = ScriptModel([1], generation_config={"temperature": 0.7})
    assert resolve_sampling(plain, do_sample=True)["temperature"] == 0.7
    assert resolve_sampling(plain, temperature=0.0, do_sample=True)["temperature"] == 0.7
    assert resolve_sampling(ScriptModel([1]), do_sample=True)["temperature"] == 1.0
    assert resolve_sampling(m, do_sample=False)["temperature"] == 0.0
    assert resolve_sampling(m, temperature=0.5, do_sample=False)["temperature"] == 0.0
    with pytest.raises(GenerationError, match="do_sample"):
        resolve_sampling(m, do_sample="yes")
    # eos ids from generation_config join the tokenizer's
    m.script = ids_of("ab") + [3] + ids_of("a")
    rs = list(stream_generate(m, FakeTokenizer(), "a", temperature=0.0, max_new_tokens=9))
    assert "".join(r.text for r in rs) == "ab" and rs[-1].finish_reason == "stop"


def test_generate_step_on_real_graph_matches_recompute():
    """Greedy decode with the KV cache picks the argmax of a full recompute at every step."""
    cfg = tiny_config("qwen2", tied=True)
    model = build_model(cfg, tiny_weights(cfg, seed=11))
    prompt = [5, 17, 33, 2, 90]
    toks = [t for t, _ in generate_step(model, prompt, max_tokens=6, prefill_chunk=2)]
    seq = list(prompt)
    for t in toks:
        assert t == int(np.argmax(model.logits(seq)[-1]))
        seq.append(t)
    # seeded sampling is reproducible
    a = [t for t, _ in generate_step(model, prompt, max_tokens=5, sampler=make_sampler(1.0, seed=3))]
    b = [t for t, _ in generate_step(model, prompt, max_tokens=5, sampler=make_sampler(1.0, seed=3))]
    assert a == b


def test_repetition_penalty_changes_greedy_choice():
    class Fixed(ScriptModel):
        def __call__(self, tokens, cache, pos0=None, *, last_only=False, chunk_size=512):
            logits = np.full(len(VOCAB), -10.0, dtype=np.float32)
            logits[1], logits[2] = 2.0, 1.5
            return logits
    assert generate(Fixed([]), FakeTokenizer(), "c", max_new_tokens=3) == "aaa"
    assert generate(Fixed([]), FakeTokenizer(), "c", max_new_tokens=3, repetition_penalty=2.0) == "aba"
    # context window 1: only the last token is penalised
    assert generate(Fixed([]), FakeTokenizer(), "c", max_new_tokens=3, repetition_penalty=2.0,
                    repetition_context_size=1) == "aba"


@pytest.mark.parametrize("arch,tied", [("qwen2", True), ("llama", False)])
def test_tiny_hf_model_end_to_end(tmp_path, arch, tied):
    """io Source -> load_f32 -> stream_generate with the real Tokenizer (its StreamDecoder)."""
    tinymodel = pytest.importorskip("tinymodel")
    from mixqrt.io import open_source
    from mixqrt.models import load_f32
    tinymodel.make_tiny_hf_model(tmp_path, arch=arch, tied=tied, seed=0)
    src = open_source(tmp_path)
    model = load_f32(src)
    rs = list(stream_generate(model, src.tokenizer, "hello", max_new_tokens=6, temperature=0.0,
                             repetition_penalty=1.0, eos_token_ids=[]))
    assert rs[-1].finish_reason == "length" and rs[-1].generation_tokens == 6
    ids = src.tokenizer.encode("hello") + [r.token for r in rs]
    full = model.logits(ids[:-1])
    assert [r.token for r in rs] == [int(t) for t in full[-6:].argmax(-1)]
    assert "".join(r.text for r in rs) == src.tokenizer.decode([r.token for r in rs])
