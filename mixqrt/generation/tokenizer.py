"""Tokenizer: a `tokenizers.Tokenizer` plus what generation needs (eos set, chat template, streaming).

Two ways in:
  * Tokenizer.from_folder(dir)          tokenizer.json (+ tokenizer_config.json, generation_config.json)
  * Tokenizer.from_gguf_metadata(meta)  rebuilt from tokenizer.ggml.* — byte-level BPE from the
    token list and merges, with the pre-tokenizer regex llama.cpp uses for tokenizer.ggml.pre, so
    that ids agree with llama.cpp (benchmarks/check_tokenizer.py measures it; docs/tokenizer.md).

encode() parses special tokens written in the text by default, because a rendered chat template
contains them ("<|im_start|>"); parse_special=False treats them as plain text (llama.cpp's
special=false), which is what untrusted user text should get. encode_chat() does both: the chat
template's own text with special tokens, message text without, so a user cannot forge a turn.
"""
from __future__ import annotations

import codecs
import contextlib
import json
import logging
import re
import threading
from pathlib import Path

import numpy as np

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from mixqrt.errors import FormatError, GenerationError, ModelError
from mixqrt.models.config_limits import check_values

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp), keyed by tokenizer.ggml.pre
_QWEN2_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_FAMILIES = {
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2",
    "llama-bpe": "llama3", "llama3": "llama3", "llama-v3": "llama3", "falcon3": "llama3",
    "smollm": "digits+gpt2", "starcoder": "digits+gpt2", "refact": "digits+gpt2", "codeshell": "digits+gpt2",
    "gpt-2": "gpt2", "gpt2": "gpt2", "default": "gpt2",
}
# text of control tokens that end a turn; llama.cpp adds these to its end-of-generation set too
_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
              "<EOT>", "_<EOT>", "<|end_of_text|>", "<｜end▁of▁sentence｜>"}
_CONTROL, _USER_DEFINED = 3, 4


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by every byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}


def _pre_tokenizer(pre: str, where: str):
    family = _PRE_FAMILIES.get(pre)
    if family is None:
        raise ModelError(f"{where}: GGUF pre-tokenizer {pre!r} is not supported "
                         f"(supported: {', '.join(sorted(_PRE_FAMILIES))})")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    if family in ("qwen2", "llama3"):
        regex = _QWEN2_RE if family == "qwen2" else _LLAMA3_RE
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                                        byte_level])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if family == "digits+gpt2":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    return gpt2


def _is_panic(e: BaseException) -> bool:
    # pyo3 turns a Rust panic into pyo3_runtime.PanicException, a BaseException that no
    # `except Exception` catches; its class cannot be imported, so it is recognised by name
    return type(e).__name__ == "PanicException" and type(e).__module__ == "pyo3_runtime"


@contextlib.contextmanager
def _no_panic(what: str, err=ModelError):
    """Turn a panic inside the tokenizers library into `err` (a typed, catchable mixqrt error)."""
    try:
        yield
    except BaseException as e:
        if _is_panic(e):
            raise err(f"tokenizer failed while {what} (the tokenizers library panicked: "
                      f"{str(e)[:200]})") from None
        raise


def vocab_id(name: str, v, n: int, strict: bool = True):
    """A token id from a config: None, or an int in [0, n); else ModelError naming the field
    (strict) or None and a warning (an unusable pad id is not worth refusing a model for)."""
    if v is None:
        return None
    if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) and 0 <= v < n:
        return int(v)
    msg = f"{name} {str(v)[:40]!r} is not a token id of this vocabulary (0..{n - 1})"
    if strict:
        raise ModelError(msg)
    log.warning("%s; ignored", msg)
    return None


def _probe_templates(template, tok) -> None:
    """A warning at load when the model's chat template fails on a small conversation (it would
    fail, as a 400, on every chat request)."""
    from mixqrt.generation.chat_template import probe
    templates = template.items() if isinstance(template, dict) else [("", template)]
    for name, source in templates:
        if not isinstance(source, str):
            continue
        ctx = {"bos_token": "", "eos_token": ""}
        err = probe(source, **ctx)
        if err is not None:
            log.warning("the model's chat template%s fails on a probe conversation: %s", f" {name!r}" if name else "",
                        str(err)[:300])


