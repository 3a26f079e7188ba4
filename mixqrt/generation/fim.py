"""Fill-in-the-middle (FIM): the model's FIM tokens and the infill prompt, as llama.cpp's server builds it.

    from mixqrt.generation.fim import fim_tokens, build_infill
    toks = fim_tokens(tokenizer)                  # FimTokens(pre=151659, suf=151661, mid=151660, ...)
    ids = build_infill(tokenizer, prefix, suffix, extra=[{"filename": "a.py", "text": "..."}])

Where the tokens come from, in this order (llama.cpp's own order, src/llama-vocab.cpp):
  1. GGUF metadata ``tokenizer.ggml.fim_{pre,suf,mid,pad,rep,sep}_token_id`` (and the older
     ``tokenizer.ggml.{prefix,suffix,middle}_token_id``), copied into the .mxq's tokenizer_info
     when the file is converted (``mixqrt.generation.tokenizer.fim_from_gguf``);
  2. the tokenizer's added tokens by their text (Qwen ``<|fim_prefix|>``, StarCoder / Granite
     ``<fim_prefix>``, DeepSeek ``<｜fim▁begin｜>``, CodeLlama ``▁<PRE>``, ...: ``FIM_TEXTS``).
A model without prefix, suffix and middle tokens cannot infill: ``FimError`` names what is missing
(the server answers 400).

The prompt (``build_infill``), llama.cpp's repo-level pattern (server-common.cpp format_prompt_infill):

    [FIM_REP]myproject\\n [FIM_SEP]{filename}\\n{text} ... [FIM_SEP]filename\\n
    [FIM_PRE]{prefix}[FIM_SUF]{suffix}[FIM_MID]{prompt}

(without a FIM_REP / FIM_SEP token the extra chunks are separated by "\\n\\n--- snippet ---\\n\\n").
Trimming, with llama.cpp's budget: of the prefix the last ``3 * (n_batch / 4)`` tokens are kept, of
the suffix the first ``n_batch / 4 - 2 - len(prompt)``, and the extra chunks fill what is left of
``n_ctx - n_batch - 2 * n_predict`` from their end (n_batch is llama.cpp's default 2048, here capped
at half the context so that the extra files keep a share of a small context). One difference: llama.cpp slides the prefix's
cut with every typed token (and relies on ``--cache-reuse`` to shift the cached K/V); here the cut
moves in steps of ``CUT_STEP`` tokens counted from the prefix's start, so the prompt's beginning
stays the same while a user types and the prompt cache reuses it (mixqrt.generation.prompt_cache). Nothing is
dropped whole unless its budget is zero, and the prompt never exceeds the context.

The prefix, suffix, prompt and extra texts are user text: they are encoded with special-token
parsing off, so a file that contains "<|fim_suffix|>" is that text, never the control token.
"""
from __future__ import annotations

from dataclasses import dataclass

from mixqrt.errors import RequestError

# llama.cpp's token texts per role (src/llama-vocab.cpp, "find FIM_PRE token" and following)
FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
            "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
            "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
            "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
ROLES = tuple(FIM_TEXTS)

DEFAULT_N_BATCH = 2048          # llama.cpp's default n_batch: its FIM budget is 3/4 prefix, 1/4 suffix
CUT_STEP = 64                   # the prefix's cut moves in steps of this many tokens (see above)
REPO_NAME = "myproject"         # llama.cpp's fixed repository name (its TODO: make it an input)
SNIPPET_SEP = "\n\n--- snippet ---\n\n"
# request bounds (the server's and the Pipeline's): llama.vim sends up to ~64 chunks; 10^4 is refused
MAX_EXTRA = 256
MAX_FILENAME_CHARS = 1024


class FimError(RequestError):
    """The model cannot infill (no FIM tokens) or an infill input is malformed (HTTP 400)."""


@dataclass(frozen=True)
class FimTokens:
    pre: int | None = None
    suf: int | None = None
    mid: int | None = None
    pad: int | None = None
    rep: int | None = None
    sep: int | None = None

    @property
    def complete(self) -> bool:
        return None not in (self.pre, self.suf, self.mid)

    def ids(self) -> set[int]:
        return {v for v in (self.pre, self.suf, self.mid, self.pad, self.rep, self.sep) if v is not None}

    def stop_ids(self) -> set[int]:
        """Tokens that end a middle: llama.cpp adds FIM_PAD, FIM_REP and FIM_SEP to its
        end-of-generation set; PRE / SUF / MID would start another FIM frame, so they end it too."""
        return self.ids()

    def to_dict(self) -> dict:
        return {r: getattr(self, r) for r in ROLES if getattr(self, r) is not None}


def fim_tokens(tokenizer) -> FimTokens:
    """The FIM tokens of a mixqrt Tokenizer: its stored GGUF ids first, then added tokens by text."""
    cached = getattr(tokenizer, "_fim", None)
    if cached is not None:
        return cached
    found = {}
    stored = getattr(tokenizer, "fim_ids", None) or {}
    n = tokenizer.vocab_size
    for role in ROLES:
        v = stored.get(role)
        if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n:
            found[role] = v
            continue
        for text in FIM_TEXTS[role]:
            i = tokenizer.token_to_id(text)
            if i is not None:
                found[role] = int(i)
                break
    out = FimTokens(**found)
    try:
        tokenizer._fim = out
    except AttributeError:
        pass
    return out


