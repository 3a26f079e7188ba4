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
