"""Token-mask cost of the grammar engines at Qwen2.5's 151,936-token vocabulary.

    python benchmarks/grammar_mask.py [--gguf PATH] [--docs]

For each installed engine (llguidance, xgrammar, outlines-core):
  - tokenizer setup: the engine's tokenizer adapter built from mixqrt's own tokenizer (the HF
    `tokenizers` object mixqrt rebuilds from the GGUF), seconds, once per model;
  - compile: a mid-size JSON schema (nested objects, arrays with bounds, enums, number ranges,
    optional fields, anyOf) to the engine's matcher, seconds;
  - mask: per generated token, the time to compute the next-token mask into a bitmask, then
    advance by the token. The tokens are those of a few valid documents of the schema (what a
    constrained generation emits), so the measured steps are real JSON-schema steps.
--docs writes the table into docs/structured-output.md (between its grammar-mask markers).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

GGUF = Path.home() / ".cache/mixqrt-test-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
N_VOCAB = 151936

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 100000},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string"},
        "status": {"enum": ["active", "suspended", "closed", "pending"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "country": {"enum": ["US", "DE", "FR", "JP"]}},
            "required": ["street", "city", "country"], "additionalProperties": False},
        "orders": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
            "price": {"type": "number", "minimum": 0}}, "required": ["sku", "qty", "price"],
            "additionalProperties": False}},
        "contact": {"anyOf": [{"type": "string"}, {"type": "object", "properties": {
            "phone": {"type": "string"}}, "required": ["phone"], "additionalProperties": False}]},
        "verified": {"type": "boolean"},
    },
    "required": ["id", "name", "status", "tags", "address", "orders", "verified"],
    "additionalProperties": False,
}

DOCS = [
    {"id": 42, "name": "Ada Lovelace", "email": "ada@example.com", "status": "active", "score": 0.93,
     "tags": ["math", "poetry"], "address": {"street": "12 St James's Square", "city": "London", "zip": "12345",
                                             "country": "US"},
     "orders": [{"sku": "BK-001", "qty": 2, "price": 19.5}, {"sku": "PN-7", "qty": 1, "price": 3.25}],
     "contact": {"phone": "+44 20 7946 0000"}, "verified": True},
    {"id": 7, "name": "Grace Hopper", "status": "pending", "tags": ["cobol"],
     "address": {"street": "1 Navy Rd", "city": "Arlington", "country": "US"}, "orders": [],
     "contact": "grace@navy.mil", "verified": False},
    {"id": 99999, "name": "Alan Turing", "email": "alan@bletchley.uk", "status": "closed", "score": 0.5,
     "tags": ["crypto", "ai", "biology", "chess"],
     "address": {"street": "Bletchley Park", "city": "Milton Keynes", "zip": "90210", "country": "DE"},
     "orders": [{"sku": "ENIGMA", "qty": 3, "price": 1000}], "verified": True},
]


def doc_tokens(tok) -> list[list[int]]:
    return [tok.encode(json.dumps(d, ensure_ascii=False), parse_special=False) for d in DOCS]


# ----------------------------------------------------------------------------------- engines
def bench_llguidance(tok, eos, docs):
    import llguidance
    import llguidance.numpy as lln
    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=N_VOCAB, eos_token=sorted(eos))
    setup = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    t0 = time.perf_counter()
    m = llguidance.LLMatcher(lt, grammar)
    compile_s = time.perf_counter() - t0
    assert not m.is_error(), m.get_error()
    mask = lln.allocate_token_bitmask(1, N_VOCAB)
    times = []
    for ids in docs:
        m = llguidance.LLMatcher(lt, grammar)
        for t in ids:
            t0 = time.perf_counter()
            lln.fill_next_token_bitmask(m, mask, 0)
            times.append(time.perf_counter() - t0)
            assert (mask[0, t >> 5] >> (t & 31)) & 1, "the document's token was masked out"
            assert m.consume_token(t), m.get_error()
        assert m.is_accepting()
    return setup, compile_s, times


def bench_xgrammar(tok, eos, docs):
    import torch
    import xgrammar as xgr
    t0 = time.perf_counter()
    vocab = [b""] * N_VOCAB
    for i in range(tok.vocab_size):
        vocab[i] = tok.backend.id_to_token(i) or ""
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=N_VOCAB, stop_token_ids=sorted(eos))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    cg = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, N_VOCAB)
    times = []
    for ids in docs:
        m = xgr.GrammarMatcher(cg)
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            times.append(time.perf_counter() - t0)
            assert m.accept_token(t)
    del torch
    return setup, compile_s, times


def bench_outlines(tok, eos, docs):
    import outlines_core as oc
    t0 = time.perf_counter()
    e = min(eos)
    vmap: dict[bytes, list[int]] = {}
    for i in range(tok.vocab_size):
        if i in eos or i in tok.special_ids:
            continue
        vmap.setdefault(tok.token_bytes(i), []).append(i)
    vocab = oc.Vocabulary(e, vmap)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    regex = oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    index = oc.Index(regex, vocab)
    compile_s = time.perf_counter() - t0
    mask = np.zeros((N_VOCAB + 31) // 32, dtype=np.int32)
    times = []
    for ids in docs:
        g = oc.Guide(index)
        for t in ids:
            t0 = time.perf_counter()
            g.write_mask_into(mask.ctypes.data, mask.size, 4)
            times.append(time.perf_counter() - t0)
            g.advance(t)
    return setup, compile_s, times


ENGINES = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "outlines-core": bench_outlines}


def version(name):
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as v
    try:
        return v(name.replace("-", "_"))
    except PackageNotFoundError:
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=str(GGUF))
    ap.add_argument("--timeout", type=float, default=300.0, help="give up an engine's compile after this")
    ap.add_argument("--docs", action="store_true", help="write the table into docs/structured-output.md")
    ap.add_argument("--only", nargs="*", default=list(ENGINES))
    a = ap.parse_args(argv)
    from mixqrt.io.gguf import GGUFSource
    with GGUFSource(a.gguf) as g:
        tok = g.tokenizer
    eos = tok.eos_token_ids
    docs = doc_tokens(tok)
    rows, raw = [], {}
    for name in a.only:
        if version(name) is None:
            rows.append(f"| {name} | not installed | | | | |")
            continue
        try:
            setup, comp, times = ENGINES[name](tok, eos, docs)
        except Exception as e:  # noqa: BLE001 — report, go on with the next engine
            rows.append(f"| {name} {version(name)} | failed: {type(e).__name__}: {str(e)[:80]} | | | | |")
            continue
        us = np.asarray(times) * 1e6
        raw[name] = {"version": version(name), "setup_s": setup, "compile_s": comp, "tokens": len(times),
                     "mean_us": float(us.mean()), "p50_us": float(np.median(us)), "p99_us": float(np.percentile(us, 99)),
                     "max_us": float(us.max())}
        r = raw[name]
        rows.append(f"| {name} {r['version']} | {setup:.2f} | {comp * 1e3:.1f} | {r['mean_us']:.0f} | "
                    f"{r['p50_us']:.0f} | {r['p99_us']:.0f} |")
        print(rows[-1], flush=True)
    table = ("| engine | tokenizer setup (s) | schema compile (ms) | mask mean (µs/token) | mask p50 (µs) | "
             "mask p99 (µs) |\n|---|---|---|---|---|---|\n" + "\n".join(rows))
    print(table)
    if a.docs:
        from _common import provenance, update_doc, write_json
        ntok = sum(len(d) for d in docs)
        body = (table + f"\n\n{ntok} mask computations over {len(docs)} documents of the benchmark's schema, "
                f"vocabulary {N_VOCAB}, one thread.\n\n" + provenance("python benchmarks/grammar_mask.py --docs"))
        update_doc(ROOT / "docs/structured-output.md", {"grammar-mask": body}, "Structured output")
        write_json(ROOT / "docs/data/grammar-mask.json", raw)


if __name__ == "__main__":
    main()
