"""Tokenizer: GGUF-built tokenizers on real models, HF-vs-GGUF agreement on the tiny model,
chat templates, and StreamDecoder never splitting a character."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tinymodel import CHATML, make_tiny_gguf, make_tiny_hf_model
from tokenizers import Tokenizer as HFTok
from tokenizers import decoders, models, pre_tokenizers

from mixqrt.errors import FormatError, GenerationError, ModelError
from mixqrt.io import open_source
from mixqrt.generation.tokenizer import StreamDecoder, Tokenizer

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's fine, isn't it?",
    "code": "def f(x):\n    return {'a': [1, 2, 3]}  # 12345\n\tif x != None: pass\n",
    "chinese": "今天天气很好，我们去公园散步吧。机器学习",
    "emoji": "ok 👍🏽🎉 ❤️‍🔥 👨‍👩‍👧‍👦 🇯🇵",
    "whitespace": "a  b   c\n\n\n    d\t\t e \r\n   ",
}


@pytest.fixture(scope="module")
def qwen_tok(qwen_gguf_path):
    with open_source(qwen_gguf_path) as src:
        return src.tokenizer


@pytest.fixture(scope="module")
def smol_tok(smol_gguf_path):
    with open_source(smol_gguf_path) as src:
        return src.tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m")
    with open_source(d) as src:
        return src.tokenizer


# -- real models -----------------------------------------------------------------------------

@pytest.mark.realmodel
@pytest.mark.parametrize("which", ["qwen_tok", "smol_tok"])
@pytest.mark.parametrize("kind", sorted(TEXTS))
def test_round_trip(request, which, kind):
    tok = request.getfixturevalue(which)
    ids = tok.encode(TEXTS[kind])
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == TEXTS[kind]


@pytest.mark.realmodel
def test_qwen_known_ids_and_specials(qwen_tok):
    assert qwen_tok.encode("Hello world, it's a test.") == [9707, 1879, 11, 432, 594, 264, 1273, 13]
    assert qwen_tok.encode("你好，世界") == [108386, 3837, 99489]
    assert qwen_tok.vocab_size == 151936
    assert qwen_tok.eos_token_ids == {151643, 151645}             # <|endoftext|>, <|im_end|>
    assert qwen_tok.bos_token_id == 151643 and not qwen_tok.add_bos_token
    assert qwen_tok.encode("<|im_start|>user") == [151644, 872]
    assert 151644 not in qwen_tok.encode("<|im_start|>user", parse_special=False)
    assert qwen_tok.encode("<tool_call>") == [151657]               # user-defined: always matched
    assert qwen_tok.decode([151644, 872], skip_special_tokens=True) == "user"


@pytest.mark.realmodel
def test_smol_specials(smol_tok):
    assert smol_tok.eos_token_ids == {0, 2} and smol_tok.bos_token_id == 1
    assert smol_tok.encode("123") == [33, 34, 35]                   # single digits (smollm pre)
    assert smol_tok.encode("hi", add_special_tokens=True) == smol_tok.encode("hi")   # add_bos_token false


@pytest.mark.realmodel
def test_qwen_chatml(qwen_tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 你好"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    assert qwen_tok.apply_chat_template(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 你好<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")
    out = qwen_tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False)
    assert out.startswith("<|im_start|>system\nYou are Qwen") and out.endswith("x<|im_end|>\n")
    tool = {"type": "function", "function": {"name": "météo", "parameters": {"type": "object"}}}
    out = qwen_tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[tool])
    assert '"name": "météo"' in out and "<tools>" in out                  # tojson keeps non-ASCII


@pytest.mark.realmodel
@pytest.mark.parametrize("which", ["qwen_tok", "smol_tok"])
def test_stream_decoder_never_splits_characters(request, which):
    tok = request.getfixturevalue(which)
    text = "日本語 👨‍👩‍👧‍👦 ok 🎉😀 κόσμε"
    ids = tok.encode(text)
    dec = StreamDecoder(tok)
    pieces = [dec.feed(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert any(p == "" for p in pieces[:-1])      # some tokens are partial characters and wait


@pytest.mark.realmodel
def test_meta_round_trip(qwen_tok):
    import json as _json
    meta = _json.loads(_json.dumps(qwen_tok.to_meta()))          # must survive a JSON header
    tok = Tokenizer.from_meta(meta)
    assert tok.eos_token_ids == qwen_tok.eos_token_ids and tok.bos_token_id == qwen_tok.bos_token_id
    assert tok.chat_template == qwen_tok.chat_template
    for text in TEXTS.values():
        assert tok.encode(text) == qwen_tok.encode(text)


# -- tiny model: tokenizer.json vs GGUF metadata ---------------------------------------------

@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_hf_and_gguf_tokenizers_agree(tmp_path, arch):
    d = make_tiny_hf_model(tmp_path / "hf", arch=arch)
    with open_source(d) as hf, open_source(make_tiny_gguf(d, tmp_path / "m.gguf")) as gg:
        for text in list(TEXTS.values()) + ["<|im_start|>user\nhi<|im_end|>"]:
            assert gg.tokenizer.encode(text) == hf.tokenizer.encode(text), text
        assert gg.tokenizer.eos_token_ids == hf.tokenizer.eos_token_ids == {0, 2}
        assert gg.tokenizer.chat_template == hf.tokenizer.chat_template == CHATML


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=40))
def test_tiny_round_trip_and_stream_property(tiny, text):
    ids = tiny.encode(text, parse_special=False)
    assert tiny.decode(ids) == text
    dec = tiny.stream_decoder()
    assert "".join(dec.feed(i) for i in ids) + dec.flush() == text


def test_stream_decoder_invalid_bytes_and_flush(tiny):
    byte_ids = [tiny.token_to_id(c) for c in ("ð", "Ł")]        # bytes 0xF0 0x9F: half an emoji
    dec = tiny.stream_decoder()
    assert [dec.feed(i) for i in byte_ids] == ["", ""]
    assert dec.flush() == "\ufffd"                               # an unfinished char at the very end
    dec = tiny.stream_decoder(skip_special_tokens=True)
    assert dec.feed(tiny.token_to_id("<|im_end|>")) == ""
    assert tiny.stream_decoder().feed(tiny.token_to_id("<|im_end|>")) == "<|im_end|>"


def test_stream_decoder_generic_fallback():
    # a non-byte-level tokenizer (WordLevel + Metaspace) takes the re-decode path
    tk = HFTok(models.WordLevel({"▁hello": 0, "▁world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Metaspace()
    tok = Tokenizer(tk)
    ids = tok.encode("hello world")
    dec = StreamDecoder(tok)
    assert "".join(dec.feed(i) for i in ids) + dec.flush() == "hello world"


# -- templates and bad input -------------------------------------------------------------------

def test_template_errors(tiny):
    bad = Tokenizer(tiny.backend, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(GenerationError, match="roles must alternate"):
        bad.apply_chat_template([{"role": "user", "content": "x"}])
    evil = Tokenizer(tiny.backend, chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ModelError, match="unsafe"):
        evil.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ModelError, match="no chat template"):
        Tokenizer(tiny.backend).apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ModelError, match="does not parse"):
        Tokenizer(tiny.backend, chat_template="{% for %}").apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(GenerationError, match="list of dicts"):
        tiny.apply_chat_template("hello")


def test_template_list_form_and_trim(tmp_path):
    d = make_tiny_hf_model(tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": "{% for m in messages %}\n    {% if m %}[{{ m.content }}]{% endif %}\n{% endfor %}"},
                            {"name": "tool_use", "template": "T{{ tools | length }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_folder(d)
    assert tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "[a][b]"
    assert tok.apply_chat_template([{"role": "user", "content": "a"}], tools=[{"name": "f"}]) == "T1"


def _meta(**over):
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
            "tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b"],
            "tokenizer.ggml.token_type": [1, 1, 1]}
    meta.update(over)
    return meta


def test_gguf_metadata_errors():
    assert Tokenizer.from_gguf_metadata(_meta()).encode("ab") == [2]
    with pytest.raises(ModelError, match="'bert' is not supported"):
        Tokenizer.from_gguf_metadata(_meta(**{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(FormatError, match="scores missing"):        # SentencePiece needs its scores
        Tokenizer.from_gguf_metadata(_meta(**{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(ModelError, match="pre-tokenizer 'klingon'"):
        Tokenizer.from_gguf_metadata(_meta(**{"tokenizer.ggml.pre": "klingon"}))
    with pytest.raises(Exception, match="token types"):
        Tokenizer.from_gguf_metadata(_meta(**{"tokenizer.ggml.token_type": [1]}))
    with pytest.raises(Exception, match="merge 'ab'"):
        Tokenizer.from_gguf_metadata(_meta(**{"tokenizer.ggml.merges": ["ab"]}))
    with pytest.raises(Exception, match="tokens / tokenizer.ggml.merges missing"):
        Tokenizer.from_gguf_metadata(_meta(**{"tokenizer.ggml.tokens": []}))


def test_encode_wants_str(tiny):
    with pytest.raises(TypeError):
        tiny.encode(b"bytes")


@pytest.mark.realmodel
def test_plain_and_special_encodes_from_many_threads(qwen_tok):
    """parse_special=False is a switch of the one backend (no second tokenizer is built): encodes of
    both kinds from several threads at once each get their own answer, and the switch is left off."""
    from concurrent.futures import ThreadPoolExecutor
    text = "<|im_start|>user\nwrite quicksort<|im_end|>"
    special, plain = qwen_tok.encode(text), qwen_tok.encode(text, parse_special=False)
    assert 151644 in special and 151644 not in plain
    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda i: (i % 2, qwen_tok.encode(text, parse_special=bool(i % 2))), range(400)))
    assert all(ids == (special if sp else plain) for sp, ids in got)
    assert qwen_tok.backend.encode_special_tokens is False