def require_fim(tokenizer) -> FimTokens:
    """FimTokens with pre/suf/mid, or FimError naming what the model lacks (llama.cpp's wording)."""
    t = fim_tokens(tokenizer)
    missing = [name for name, v in (("prefix", t.pre), ("suffix", t.suf), ("middle", t.mid)) if v is None]
    if missing:
        raise FimError("suffix", "infill (fill-in-the-middle) is not supported by this model: its vocabulary has no "
                       + ", ".join(missing) + " token (neither GGUF tokenizer.ggml.fim_*_token_id nor an added "
                       "token such as <|fim_prefix|>)")
    return t


def check_extra(extra, field: str = "input_extra") -> list[tuple[str, str]]:
    """[{"filename": str, "text": str}, ...] -> [(filename, text)]; FimError naming the problem."""
    if extra is None:
        return []
    if not isinstance(extra, (list, tuple)):
        raise FimError(field, f'{field} must be an array of {{"filename": string, "text": string}}')
    if len(extra) > MAX_EXTRA:
        raise FimError(field, f"{field} has {len(extra)} chunks; at most {MAX_EXTRA}")
    out = []
    for i, c in enumerate(extra):
        if not isinstance(c, dict) or not isinstance(c.get("text"), str):
            raise FimError(field, f'{field}[{i}] must contain a "text" field with a string value')
        name = c.get("filename", "tmp")
        if name is None:
            name = "tmp"
        if not isinstance(name, str):
            raise FimError(field, f'{field}[{i}]\'s "filename" field must be a string')
        if len(name) > MAX_FILENAME_CHARS:
            raise FimError(field, f"{field}[{i}].filename has {len(name)} characters; at most {MAX_FILENAME_CHARS}")
        unknown = set(c) - {"filename", "text"}
        if unknown:
            raise FimError(field, f"{field}[{i}] has unknown field(s): {', '.join(sorted(map(str, unknown)))[:100]}")
        out.append((name, c["text"]))
    return out


def _text(tokenizer, s: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(s, parse_special=False)] if s else []


def build_infill(tokenizer, prefix: str, suffix: str, extra=None, prompt: str = "", *, n_ctx: int,
                 n_predict: int = -1, n_batch: int = DEFAULT_N_BATCH, spm: bool = False) -> list[int]:
    """The token ids of an infill request (module docstring: order, trimming, control text).

    n_ctx: the context the request runs in; n_predict: its max_tokens (-1: none); n_batch: the
    budget llama.cpp derives the prefix / suffix split from (capped at n_ctx); spm: suffix first
    (llama.cpp's --spm-infill), for models trained that way."""
    t = require_fim(tokenizer)
    for name, v in (("input_prefix", prefix), ("input_suffix", suffix), ("prompt", prompt)):
        if not isinstance(v, str):
            raise FimError(name, f"{name} must be a string, got {type(v).__name__}")
    chunks = check_extra(extra)
    n_ctx = int(n_ctx)
    n_batch = max(4, min(int(n_batch), n_ctx // 2))    # half the context at most: the extra files keep the rest
    n_predict = int(n_predict)
    p_ids, s_ids, m_ids = _text(tokenizer, prefix), _text(tokenizer, suffix), _text(tokenizer, prompt)

    extra_ids: list[int] = []
    if t.rep is not None:
        extra_ids += [t.rep] + _text(tokenizer, REPO_NAME + "\n")
    for name, text in chunks:
        if t.sep is not None:
            extra_ids += [t.sep] + _text(tokenizer, name + "\n")
        else:
            extra_ids += _text(tokenizer, SNIPPET_SEP)
        extra_ids += _text(tokenizer, text)
    if t.sep is not None:
        extra_ids += [t.sep] + _text(tokenizer, "filename\n")

    n_prefix = min(len(p_ids), 3 * (n_batch // 4))
    n_suffix = min(len(s_ids), max(0, n_batch // 4 - (2 + len(m_ids))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_ids))
    cut = len(p_ids) - n_prefix
    if cut:                                  # round the cut up to a step from the start: it stays put while typing
        cut = min(len(p_ids), -(-cut // CUT_STEP) * CUT_STEP)
    p_ids = p_ids[cut:]
    s_ids = s_ids[:n_suffix]
    head = [t.pre] + p_ids + m_ids
    tail = [t.suf] + s_ids
    first, second = (tail, head) if spm else (head, tail)
    bos = getattr(tokenizer, "bos_token_id", None)
    if getattr(tokenizer, "add_bos_token", False) and bos is not None:
        first = [int(bos)] + first
    ids = (extra_ids[len(extra_ids) - n_extra:] if n_extra else []) + first + second + [t.mid]
    if len(ids) > n_ctx - 1:                 # a tiny context: llama.cpp would overflow; refuse by name
        raise FimError("input_prefix", f"the infill prompt needs {len(ids)} tokens; the context holds {n_ctx}")
    return ids


def stop_ids(tokenizer, model) -> list[int]:
    """The ids that end a middle: the model's end-of-generation set plus every FIM token."""
    from mixqrt.generation.generate import eos_ids
    return sorted(eos_ids(None, model, tokenizer) | require_fim(tokenizer).stop_ids())
