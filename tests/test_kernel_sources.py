"""The kernel sources' include graph: no include circle, and the SIMD tiers stay apart.

Read from the text of mixqrt/_kernels/src (quoted #include lines, resolved as the build does: the
file's own folder, then src/common, then the extension's folder). A product tier (kern_generic*,
kern_*avx2*, kern_*avx512*) and a tier of the float ops or the bandwidth probe (*_generic.c, *_avx2.c,
*_avx512.c) may include shared headers and its own tier's headers only: never a dispatcher (dispatch.c,
misc.c, bw.c and the public header mq_ops.h), another tier's header, or a .c file. Only the
dispatcher sees every tier. No tier calls back into the dispatcher or the generic tier either.
"""
import re
from pathlib import Path

# the checkout's sources (an installed wheel carries none)
SRC = Path(__file__).resolve().parents[1] / "mixqrt" / "_kernels" / "src"
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
TIERS = ("generic", "avx2", "avx512")
DISPATCH = {"dispatch.c", "misc.c", "bw.c", "mq_ops.h"}


def _files():
    return {p.relative_to(SRC).as_posix(): p for p in sorted(SRC.rglob("*.[ch]"))}


FILES = _files()


def _resolve(src: str, name: str) -> str:
    folder = src.rsplit("/", 1)[0]
    for cand in (f"{folder}/{name}", f"common/{name}"):
        if cand in FILES:
            return cand
    raise AssertionError(f"{src}: #include \"{name}\" matches no file under src/ (own folder or common/)")


def graph() -> dict[str, set[str]]:
    return {f: {_resolve(f, n) for n in INCLUDE.findall(p.read_text())} for f, p in FILES.items()}


def tier_of(path: str):
    stem = path.rsplit("/", 1)[-1].rsplit(".", 1)[0]
    for t in TIERS:
        if stem.endswith("_" + t) or f"_{t}_" in stem:
            return t
    return None


def _closure(g, start):
    seen, todo = set(), [start]
    while todo:
        for n in g[todo.pop()]:
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def cycles(g) -> list[list[str]]:
    out, state = [], {}

    def visit(n, stack):
        state[n] = 1
        stack.append(n)
        for m in sorted(g[n]):
            if state.get(m) == 1:
                out.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m, stack)
        stack.pop()
        state[n] = 2

    for n in sorted(g):
        if n not in state:
            visit(n, [])
    return out


def test_sources_found():
    assert "ops/dispatch.c" in FILES and "ops/kern_generic.c" in FILES and "ops/shared.c" in FILES
    assert {tier_of(f) for f in FILES} >= set(TIERS)


def test_no_include_circle():
    assert cycles(graph()) == []


def test_cycle_finder_finds_one():
    assert cycles({"a.h": {"b.h"}, "b.h": {"c.h"}, "c.h": {"a.h"}}) == [["a.h", "b.h", "c.h", "a.h"]]


def test_tiers_include_no_dispatcher_no_other_tier_no_c_file():
    g = graph()
    for f in FILES:
        t = tier_of(f)
        if t is None:
            continue
        for inc in _closure(g, f):
            name = inc.rsplit("/", 1)[-1]
            assert name not in DISPATCH, f"{f} includes the dispatcher's {inc}"
            assert not name.endswith(".c"), f"{f} includes the C file {inc}"
            assert tier_of(inc) in (None, t), f"{f} ({t} tier) includes {inc} ({tier_of(inc)} tier)"


def test_only_the_dispatcher_sees_every_product_tier():
    g = graph()
    for f in FILES:
        seen = {tier_of(i) for i in _closure(g, f) if i.rsplit("/", 1)[-1].startswith("kern_")}
        if seen >= set(TIERS):
            assert f == "ops/dispatch.c", f"{f} sees every tier's header"
    assert {tier_of(i) for i in g["ops/dispatch.c"]} >= set(TIERS)


def test_tiers_do_not_call_back():
    """A tier names no dispatcher entry (mq_mm_rows, mq_quantize_act_rows, ...) and no other tier's function."""
    entry = re.compile(r"\bmq_(mm_rows|quantize_act_rows|gemm_shared_gt|gemm_act_bytes|gemm_interleave|"
                       r"gemm_tiles_build)\s*\(")
    for f, p in FILES.items():
        t = tier_of(f)
        if t is None or not f.startswith("ops/kern_"):
            continue
        text = re.sub(r"/\*.*?\*/", "", p.read_text(), flags=re.S)
        assert not entry.search(text), f"{f} calls a dispatcher entry: {entry.search(text).group(0)}"
        for other in TIERS:
            if other != t:
                assert not re.search(rf"\bmq_\w+_{other}\s*\(", text), f"{f} calls into the {other} tier"


# ---------------------------------------------------------------------------- the call graph between files
# A function defined in a .c file (not static) or in a header belongs to its unit: the folder and the
# file's stem, so quant.c and quant.h are one unit. A unit calls another when one of its .c files names a
# function the other defines (a header is an interface: what its inline functions call counts for the
# files that include it). No two units call each other, directly or around a circle.
_DEF = re.compile(r"^(?:[A-Za-z_][\w \t\*]*?|(?:static\s+)?inline\s+__attribute__\(\([^)]*\)\)\s*[\w \t\*]+?\n)"
                  r"\b([A-Za-z_]\w*)\s*\([^;{}]*\)\s*\{", re.M)


