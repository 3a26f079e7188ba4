"""Do mixqrt's GGUF-built tokenizers give llama.cpp's token ids?

For each test model, encodes a fixed set of texts (English, code, Chinese, emoji, whitespace runs)
and a slice of wikitext-2 line by line with mixqrt (Tokenizer.from_gguf_metadata) and with
llama-cpp-python (vocab_only=True, add_bos=False, special=False), counts texts whose ids are
identical, and writes docs/tokenizer.md. Decode round trips are checked on the same texts.

    python benchmarks/check_tokenizer.py [--lines 2000] [--no-write]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mixqrt.io import open_source  # noqa: E402
from mixqrt.testing import model_path  # noqa: E402

MODELS = {"qwen2.5-coder-0.5b (qwen2 pre)": model_path("qwen"),      # the test models (mixqrt.testing)
          "smollm2-135m (smollm pre)": model_path("smol")}
WIKI = ROOT / "tests" / "data" / "wikitext-2-test.txt"

CASES = {
    "english": "The quick brown fox jumps over the lazy dog. It's 2024; we'll see what they've done, isn't it?",
    "code": "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    p = xs[0]\n    return "
            "quicksort([x for x in xs[1:] if x < p]) + [p]\n\nfor i in range(10):\n\tprint(f\"{i:>3}\", i**2)  # 12345\n",
    "chinese": "今天天气很好，我们去公园散步吧。机器学习是人工智能的一个分支。",
    "emoji": "Great job 👍🏽🎉! ❤️‍🔥 😀😃😄 family: 👨‍👩‍👧‍👦 flags: 🇯🇵🇫🇷",
    "whitespace": "a  b   c    d\n\n\n  e\t\tf \t \n   \r\n  trailing   ",
    "mixed": "Zürich café naïve jalapeño — “quotes” … 1,234.56 ١٢٣ ½ x² Ω≈ç√ 日本語とEnglish混在",
    "numbers": "3.14159265358979 2718281828 0x1F 1e-10 100000000000",
    "contractions": "I'M HE'S they'Re You'VE it'd WE'LL O'Neil's",
    "leading-space": "   leading spaces and trailing newline\n",
}


def compare(path: Path, texts: dict[str, str], wiki_lines: list[str]):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    with open_source(path) as src:
        tok = src.tokenizer
    tok.encode("", parse_special=False)           # build the lazy special=false copy outside the timing
    rows, mismatches = [], []
    t_mq = t_ll = 0.0
    for name, text in texts.items():
        t0 = time.perf_counter()
        a = tok.encode(text, parse_special=False)
        t1 = time.perf_counter()
        b = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        t_ll += time.perf_counter() - t1
        t_mq += t1 - t0
        rt = tok.decode(a) == text
        rows.append((name, len(a), a == b, rt))
        if a != b:
            mismatches.append((name, text, a, b))
    # a rendered chat prompt, special tokens parsed on both sides (special=True)
    chat = tok.apply_chat_template([{"role": "user", "content": "Write hello world in C."}])
    a = tok.encode(chat)
    b = llm.tokenize(chat.encode("utf-8"), add_bos=False, special=True)
    rows.append(("chat prompt, special=True", len(a), a == b, tok.decode(a) == chat))
    if a != b:
        mismatches.append(("chat", chat, a, b))
    same = n_tok = 0
    for line in wiki_lines:
        t0 = time.perf_counter()
        a = tok.encode(line, parse_special=False)
        t1 = time.perf_counter()
        b = llm.tokenize(line.encode("utf-8"), add_bos=False, special=False)
        t_ll += time.perf_counter() - t1
        t_mq += t1 - t0
        n_tok += len(b)
        if a == b:
            same += 1
        elif len(mismatches) < 8:
            mismatches.append(("wikitext", line, a, b))
    return rows, (same, len(wiki_lines), n_tok), mismatches, (t_mq, t_ll)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=100000, help="wikitext lines to compare")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/tokenizer.md alone")
    args = ap.parse_args()
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        sys.exit("llama-cpp-python is not installed (pip install llama-cpp-python); nothing to compare against")
    wiki = []
    if WIKI.exists():
        wiki = [ln for ln in WIKI.read_text(encoding="utf-8").splitlines() if ln.strip()][: args.lines]
    out = []
    all_ok = True
    for label, path in MODELS.items():
        if not path.exists():
            out.append(f"### {label}\n\nmissing: {path}\n")
            all_ok = False
            continue
        rows, (same, n, n_tok), mism, (t_mq, t_ll) = compare(path, CASES, wiki)
        ok = sum(r[2] for r in rows)
        all_ok &= ok == len(rows) and same == n
        lines = [f"### {label}", "", f"`{path.name}`", "",
                 "| text | tokens | ids == llama.cpp | decode(encode(x)) == x |", "|---|---:|:---:|:---:|"]
        lines += [f"| {r[0]} | {r[1]} | {'yes' if r[2] else '**no**'} | {'yes' if r[3] else '**no**'} |" for r in rows]
        lines += ["", f"Fixed texts: **{ok}/{len(rows)}** identical. wikitext-2 test, {n} non-empty lines "
                  f"({n_tok} llama.cpp tokens): **{same}/{n}** lines identical. "
                  f"Encode time, all texts: mixqrt {t_mq * 1e3:.0f} ms, llama.cpp {t_ll * 1e3:.0f} ms.", ""]
        for name, text, a, b in mism:
            lines += [f"- mismatch in {name}: {text[:80]!r}", f"  - mixqrt:    {a[:40]}", f"  - llama.cpp: {b[:40]}"]
        out.append("\n".join(lines) + "\n")
        print("\n".join(lines))
    if not args.no_write:
        import llama_cpp
        doc = ROOT / "docs" / "tokenizer.md"
        doc.write_text(HEADER.replace("{version}", llama_cpp.__version__) + "\n".join(out) + FOOTER)
        print(f"wrote {doc}")
    sys.exit(0 if all_ok else 1)


HEADER = """\
# Tokenizer: how mixqrt builds it and how well it agrees with llama.cpp