def _scalar(meta, key, default=None):
    v = meta.get(key, default)
    return v.item() if hasattr(v, "item") else v


def _token_id(meta, key, where, n_tokens=None):
    """An integer token id from GGUF metadata (None when absent); FormatError naming the key."""
    v = meta.get(key)
    if v is None:
        return None
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0 or \
            (n_tokens is not None and v >= n_tokens):
        raise FormatError(f"{where}: {key} must be a token id in [0, {n_tokens or 'vocab'}), got {str(v)[:40]!r}")
    return int(v)


def _gguf_tokens(meta, where):
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None and (not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens)):
        raise FormatError(f"{where}: tokenizer.ggml.tokens must be an array of strings")
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None:
        try:
            arr = np.asarray(types) if isinstance(types, (list, np.ndarray)) else None
        except (ValueError, TypeError, OverflowError):             # ragged or mixed: not an array of ints
            arr = None
        if arr is None or arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise FormatError(f"{where}: tokenizer.ggml.token_type must be an array of integers")
        types = arr.astype(np.int64)
        if tokens is not None and len(types) != len(tokens):
            raise FormatError(f"{where}: {len(types)} token types for {len(tokens)} tokens")
    return tokens, types


# FIM token ids in GGUF metadata (mixqrt.generation.fim's roles): the current keys, then the older
# prefix/suffix/middle ones llama.cpp still reads
_FIM_GGUF_KEYS = {r: (f"tokenizer.ggml.fim_{r}_token_id",) for r in ("pre", "suf", "mid", "pad", "rep", "sep")}
_FIM_GGUF_KEYS["pre"] += ("tokenizer.ggml.prefix_token_id",)
_FIM_GGUF_KEYS["suf"] += ("tokenizer.ggml.suffix_token_id",)
_FIM_GGUF_KEYS["mid"] += ("tokenizer.ggml.middle_token_id",)


def fim_from_gguf(meta: dict, n_tokens: int | None = None, where: str = "GGUF") -> dict:
    """{role: id} of the FIM tokens GGUF metadata names (the keys llama.cpp reads); FormatError for a bad id."""
    out = {}
    for role, keys in _FIM_GGUF_KEYS.items():
        for key in keys:
            v = _token_id(meta, key, where, n_tokens)
            if v is not None:
                out[role] = v
                break
    return out


def eos_ids_from_gguf(meta: dict, where: str = "GGUF") -> set[int]:
    """eos/eot/eom ids from the metadata plus control tokens whose text ends a turn (as llama.cpp)."""
    tokens, types = _gguf_tokens(meta, where)
    ids = {_token_id(meta, f"tokenizer.ggml.{k}_token_id", where) for k in ("eos", "eot", "eom")} - {None}
    if tokens is not None and types is not None:
        for i in np.flatnonzero(np.isin(types, (_CONTROL, _USER_DEFINED))):
            if tokens[i] in _EOG_TEXTS:
                ids.add(int(i))
    return ids


log = logging.getLogger("mixqrt")