def _text(p: Path) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", p.read_text(), flags=re.S))


def _unit(f: str) -> str:
    return f.rsplit(".", 1)[0]


_PASTED = re.compile(r"\b([A-Za-z_]\w*)##\w+")                      # a name a macro pastes: prefix##name
_PASTED_DEF = re.compile(r"\b([A-Za-z_]\w*)##\w+\s*\([^;{}]*\)\s*\{")   # ... that the macro defines


def call_graph(files=None) -> dict[str, set[str]]:
    files = FILES if files is None else files
    owner, local = {}, {}
    for f, p in files.items():
        text = _text(p)
        local[f] = set()
        for m in _DEF.finditer(text):
            name = m.group(1)
            if name in ("if", "for", "while", "switch", "return", "sizeof"):
                continue
            local[f].add(name)
            if not (f.endswith(".c") and m.group(0).lstrip().startswith("static")):   # static: file-local
                owner.setdefault(name, _unit(f))
        if f.endswith(".c"):
            for prefix in _PASTED_DEF.findall(text):
                owner.setdefault(prefix + "##", _unit(f))
    out: dict[str, set[str]] = {_unit(f): set() for f in files}
    for f, p in files.items():
        if not f.endswith(".c"):
            continue
        text = _text(p)
        names = set(re.findall(r"\b([A-Za-z_]\w*)\s*\(", text)) - local[f]
        names |= {prefix + "##" for prefix in _PASTED.findall(text)}
        for name in names:
            u = owner.get(name)
            if u is not None and u != _unit(f):
                out[_unit(f)].add(u)
    return out


def test_call_graph_finds_the_definitions():
    g = call_graph()
    assert "quant/kmeans" in g["quant/quant"]                       # mq_q2c_block
    assert "ops/kern_base_avx512" in g["ops/kern_avx512"]           # ctx_init
    assert {"ops/kern_mv_avx512", "ops/kern_gemm_avx512"} <= g["ops/kern_avx512"]   # the traits table's entries
    assert "ops/kern_mv_avx512" not in g["ops/kern_gemm_avx512"] and "ops/kern_avx512_impl" not in g["ops/kern_avx2"]


def test_no_two_kernel_files_call_each_other():
    g = call_graph()
    assert cycles(g) == [], "files that call each other: " + "; ".join(" -> ".join(c) for c in cycles(g))


# ---------------------------------------------------------------------------- a format's rows in every tier
def _packed_formats() -> list[str]:
    enum = re.search(r"enum mq_fmt \{(.*?)\};", FILES["common/mq_format.h"].read_text(), re.S).group(1)
    ids = re.findall(r"\b(MQ_\w+)\s*,", re.sub(r"/\*.*?\*/", "", enum, flags=re.S))   # in id order, no explicit values
    return ids[:ids.index("MQ_F32")]


def _format_list(macro: str) -> list[str]:
    """The format ids an X-macro list of mq_format.h names (MQ_FOR_ROW_FORMATS, MQ_FOR_X_FORMATS)."""
    text = FILES["common/mq_format.h"].read_text().replace("\\\n", " ")
    m = re.search(rf"#define {macro}\(X\)(.*)", text)
    return re.findall(r"X\(\w+,\s*(MQ_\w+)\)", m.group(1))


def _table(path: str, name: str) -> str:
    text = _text(FILES[path])
    m = re.search(rf"\b{name}\s*\[MQ_NFMT\]\s*=\s*\{{(.*?)\n\}};", text, re.S)
    assert m, f"{path}: no traits table {name}"
    return m.group(1)


def test_every_packed_format_has_a_traits_row_in_every_tier():
    """docs/architecture.md, "Adding a format": a format's kernels are its rows in the tiers' traits
    tables. Every packed format of mq_format.h has one in the AVX-512 and AVX2 tables (the generic tier
    reads its MQ_FORMATS row: packing, header, levels), and no tier file routes a product by a switch
    on the format."""
    fmts = _packed_formats()
    assert "MQ_Q4" in fmts and "MQ_F32" not in fmts
    assert sorted(_format_list("MQ_FOR_ROW_FORMATS") + _format_list("MQ_FOR_X_FORMATS")) == sorted(fmts), \
        "mq_format.h's format lists name every packed format once"
    for path, table in (("ops/kern_avx512.c", "MQ_AVX512_TRAITS"), ("ops/kern_avx2.c", "AVX2_TRAITS")):
        body = _table(path, table)
        rows = set(re.findall(r"\[(MQ_\w+)\]\s*=", body))
        for macro in ("MQ_FOR_ROW_FORMATS", "MQ_FOR_X_FORMATS"):   # a row per format the list names
            if re.search(rf"\b{macro}\s*\(", body):
                rows |= set(_format_list(macro))
        assert rows == set(fmts), f"{table}: formats without a row {set(fmts) - rows}, unknown {rows - set(fmts)}"
    generic = _text(FILES["ops/kern_generic.c"])
    assert "MQ_FORMATS[j->fmt]" in generic and not re.search(r"\bMQ_Q\w+", generic), \
        "the portable tier names no format: it reads the traits row"
    for f, p in FILES.items():
        if f.startswith("ops/kern_") and f.endswith(".c"):
            assert not re.search(r"switch\s*\(\s*j->fmt\s*\)", _text(p)), f"{f} routes by a switch on the format"