`mixqrt.generation.tokenizer.Tokenizer` wraps a `tokenizers.Tokenizer` (Rust, fast) and adds what generation
needs: the end-of-generation id set, the model's chat template, and `StreamDecoder`.

* **HF folders**: `tokenizer.json` as shipped, plus `tokenizer_config.json` (chat_template, bos/eos)
  and the eos ids of `generation_config.json` / `config.json`.
* **GGUF files**: rebuilt from `tokenizer.ggml.*`: a byte-level BPE from the token list and merges,
  the pre-tokenizer regex that llama.cpp uses for `tokenizer.ggml.pre` (`qwen2`; `llama-bpe`;
  `smollm`/`starcoder`/`refact` = single digits + GPT-2 regex; `gpt2`/default), control tokens as
  special added tokens and user-defined ones as plain added tokens (both matched in text, as in
  llama.cpp), a BOS post-processor when `tokenizer.ggml.add_bos_token` is true. No NFC normalizer is
  applied (llama.cpp applies none), so results match llama.cpp rather than HF on non-NFC input.
* **End of generation**: eos/eot/eom ids from the metadata plus every control token whose text is a
  known end-of-turn marker (`<|im_end|>`, `<|endoftext|>`, `<|eot_id|>`, ...), as llama.cpp does.
  For Qwen2.5 that is {151643, 151645}; for SmolLM2 {0, 2}.
* **Special tokens in text**: `encode()` matches special tokens written in the text (needed for a
  rendered chat template); `encode(text, parse_special=False)` treats them as plain text, like
  llama.cpp's `special=false` — use it for untrusted user input.
* **Streaming**: `StreamDecoder.feed(id)` turns each token into its exact bytes and runs them
  through an incremental UTF-8 decoder, so a character split over several tokens (emoji, CJK) is
  emitted once complete, never as U+FFFD halves; `flush()` at the end.

## Agreement with llama.cpp

Measured by `python benchmarks/check_tokenizer.py` against llama-cpp-python {version}
(`Llama(path, vocab_only=True).tokenize(text.encode(), add_bos=False, special=False)`) vs
`Tokenizer.encode(text, parse_special=False)`.

"""
FOOTER = ""

if __name__ == "__main__":
    main()
