"""The `mixqrt` command line."""
from __future__ import annotations

import argparse
import json
import os
import sys

from mixqrt.quantize.recipes import DEFAULT_RECIPE
from mixqrt.generation.speculative import add_speculative_arguments, speculative_kwargs


def _add_model(p, optional=False):
    if optional:
        p.add_argument("model", nargs="?", default=None,
                       help="a .mxq, a .gguf, a Hugging Face folder, a hub id or alias (e.g. Qwen2-7B-2356); "
                            "default: the demo Qwen2.5-Coder-0.5B-Instruct from mixqrt[demo]")
    else:
        p.add_argument("model", help="a .mxq, a .gguf, a Hugging Face folder, or a hub id / alias")
    p.add_argument("--recipe", default=None, help=f"quantization recipe (default {DEFAULT_RECIPE}, or the name's suffix)")
    p.add_argument("-t", "--threads", type=int, default=None, help="kernel threads (default: usable cores)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.add_argument("--offline", action="store_true", help="never touch the network (like HF_HUB_OFFLINE=1)")


LONG_WINDOW = 2048      # mixqrt ppl: windows longer than this get the scored half's logits in pieces


def _add_kv_type(p, default: str | None = None):
    """--kv-type; default: what the command uses when it is not given (help text only)."""
    from mixqrt.models.kv_cache import DEFAULT_KV_TYPE, KV_TYPES
    p.add_argument("--kv-type", default=None, choices=KV_TYPES, metavar="TYPE",
                   help=f"KV cache type: {', '.join(KV_TYPES)} (default {default or DEFAULT_KV_TYPE}; "
                        f"docs/long-context.md)")


def _add_sampling(p):
    p.add_argument("-n", "--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: generation_config.json)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ctx", type=int, default=None,
                   help="context length (default: the model's own, e.g. 32768 for Qwen2.5; KV pages are "
                        "resident only as a sequence grows)")
    from mixqrt.models.config_limits import parse_bytes
    p.add_argument("--kv-cache-bytes", type=parse_bytes, default=None, metavar="N",
                   help="bound of the KV cache's bytes (512MiB, 2GiB...; default: a quarter of the memory available)")
    _add_kv_type(p)
    add_speculative_arguments(p)


def _sampling_kwargs(a) -> dict:
    kw = {"max_new_tokens": a.max_new_tokens}
    for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "stop"):
        v = getattr(a, k)
        if v is not None:
            kw[k] = v
    return kw


def _pipeline(a):
    from mixqrt.pipeline import Pipeline
    pipe = Pipeline(a.model, recipe=a.recipe, threads=a.threads, progress=not a.quiet,
                    offline=True if a.offline else None, max_context=getattr(a, "ctx", None),
                    kv_type=getattr(a, "kv_type", None), **speculative_kwargs(a))
    if getattr(a, "kv_cache_bytes", None) is not None:
        pipe.configure_engine(kv_cache_bytes=a.kv_cache_bytes)
    return pipe



def cmd_doctor(a):
    from mixqrt.commands.doctor import format_pages, format_report, model_pages, report
    info = report()
    if a.model:
        info["model_pages"] = model_pages(a.model, recache=a.recache)
    if a.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_report(info))
        if a.model:
            print(format_pages(info["model_pages"]))


def parse_rotate(items):
    """--rotate values -> None (the recipe's), {} (none) or {role: block}; UsageError naming a bad one."""
    if not items:
        return None
    from mixqrt.models.spec import ROLES
    out = {}
    for item in items:
        if item.strip().lower() == "none":
            return {}
        role, _, b = item.partition("=")
        if role not in ROLES or not b.isdigit() or int(b) < 2 or int(b) > 1024 or int(b) & (int(b) - 1):
            raise SystemExit(f"mixqrt quantize: --rotate {item!r}: want ROLE=BLOCK with ROLE one of "
                             f"{', '.join(ROLES)} and BLOCK a power of two in [2, 1024], or 'none'")
        out[role] = int(b)
    return out


