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