def with_bos(tokenizer, ids: list) -> list[int]:
    """The BOS rule, the only copy: `ids` with the tokenizer's BOS in front when it asks for one
    (add_bos_token) and the ids do not start with it already. Any object with bos_token_id and
    add_bos_token works (a tokenizer of a test)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = [int(t) for t in ids]
    if getattr(tokenizer, "add_bos_token", False) and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, int(bos))
    return ids


class Tokenizer:
    """Encode/decode, special ids, chat template and streaming for one model."""

    def __init__(self, backend: _HFTokenizer, *, bos_token_id=None, eos_token_ids=(), pad_token_id=None,
                 chat_template=None, add_bos_token=False, fim_ids=None):
        self.backend = backend
        n = backend.get_vocab_size(with_added_tokens=True)
        # every id a config names must be a token of this vocabulary (bos_token_id -1 was an
        # OverflowError deep in encoding; issue 39): checked here, where all loaders meet
        self.bos_token_id = vocab_id("bos_token_id", bos_token_id, n)
        if isinstance(eos_token_ids, (int, np.integer)):
            eos_token_ids = (eos_token_ids,)
        if not isinstance(eos_token_ids, (list, tuple, set, frozenset)):
            raise ModelError(f"eos_token_ids must be a list of token ids, got {type(eos_token_ids).__name__}")
        self.eos_token_ids = {vocab_id("eos_token_id", i, n) for i in eos_token_ids} - {None}
        self.pad_token_id = vocab_id("pad_token_id", pad_token_id, n, strict=False)
        # FIM token ids a GGUF names (tokenizer.ggml.fim_*_token_id; mixqrt.generation.fim finds the rest by text)
        fim = {str(k): vocab_id(f"fim {k} token id", v, n, strict=False) for k, v in dict(fim_ids or {}).items()}
        self.fim_ids = {k: v for k, v in fim.items() if v is not None}
        self._fim = None
        self.chat_template = chat_template          # str, or {name: str} when a model ships several
        self.add_bos_token = bool(add_bos_token)
        _probe_templates(chat_template, self)
        self._added = backend.get_added_tokens_decoder()
        self.special_ids = {i for i, t in self._added.items() if t.special}
        self._encode_lock = threading.Lock()        # encode_special_tokens is a setting of the shared backend
        self._special_re = None
        self._id_bytes = None

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict, where: str = "GGUF") -> "Tokenizer":
        kind = meta.get("tokenizer.ggml.model")
        if kind == "llama":
            return cls._from_gguf_spm(meta, where)
        if kind != "gpt2":
            raise ModelError(f"{where}: tokenizer model {str(kind)[:40]!r} is not supported (byte-level BPE "
                             f"'gpt2' and SentencePiece 'llama')")
        tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges")
        if tokens is None or merges is None or (isinstance(tokens, list) and not tokens):
            raise FormatError(f"{where}: tokenizer.ggml.tokens / tokenizer.ggml.merges missing")
        tokens, types = _gguf_tokens(meta, where)
        if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
            raise FormatError(f"{where}: tokenizer.ggml.merges must be an array of strings")
        vocab = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)                  # a duplicate keeps its first id, like llama.cpp
        pairs = []
        for m in merges:
            a, sep, b = m.partition(" ")
            if not sep:
                raise FormatError(f"{where}: merge {m!r} is not 'left right'")
            pairs.append((a, b))
        pre = meta.get("tokenizer.ggml.pre", "default")
        if not isinstance(pre, str):
            raise FormatError(f"{where}: tokenizer.ggml.pre must be a string")
        with _no_panic("building the GGUF vocabulary", FormatError):
            try:
                bpe = models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False,
                                 ignore_merges=_PRE_FAMILIES.get(pre) == "llama3")
            except Exception as e:                  # tokenizers reports e.g. a merge of unknown tokens
                raise FormatError(f"{where}: tokenizer vocabulary is inconsistent: {str(e)[:200]}") from None
            tk = _HFTokenizer(bpe)
            tk.pre_tokenizer = _pre_tokenizer(pre, where)
            tk.decoder = decoders.ByteLevel()
        return cls._from_gguf_backend(tk, meta, tokens, types, where)

    @classmethod
    def _from_gguf_spm(cls, meta: dict, where: str) -> "Tokenizer":
        """SentencePiece vocabularies (tokenizer.ggml.model "llama": Gemma, Llama 2) as llama.cpp's SPM
        tokenizer runs them: repeatedly join the adjacent pair whose join is a token with the highest
        score, which is BPE with merges ranked by the joined token's score (as transformers'
        SentencePieceExtractor builds them), unknown bytes as <0xNN> tokens, spaces as U+2581 and a
        leading one only when tokenizer.ggml.add_space_prefix says so."""
        tokens, types = _gguf_tokens(meta, where)
        scores = meta.get("tokenizer.ggml.scores")
        if not tokens or scores is None:
            raise FormatError(f"{where}: tokenizer.ggml.tokens / tokenizer.ggml.scores missing")
        scores = np.asarray(scores)
        if scores.ndim != 1 or scores.size != len(tokens) or scores.dtype.kind not in "fiu":
            raise FormatError(f"{where}: tokenizer.ggml.scores must hold one number per token")
        vocab = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
        plain = np.ones(len(tokens), bool) if types is None else np.isin(types, (1, 6))   # NORMAL, BYTE
        merges = []
        for t, i in vocab.items():
            if not plain[i] or len(t) < 2:
                continue
            local = [(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab]
            local.sort(key=lambda ab: (vocab[ab[0]], vocab[ab[1]]))
            merges.extend((-float(scores[i]), i, ab) for ab in local)
        merges.sort(key=lambda m: (m[0], m[1]))
        unk = _token_id(meta, "tokenizer.ggml.unknown_token_id", where, len(tokens))
        prefix = bool(_scalar(meta, "tokenizer.ggml.add_space_prefix", True))
        with _no_panic("building the GGUF vocabulary", FormatError):
            try:
                bpe = models.BPE(vocab, [m[2] for m in merges], unk_token=None if unk is None else tokens[unk],
                                 fuse_unk=True, byte_fallback=True)
            except Exception as e:
                raise FormatError(f"{where}: tokenizer vocabulary is inconsistent: {str(e)[:200]}") from None
            tk = _HFTokenizer(bpe)
            norm = [normalizers.Replace(" ", "\u2581")]
            tk.normalizer = normalizers.Sequence(([normalizers.Prepend("\u2581")] if prefix else []) + norm)
            tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                           + ([decoders.Strip(" ", 1, 0)] if prefix else []))
        return cls._from_gguf_backend(tk, meta, tokens, types, where)

    @classmethod
    def _from_gguf_backend(cls, tk, meta, tokens, types, where) -> "Tokenizer":
        """Special and user tokens, bos template, eos ids and chat template of a GGUF vocabulary."""
        template = meta.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise FormatError(f"{where}: tokenizer.chat_template must be a string")
        bos = _token_id(meta, "tokenizer.ggml.bos_token_id", where, len(tokens))
        pad = _token_id(meta, "tokenizer.ggml.padding_token_id", where)
        add_bos = bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False)) and bos is not None
        with _no_panic("building the GGUF vocabulary", FormatError):
            if types is not None:
                special = [AddedToken(tokens[i], special=True, normalized=False)
                           for i in np.flatnonzero(types == _CONTROL)]
                user = [AddedToken(tokens[i], special=False, normalized=False)
                        for i in np.flatnonzero(types == _USER_DEFINED)]
                tk.add_special_tokens(special)
                tk.add_tokens(user)
            if add_bos:
                name = tokens[bos]
                try:
                    tk.post_processor = processors.TemplateProcessing(
                        single=f"{name} $A", pair=f"{name} $A {name} $B", special_tokens=[(name, bos)])
                except Exception as e:
                    raise FormatError(f"{where}: bos token {name[:40]!r} cannot start a template: "
                                      f"{str(e)[:200]}") from None
        return cls(tk, bos_token_id=bos, eos_token_ids=eos_ids_from_gguf(meta, where),
                   pad_token_id=pad, chat_template=template, add_bos_token=add_bos,
                   fim_ids=fim_from_gguf(meta, len(tokens), where))

    @classmethod
    def from_folder(cls, folder, *, extra_eos_ids=()) -> "Tokenizer":
        """tokenizer.json + tokenizer_config.json (+ chat_template.jinja) of an HF model folder."""
        from mixqrt.platform.files import folder_file, read_text
        folder = Path(folder)
        path = folder_file(folder, "tokenizer.json", what="tokenizer file")
        if path is None:
            raise ModelError(f"{folder}: no tokenizer.json (mixqrt needs the fast-tokenizer file; "
                             "transformers' tokenizer.save_pretrained() writes it)")
        with _no_panic(f"reading {path}", FormatError):
            try:
                tk = _HFTokenizer.from_file(str(path))
            except Exception as e:
                raise FormatError(f"{path}: not a valid tokenizer.json: {str(e)[:200]}") from None
        cfg = {}
        cfg_path = folder_file(folder, "tokenizer_config.json", what="tokenizer config") \
            or folder / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                cfg = json.loads(read_text(cfg_path))
            except (json.JSONDecodeError, RecursionError) as e:
                raise FormatError(f"{cfg_path}: not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None
            if not isinstance(cfg, dict):
                raise FormatError(f"{cfg_path}: expected a JSON object")
            check_values(cfg, str(cfg_path))

        def tok_id(entry):
            text = entry.get("content") if isinstance(entry, dict) else entry
            if text is not None and not isinstance(text, str):
                raise FormatError(f"{cfg_path}: special token {str(text)[:40]!r} is not a string")
            return None if text is None else tk.token_to_id(text)

        template = cfg.get("chat_template")
        if isinstance(template, list):              # [{"name": "default", "template": ...}, ...]
            for i, t in enumerate(template):
                if not isinstance(t, dict) or not isinstance(t.get("name"), str) \
                        or not isinstance(t.get("template"), str):
                    raise FormatError(f"{cfg_path}: chat_template[{i}] must be an object with string "
                                      "'name' and 'template'")
            template = {t["name"]: t["template"] for t in template}
        if template is not None and not (isinstance(template, str) or (isinstance(template, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in template.items()))):
            raise FormatError(f"{cfg_path}: chat_template must be a string or a list of named templates")
        jinja = folder_file(folder, "chat_template.jinja", what="chat template") if template is None else None
        if jinja is not None:
            template = read_text(jinja)
        eos = {i for i in [tok_id(cfg.get("eos_token"))] if i is not None} | set(extra_eos_ids)
        return cls(tk, bos_token_id=tok_id(cfg.get("bos_token")), eos_token_ids=eos,
                   pad_token_id=tok_id(cfg.get("pad_token")), chat_template=template,
                   add_bos_token=cfg.get("add_bos_token", False))

    # -- serialization (a .mxq file stores these meta entries) ------------------------------
    def to_meta(self) -> dict:
        """JSON-able entries that rebuild this tokenizer with from_meta() (no GGUF/folder needed)."""
        return {"tokenizer": self.backend.to_str(), "chat_template": self.chat_template,
                "tokenizer_info": {"bos_token_id": self.bos_token_id, "eos_token_ids": sorted(self.eos_token_ids),
                                   "pad_token_id": self.pad_token_id, "add_bos_token": self.add_bos_token,
                                   **({"fim": dict(self.fim_ids)} if self.fim_ids else {})}}

    @classmethod
    def from_meta(cls, meta) -> "Tokenizer":
        with _no_panic("reading the model file's tokenizer", FormatError):
            try:
                backend = _HFTokenizer.from_str(meta["tokenizer"])
            except KeyError:
                raise FormatError("model file has no 'tokenizer' entry") from None
            except Exception as e:
                raise FormatError(f"model file's 'tokenizer' entry is not a valid tokenizer.json: "
                                  f"{str(e)[:200]}") from None
        info = dict(meta.get("tokenizer_info") or {})
        return cls(backend, bos_token_id=info.get("bos_token_id"), eos_token_ids=info.get("eos_token_ids") or (),
                   pad_token_id=info.get("pad_token_id"), chat_template=meta.get("chat_template"),
                   add_bos_token=info.get("add_bos_token", False),
                   fim_ids=info.get("fim") if isinstance(info.get("fim"), dict) else None)

    # -- encode / decode -------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() wants str, got {type(text).__name__}")
        tk = self.backend
        # parse_special=False: special-token text is encoded as plain text, by the backend's own switch
        # (a second backend built from to_str() cost ~0.5 s on the first such call for a 151k vocab)
        with _no_panic("encoding"), self._encode_lock:
            tk.encode_special_tokens = not parse_special
            try:
                return tk.encode(text, add_special_tokens=add_special_tokens).ids
            except TypeError:                   # the backend's answer to a lone surrogate
                raise GenerationError("the text to encode is not valid Unicode (a lone surrogate)") from None
            finally:
                tk.encode_special_tokens = False

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        with _no_panic("decoding"):
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str):
        with _no_panic("looking up a token"):
            return self.backend.token_to_id(token)

    def id_to_token(self, i: int):
        i = int(i)
        with _no_panic("looking up a token id"):
            return self.backend.id_to_token(i)

    @property
    def bos_token(self):
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self):
        return None if not self.eos_token_ids else self.id_to_token(min(self.eos_token_ids))

    # -- chat ------------------------------------------------------------------------------
    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tools=None, **context) -> str:
        """The prompt string for `messages`, rendered from the model's own template."""
        from mixqrt.generation.chat_template import render

        template = self._template(tools)
        context.setdefault("bos_token", self.bos_token or "")
        context.setdefault("eos_token", self.eos_token or "")
        return render(template, messages, add_generation_prompt=add_generation_prompt, tools=tools, **context)

    def encode_chat(self, messages, add_generation_prompt: bool = True, tools=None, **context) -> list[int]:
        """Token ids of the chat prompt: control tokens only where the template wrote them.

        Special tokens are found in the template's own text; everything between them (template
        text and message text together, so BPE merges match encoding the whole string) is encoded
        with parse_special=False. For messages without control-token text this equals
        encode(apply_chat_template(...)); with them, that text stays plain text.
        """
        from mixqrt.generation.chat_template import render_parts

        source = self._template(tools)
        context.setdefault("bos_token", self.bos_token or "")
        context.setdefault("eos_token", self.eos_token or "")
        parts = render_parts(source, messages, add_generation_prompt=add_generation_prompt, tools=tools, **context)
        if self._special_re is None:
            texts = sorted((self._added[i].content for i in self.special_ids), key=len, reverse=True)
            self._special_re = re.compile("|".join(map(re.escape, texts))) if texts else False
        if len(parts) == 1 and parts[0][1] and self._special_re is not False and not any(
                isinstance(m.get("content"), str) and self._special_re.search(m["content"]) for m in messages):
            parts = [(parts[0][0], False)]      # content the template transforms, but nothing to forge
        ids, plain = [], []
        for text, from_message in parts:
            if from_message or self._special_re is False:
                plain.append(text)
                continue
            pos = 0
            for m in self._special_re.finditer(text):
                plain.append(text[pos:m.start()])
                if any(plain):
                    ids += self.encode("".join(plain), parse_special=False)
                plain = []
                ids.append(self.token_to_id(m.group()))
                pos = m.end()
            plain.append(text[pos:])
        if any(plain):
            ids += self.encode("".join(plain), parse_special=False)
        return with_bos(self, ids)

    def _template(self, tools=None) -> str:
        template = self.chat_template
        if isinstance(template, dict):
            template = template.get("tool_use") if tools and "tool_use" in template else template.get("default")
        if not template:
            raise ModelError("this model ships no chat template; pass a plain prompt instead")
        return template

    # -- streaming -------------------------------------------------------------------------
    def token_bytes(self, i: int) -> bytes | None:
        """The exact bytes token i stands for (byte-level BPE only; None otherwise). Computed per
        token on first use and memoized: a whole-vocabulary table cost ~0.1 s before the first
        streamed token."""
        if self._id_bytes is None:
            self._id_bytes = {} if isinstance(self.backend.decoder, decoders.ByteLevel) else False
        if self._id_bytes is False:
            return None
        b = self._id_bytes.get(i)
        if b is None:
            b = self._id_bytes[i] = self._one_token_bytes(i)
        return b

    def _one_token_bytes(self, i: int) -> bytes:
        tok = self.backend.id_to_token(i) if 0 <= i < self.vocab_size else None
        if tok is None:
            return b""
        if i in self._added:
            return tok.encode("utf-8")
        try:
            return bytes(_BYTE_OF_CHAR[c] for c in tok)
        except KeyError:                            # not a byte-level string: take it literally
            return tok.encode("utf-8")

    def stream_decoder(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)


class StreamDecoder:
    """Token ids in, complete UTF-8 text out: feed() never returns half a character.

    Byte-level BPE models split multi-byte characters across tokens (an emoji is often 2-4
    tokens); bytes are buffered in an incremental UTF-8 decoder until a character completes.
    Other tokenizers fall back to re-decoding a short window and emitting the grown suffix.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self._byte_level = tokenizer.token_bytes(0) is not None
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []
        self._prefix = self._read = 0

    def feed(self, token_id: int) -> str:
        token_id = int(token_id)
        if self.skip and token_id in self.tok.special_ids:
            return ""
        if self._byte_level:
            return self._utf8.decode(self.tok.token_bytes(token_id))
        self._ids.append(token_id)
        before = self.tok.decode(self._ids[self._prefix:self._read], self.skip)
        after = self.tok.decode(self._ids[self._prefix:], self.skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is still buffered (an incomplete character becomes U+FFFD)."""
        if self._byte_level:
            return self._utf8.decode(b"", final=True)
        before = self.tok.decode(self._ids[self._prefix:self._read], self.skip)
        after = self.tok.decode(self._ids[self._prefix:], self.skip)
        self._prefix = self._read = len(self._ids)
        return after[len(before):]