def cmd_quantize(a):
    import contextlib

    from mixqrt.quantize.convert import describe, dumps_report, quantize_model
    from mixqrt.io.atomic import output_lock
    # one writer of OUTPUT at a time, and the temps of killed runs removed first
    with contextlib.nullcontext() if a.dry_run else output_lock(a.output):
        rep = quantize_model(a.src, a.recipe or DEFAULT_RECIPE, a.output, overrides=a.tensor_type,
                             progress=not a.quiet, dry_run=a.dry_run, offline=True if a.offline else None,
                             imatrix=a.imatrix, budget_bytes=a.budget_bytes, rotate=parse_rotate(a.rotate),
                             **_calibration(a))
    if a.json:
        print(dumps_report(rep))
        return
    print(describe(rep))
    if not a.dry_run:
        print(f"wrote {a.output}: {rep.total_bytes:,d} bytes of tensors, {rep.bits_per_weight:.3f} bits/weight, "
              f"{rep.seconds:.1f} s, peak RSS {rep.peak_rss_bytes / 2**20:.0f} MiB")


def _calibration(a) -> dict:
    """--calibrate FILE|self (repeatable; the sources share --calib-tokens evenly)."""
    from mixqrt.quantize.calibtext import parse_sources

    if a.calib_save and "self" not in (a.calibrate or ()):
        raise SystemExit("mixqrt quantize: --calib-save needs --calibrate self")
    sources = parse_sources(a.calibrate or (), seed=a.calib_seed, save=a.calib_save)
    if not sources:
        return {}
    return {"calibrate": sources, "calib_tokens": a.calib_tokens, "damp": a.damp, "refit": a.refit,
            "gptq_span": a.gptq_span}


def cmd_imatrix(a):
    from mixqrt.pipeline import load
    from mixqrt.quantize.imatrix import collect, save
    with open(a.text, encoding="utf-8") as f:
        text = f.read()
    m = load(a.model, None if str(a.model).endswith(".mxq") else a.recipe, progress=not a.quiet)
    try:
        doc = collect(m, text, chunks=a.chunks, ctx=a.ctx, progress=not a.quiet,
                      source_label=os.path.basename(a.text), model_label=str(a.model))
    finally:
        m.close()
    save(doc, a.output)
    print(f"wrote {a.output}: {len(doc['tensors'])} tensors, {doc['tokens']} tokens in {doc['chunks']} chunks "
          f"of {doc['ctx']} from {a.text}")


def cmd_inspect(a):
    from mixqrt.commands.inspect_model import inspect_model
    print(inspect_model(a.model, placement=a.placement, as_json=a.json, recipe=a.recipe, kv_type=a.kv_type))


def cmd_upgrade(a):
    from mixqrt.errors import MixqrtError
    from mixqrt.io.mxq import upgrade
    if os.path.abspath(a.input) == os.path.abspath(a.output):
        raise MixqrtError(f"upgrade: OUTPUT must be another file than INPUT ({a.input})")
    n = upgrade(a.input, a.output)
    if not a.quiet:
        print(f"{a.output}: {n} tensor{'s' * (n != 1)} rewritten in the current storage forms")


def cmd_generate(a):
    pipe = _pipeline(a)
    prompt = a.prompt if a.prompt is not None else sys.stdin.read()
    last = None
    if a.suffix is not None and a.chat:
        raise SystemExit("mixqrt generate: --suffix (fill-in-the-middle) and --chat do not go together")
    if not a.chat:
        sys.stdout.write(prompt)   # echo the prompt, as llama.cpp does, so the output reads whole
    kw = _sampling_kwargs(a)
    if a.prediction is not None:
        with open(a.prediction, encoding="utf-8") as f:
            kw["prediction"] = f.read()
    if a.suffix is not None:       # fill-in-the-middle: the prompt is the text before the cursor
        pieces = pipe.stream_infill(prompt, a.suffix, **kw)
    else:
        pieces = pipe.stream(prompt if not a.chat else [{"role": "user", "content": prompt}], **kw)
    for r in _prefill_progress(pipe, pieces, a.quiet):
        sys.stdout.write(r.text)
        sys.stdout.flush()
        last = r
    if a.suffix is not None:
        sys.stdout.write(a.suffix)
    sys.stdout.write("\n")
    if last is not None and not a.quiet:
        print(f"[prompt {last.prompt_tokens} tok, {last.prompt_tps:.1f} tok/s | "
              f"generated {last.generation_tokens} tok, {last.generation_tps:.1f} tok/s | "
              f"TTFT {last.ttft_s:.3f} s | {last.finish_reason}"
              + (f" | drafts {last.accepted_draft_tokens}/{last.draft_tokens} accepted" if last.draft_tokens else "")
              + "]", file=sys.stderr)


