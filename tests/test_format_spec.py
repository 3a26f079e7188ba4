"""The format spec has one home: src/common/mq_format.h. Every extension and Python module reads
ids and block sizes from it; this checks they agree and that no second definition crept back."""
import pathlib
import re

import numpy as np

from mixqrt._kernels import _format, _quant
from mixqrt.formats import codec as formats, layout

ROOT = pathlib.Path(__file__).resolve().parents[1] / "mixqrt"


def test_python_reads_the_header():
    table = _format.format_table()
    assert [t[0] for t in table] == list(range(len(table)))
    assert layout.FMT_ID == {name: fid for fid, name, *_ in table}
    for fid, name, bits, group, header, block_bytes, trailer, pack in table:
        if name in layout.PACKED:
            lay = layout.PACKED[name]
            assert (lay.bits, lay.group, lay.header, lay.block_bytes, lay.trailer, lay.pack) == (
                bits, group, header, block_bytes, trailer, pack)
            assert pack == (layout.PACK3C if name == "q3p" else bits)
            assert fid < _format.NPACKED
        elif name in layout.INTERLEAVED:   # a storage form of another packed format: its block sizes
            base = layout.PACKED[layout.INTERLEAVED[name][0]]
            assert (base.bits, base.group, base.header, base.block_bytes, base.pack) == (bits, group, header, block_bytes, pack)
            assert fid < _format.NPACKED and layout.INTERLEAVED[name][1] == _format.XROWS
        else:
            assert layout.PLAIN[name].itemsize == block_bytes and fid >= _format.NPACKED
    assert _quant.NFMT == len(table)
    assert sorted(_quant.SEARCH_IDS) == sorted(layout.FMT_ID[f] for f in formats.SEARCH_FORMATS)


def test_one_definition_in_the_source_tree():
    c_files = list((ROOT / "_kernels" / "src").rglob("*.[ch]"))
    py_files = [p for p in ROOT.rglob("*.py*") if p.suffix in (".py", ".pyx", ".pxd")]
    enum = [p.name for p in c_files if re.search(r"\benum\s+mq_fmt\b", p.read_text())]
    assert enum == ["mq_format.h"]
    for p in c_files:   # block strides by name, never as numbers next to a format
        if p.name != "mq_format.h":
            assert not re.search(r"\bMQ_(Q\d\w*|F32|F16|BF16|NFMT)\s*=(?!=)|#define\s+MQ_(Q\d|F32|F16|BF16|CHUNK)",
                                 p.read_text()), p
    for p in py_files:  # no {"q8": 0, ...} id tables, no (34, 26, ...) stride tuples
        text = p.read_text()
        assert not re.search(r"[\"']q8[\"']\s*:\s*0\s*,\s*[\"']q6[\"']\s*:\s*1", text), p
        assert not re.search(r"\b34,\s*26,\s*20\b", text), p


def test_old_ids_are_not_stored():
    """Format ids are internal: a .mxq names formats by string, so renumbering keeps old files loadable."""
    qt = formats.quantize(np.ones((2, 64), np.float32), "q3p")
    assert qt.fmt == "q3p"


def test_one_traits_table():
    """layout.TRAITS joins the C table and one Python row per format; the per-format lists of the other
    modules are read from it (their values as they were when each kept its own list)."""
    from mixqrt.formats import rotation
    from mixqrt.quantize import gptq, recipes
    specs = {r["name"]: r for r in _format.format_specs()}
    assert set(layout.TRAITS) == set(specs) == {r[0] for r in layout._ROWS}
    for name, t in layout.TRAITS.items():
        c = specs[name]
        assert (t.id, t.bits, t.group, t.header, t.block_bytes, t.trailer, t.pack, t.off) == (
            c["id"], c["bits"], c["group"], c["header"], c["block_bytes"], c["trailer"], c["pack"], c["off"])
        assert t.packed == (t.id < _format.NPACKED) and (t.dtype is None) == t.packed
    assert layout.INTERLEAVED == {"q4x": ("q4", 16), "q6x": ("q6", 16), "q3x": ("q3p", 16)}
    assert set(formats.SEARCH_FORMATS) == {"q6", "q4", "q3u", "q3p"}
    assert gptq.GPTQ_FORMATS == ("q3p", "q3u", "q4", "q6", "q8")
    assert list(formats.FORMATS) == ["q2c", "q3p", "q3u", "q4", "q5g", "q6", "q8", "f16", "bf16", "f32"]
    assert {f: (g.bits, g.kind) for f, g in formats.FORMATS.items()} == {
        "q2c": (2, "codebook"), "q3p": (3, "piecewise"), "q3u": (3, "uniform"), "q4": (4, "uniform"),
        "q5g": (5, "global"), "q6": (6, "symmetric"), "q8": (8, "symmetric"), "f16": (16, "plain"),
        "bf16": (16, "plain"), "f32": (32, "plain")}
    assert {f for f in layout.TRAITS if recipes._vector_ok(f)} == {"f32", "f16", "bf16", "q5g", "q8"}
    assert {f for f in layout.TRAITS if rotation.rotatable(f, (32, 64))} == (
        set(layout.PACKED) | set(layout.INTERLEAVED)) - {"q5g"}
    assert not rotation.rotatable("q4", (64,)) and not rotation.rotatable("nope", (2, 2))
    assert {f for f, t in layout.TRAITS.items() if t.fp16_range and t.base is None} == (
        set(layout.PACKED) - {"q5g"}) | {"f16"}