PROGRESS_PROMPT = 2048          # prompts at least this long show a prefill progress bar (on stderr)


def _prefill_progress(pipe, pieces, quiet: bool):
    """Yield the pieces; until the first one comes, a long prompt's prefill shows a tqdm bar of the
    engine's prefilled tokens (its chunks, polled from Engine.stats) on stderr."""
    if quiet:
        yield from pieces
        return
    import threading

    eng = pipe.engine
    s0 = eng.stats()
    first = threading.Event()

    def watch():
        from tqdm.auto import tqdm
        bar = None
        while not first.wait(0.25):
            st = eng.stats()
            total = st["prompt_tokens"] - s0["prompt_tokens"]
            if total < PROGRESS_PROMPT:
                continue
            if bar is None:
                bar = tqdm(total=total, desc="prompt", unit="tok", leave=False, file=sys.stderr)
            bar.n = min(total, st["prefill_tokens"] - s0["prefill_tokens"])
            bar.refresh()
        if bar is not None:
            bar.close()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        for r in pieces:
            if not first.is_set():
                first.set()
                t.join()
            yield r
    finally:
        first.set()


def cmd_chat(a):
    pipe = _pipeline(a)
    messages = []
    if a.system:
        messages.append({"role": "system", "content": a.system})
    print("mixqrt chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply = []
        for r in pipe.stream(messages, **_sampling_kwargs(a)):
            sys.stdout.write(r.text)
            sys.stdout.flush()
            reply.append(r.text)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


def cmd_ppl(a):
    from mixqrt.commands.evaluate import encode_text, perplexity
    from mixqrt.pipeline import load
    m = load(a.model, a.recipe, threads=a.threads, offline=True if a.offline else None, progress=not a.quiet)
    if a.kv_type is not None:
        m.model.kv_bytes_per_token(a.kv_type)        # a type this build cannot make fails here
        m.model.kv_type = a.kv_type
    with open(a.text, encoding="utf-8") as f:
        text = f.read()
    toks, bos = encode_text(m.tokenizer, text, parse_special=a.parse_special)

    def show(i, v):
        if not a.json and not a.quiet:
            print(f"[{i + 1}]{v:.4f}", end=" ", flush=True, file=sys.stderr)

    # long windows: only the scored half's logits, 256 rows at a time (LONG_WINDOW; 16384 x vocab is 10 GB)
    pieces = m.logit_pieces if a.ctx > LONG_WINDOW else None
    r = perplexity(lambda ids: m.logits(ids), toks, ctx=a.ctx, chunks=a.chunks, bos_id=bos,
                   save_logits=a.save_logits, kl_base=a.kl_base, progress=False, on_chunk=show, pieces_fn=pieces)
    if a.json:
        d = r.to_dict()
        mm = m.model
        bpt = mm.kv_bytes_per_token()
        from mixqrt.platform.perf import peak_rss_bytes
        d.update(model=str(a.model), recipe=m.recipe, text=a.text, kv_type=mm.kv_type, kv_bytes_per_token=bpt,
                 peak_rss_bytes=peak_rss_bytes(),
                 kv_bits_per_value=8 * bpt / (2 * mm.args.num_hidden_layers * mm.args.num_key_value_heads
                                              * mm.args.head_dim))
        print(json.dumps(d))
        return
    print(file=sys.stderr)
    print(f"PPL = {r.ppl:.4f} +/- {r.ppl_err:.5f}  ({r.tokens} tokens scored in {r.chunks} chunks of {r.ctx}, "
          f"{m.model.kv_type} KV cache, {r.seconds:.1f} s)")
    if r.kld_mean is not None:
        print(f"KL divergence: mean {r.kld_mean:.6f}, 99th percentile {r.kld_p99:.6f}; "
              f"same top token {r.same_top_pct:.2f} %")


def cmd_bench(a):
    from mixqrt.commands.bench import bench, format_rows
    from mixqrt.pipeline import load
    try:
        threads = [int(t) for t in a.threads.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"mixqrt bench: -t wants a comma list of ints, got {a.threads!r}") from None
    m = load(a.model, a.recipe, offline=True if a.offline else None, progress=not a.quiet)
    rows = bench(m, threads=threads, n_prompt=a.n_prompt, n_gen=a.n_gen, repeats=a.repetitions, perf=a.perf,
                 depth=a.depth, kv_type=a.kv_type, progress=not a.quiet)
    for r in rows:
        r["load_seconds"] = m.load_seconds
    if a.json:
        print(json.dumps(rows if len(rows) > 1 else rows[0]))
    else:
        print(format_rows(rows, f"{a.model} [{m.recipe}]"))


def build_parser(with_serve: bool = True) -> argparse.ArgumentParser:
    """with_serve=False leaves out `serve`, whose module (HTTP server) costs start-up time that the
    other commands do not need."""
    p = argparse.ArgumentParser(prog="mixqrt", description="Pure-CPU LLM runtime with mixed-bit ('2356') quantization.")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("doctor", help="CPU, ISA tier, usable / physical cores, pinning order, LLC, NUMA nodes, hugepages")
    s.add_argument("--json", action="store_true")
    s.add_argument("--model", default=None, metavar="FILE",
                   help="also report how much of this .mxq's weights the kernel maps in 2 MiB pages")
    s.add_argument("--recache", action="store_true",
                   help="with --model: read the file into the page cache again in 2 MiB pages (a copied or "
                        "freshly written file sits in 4 KiB ones; decode is faster from 2 MiB pages)")
    s.set_defaults(fn=cmd_doctor)

    s = sub.add_parser("quantize", help="quantize a model with a recipe into a .mxq file")
    s.add_argument("src", help="a .gguf, a Hugging Face folder or a hub id")
    s.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"{DEFAULT_RECIPE} (default: the bytes of every matrix at q4 "
                   "on this model, placed per tensor by the measured per-role sensitivity; a mixture of experts "
                   "gets 2356t's formats), 2356t (2356 with a tied embedding stored once; the default until "
                   "2026-12-05), 2356a (2356t's bytes placed like q4a), 2356, 2356c, 2356+, auto (needs "
                   "--budget-bytes), f32, f16, q8, q4, or an ablation (2356-minmax, 2356-q3u, ...)")
    s.add_argument("--tensor-type", action="append", default=None, metavar="PATTERN=FMT",
                   help="override a tensor's format (regex on the HF name, or a role like ffn_down); repeatable")
    s.add_argument("-o", "--output", default=None, help="output .mxq path")
    s.add_argument("--dry-run", action="store_true", help="plan and size only: a table of tensors, params, formats, bits/weight and bytes per role; write nothing")
    s.add_argument("--imatrix", default=None, metavar="FILE",
                   help="importance matrix from `mixqrt imatrix`: activation-weighted quantization")
    s.add_argument("--calibrate", action="append", default=None, metavar="TEXT|self",
                   help="calibration text for GPTQ error-compensating quantization (docs/quality.md): a text "
                        "file (never the evaluation text), or 'self': text the model samples itself from a "
                        "fixed set of prose, code and chat prompts (seeded, run in memory at q8). Repeat "
                        "to mix: the sources share --calib-tokens evenly (e.g. --calibrate self "
                        "--calibrate tinyshakespeare.txt, recommended with --damp 0.1, docs/quality.md "
                        "§0.4). Recorded in the file's recipe header")
    s.add_argument("--calib-tokens", type=int, default=4096, metavar="N",
                   help="calibration tokens in all (default 4096)")
    s.add_argument("--calib-seed", type=int, default=0, metavar="S",
                   help="sampling seed of --calibrate self (default 0; same seed, same text)")
    s.add_argument("--calib-save", default=None, metavar="FILE",
                   help="also write the text --calibrate self generated to FILE")
    s.add_argument("--damp", type=float, default=0.01, help="GPTQ dampening, fraction of mean diag(H)")
    s.add_argument("--gptq-span", type=int, default=1024, metavar="N",
                   help="GPTQ compensates errors within spans of at most N input columns (a block-diagonal "
                        "Hessian; default 1024). 8192 gives the 0.5B model's ffn_down (4864) its full Hessian "
                        "(KL measured lower, docs/quality.md §0.6) at N^2 x 16 bytes of memory per matrix")
    s.add_argument("--refit", type=int, default=0, metavar="N",
                   help="passes of the (d, m) header refit on the calibration loss after GPTQ (default 0: "
                        "off; it lowers the calibration loss, held-out text measured mixed, docs/quality.md)")
    s.add_argument("--budget-bytes", type=int, default=None, metavar="N",
                   help="with --recipe auto: total tensor bytes to fit (formats picked by measured sensitivity)")
    s.add_argument("--rotate", action="append", default=None, metavar="ROLE=BLOCK|none",
                   help="randomized block Hadamard rotation of a role's weights (e.g. ffn_down=64; the input is "
                        "rotated online to match, docs/quality.md); replaces the recipe's rotations; 'none' "
                        "turns them off (the file then stays readable by mixqrt before rotations); repeatable")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.add_argument("-q", "--quiet", action="store_true")
    s.add_argument("--offline", action="store_true")
    s.set_defaults(fn=cmd_quantize)

    s = sub.add_parser("imatrix", help="collect per-column mean squared activations (llama.cpp's imatrix)")
    s.add_argument("model", help="a .mxq, .gguf, HF folder or hub id (sources are run with --recipe, default q8)")
    s.add_argument("--text", required=True, help="calibration text (UTF-8); not the evaluation text")
    s.add_argument("--recipe", default="q8", help="recipe to run a source model with (default q8)")
    s.add_argument("--chunks", type=int, default=8)
    s.add_argument("--ctx", type=int, default=512)
    s.add_argument("-o", "--output", required=True, help="output .json")
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(fn=cmd_imatrix)

    s = sub.add_parser("inspect", help="per-tensor format, bits/weight, bytes, layout and placement")
    s.add_argument("model")
    s.add_argument("--recipe", default=None, help="for a source model: show the plan for this recipe")
    s.add_argument("--placement", action="store_true", help="print the NUMA/tier placement plan")
    _add_kv_type(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_inspect)

    s = sub.add_parser("upgrade", help="rewrite an older .mxq in the current storage forms, losslessly")
    s.add_argument("input")
    s.add_argument("output")
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(fn=cmd_upgrade)

    s = sub.add_parser("generate", help="generate text from a prompt")
    _add_model(s, optional=True)
    s.add_argument("-p", "--prompt", default=None, help="prompt text (default: read stdin)")
    s.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the model's chat template")
    s.add_argument("--prediction", default=None, metavar="FILE",
                   help="text the reply is expected to repeat (the file being edited): drafts are copied from it "
                        "first (OpenAI's `prediction`; speculative decoding, the output unchanged; "
                        "docs/speculative.md)")
    s.add_argument("--suffix", default=None, metavar="TEXT",
                   help="fill in the middle: the prompt is the text before the cursor, TEXT the text after it "
                        "(the model's FIM tokens; llama.cpp's /infill prompt, docs/completion.md)")
    _add_sampling(s)
    s.set_defaults(fn=cmd_generate)

    s = sub.add_parser("chat", help="interactive chat with the model's chat template")
    _add_model(s, optional=True)
    s.add_argument("--system", default=None, help="system prompt")
    _add_sampling(s)
    s.set_defaults(fn=cmd_chat)

    s = sub.add_parser("ppl", help="perplexity (llama-perplexity's method) and KL divergence against a base")
    s.add_argument("model")
    s.add_argument("--recipe", default=None)
    s.add_argument("--text", required=True, help="UTF-8 text file, e.g. wikitext-2 test")
    s.add_argument("--ctx", type=int, default=512)
    s.add_argument("--chunks", type=int, default=None, help="score only the first N chunks")
    s.add_argument("--parse-special", action="store_true",
                   help="read special-token text in the file (\"<unk>\", \"<|endoftext|>\") as those tokens "
                        "(default: the text is data, encoded as text, as llama-perplexity does)")
    s.add_argument("--save-logits", default=None, metavar="FILE", help="save log-probs for a later --kl-base")
    s.add_argument("--kl-base", default=None, metavar="FILE", help="compare with a base model's saved log-probs")
    _add_kv_type(s, "f32: the model itself; name a type to measure that cache")
    s.add_argument("--json", action="store_true")
    s.add_argument("-t", "--threads", type=int, default=None)
    s.add_argument("-q", "--quiet", action="store_true")
    s.add_argument("--offline", action="store_true")
    s.set_defaults(fn=cmd_ppl)

    s = sub.add_parser(
        "bench", help="pp/tg tokens/s, TTFT, peak RSS, bytes/token vs read bandwidth",
        description="llama-bench-style speed table. Per thread count: prompt processing (pp) of an N_PROMPT-token "
                    "prompt, time to first token of a 128-token prompt, N_GEN greedy decode steps (tg); medians "
                    "of REPETITIONS. The read bandwidth is the best of 3 probes (1 GiB) before and 3 after the "
                    "timed runs; bandwidth ratio = tg tok/s x bytes per decode step / that bandwidth (a routed expert "
                    "counts top_k / num_experts of its bytes). Peak RSS counts from after the first probe (its "
                    "buffer is freed); RSS and the model file's resident pages are reported after the warm-up and "
                    "after the first repetition's decode steps, against the file's size.")
    s.add_argument("model")
    s.add_argument("--recipe", default=None, help=f"recipe when MODEL needs quantizing (default {DEFAULT_RECIPE})")
    s.add_argument("-t", "--threads", default="2", help="comma list of thread counts (default 2)")
    s.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens for pp (default 512)")
    s.add_argument("-n", "--n-gen", type=int, default=128, help="decode steps for tg (default 128)")
    s.add_argument("-r", "--repetitions", type=int, default=3, help="repetitions, median reported (default 3)")
    s.add_argument("-d", "--depth", type=int, default=0, metavar="N",
                   help="llama-bench's -d: N tokens of context are in the KV cache before every timed run "
                        "(filled once, not timed; default 0)")
    _add_kv_type(s)
    s.add_argument("--perf", action="store_true", help="cache-misses per instruction (perf_event_open)")
    s.add_argument("--json", action="store_true")
    s.add_argument("-q", "--quiet", action="store_true")
    s.add_argument("--offline", action="store_true")
    s.set_defaults(fn=cmd_bench)

    if with_serve:
        from mixqrt.serving.server import add_serve_parser
        add_serve_parser(sub)
    return p


def main(argv=None) -> int:
    from mixqrt.errors import MixqrtError
    argv = sys.argv[1:] if argv is None else list(argv)
    light = build_parser(with_serve=False)
    known = next(a for a in light._actions if isinstance(a, argparse._SubParsersAction)).choices
    args = (light if argv and argv[0] in known else build_parser()).parse_args(argv)
    if args.cmd == "quantize" and not args.dry_run and not args.output:
        build_parser().error("quantize needs -o OUTPUT (or --dry-run)")
    if args.cmd == "quantize" and (args.recipe == "auto") != (args.budget_bytes is not None):
        build_parser().error("--recipe auto needs --budget-bytes N (and --budget-bytes needs --recipe auto)")
    if args.cmd == "doctor" and args.recache and not args.model:
        build_parser().error("doctor --recache needs --model FILE")
    from mixqrt.io.atomic import Terminated, terminate_as_interrupt
    terminate_as_interrupt()             # SIGTERM unwinds like Ctrl-C: temp files are removed
    try:
        args.fn(args)
    except MixqrtError as e:
        print(f"mixqrt: error: {e}", file=sys.stderr)
        return 2
    except Terminated:
        return 143
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
