"""Packed byte layout of every quantized format: the contract between quantizers and kernels.

All packed formats are row-major. A tensor of shape [N, K] is N rows; each row holds
nb = ceil(K / G) blocks of G weights (G = the format's group size, a multiple of 32). The last
block of a row is padded with code 0 up to G; padded weights are never returned by dequantize and
kernels pair them with zero activations. A block is a small header (scales) followed by G/32
*chunks*, each chunk holding 32 codes packed so that a 256-bit register unpacks one chunk and a
512-bit register two, with nothing but a broadcast, a shift by (0, 2, 4, 6) per qword and a mask:

  pack2  8 B : byte i = c[i] | c[i+8] << 2 | c[i+16] << 4 | c[i+24] << 6            (i < 8)
  pack3 12 B : pack2(c & 3) then u32 little-endian, bit i = bit 2 of c[i]
  pack4 16 B : byte i = c[i] | c[i+16] << 4                                          (i < 16)
  pack5 20 B : pack4(c & 15) then u32 little-endian, bit i = bit 4 of c[i]
  pack6 24 B : pack4(c & 15) then pack2(c >> 4)
  pack8 32 B : the codes as int8
  pack3c 12 B: code i at bits 3i..3i+2 of the 96-bit little-endian integer (q3p, .mxq version 2 on:
               a 64-code block is 24 contiguous bytes that AVX-512 unpacks with one vpermb, one
               vpmultishiftqb and one vpermb level lookup; docs/kernels.md)

Block headers (fp16 little-endian; values decode as w = d * L[q] + m, computed in float32 as one
multiply and one add, which is what every C tier does too):

  q8   G=32  : d                        L[q] = q (signed int8), m = 0          34 B = 8.5 bpw
  q6   G=32  : d                        L[q] = q - 32 (codes 0..63), m = 0     26 B = 6.5 bpw
  q4   G=32  : d, m                     L[q] = q                               20 B = 5.0 bpw
  q3u  G=64  : d, m                     L[q] = q                               28 B = 3.5 bpw
  q3p  G=64  : d, m                     L[q] = Q3P_LEVELS[q] (fixed u8 table)  28 B = 3.5 bpw, pack3c
  q2c  G=128 : d, m, lut u8[4]          L[q] = lut[q] (per-block codebook)     40 B = 2.5 bpw
  q5g  G=32  : no header; the tensor ends with 8 bytes (lo, hi) float32, and
               w = lo + q * ((hi - lo) / 31)                                   20 B/32 + 8 B

Row-interleaved storage (mq_format.h has the byte maps). q4x is q4 (same blocks, same values, same
size) with the rows interleaved in groups of XROWS = 16 for the decode kernels: rows [16g, 16g + 16),
chunk c is 320 bytes at (g * nc + c) * 320: the 16 rows' d (fp16), their m (fp16), then for s < 4 and
r < 16 the bytes 4s..4s+3 of row r's pack4 chunk. q6x is q6 the same way (d, then the pack4 words,
then the pack2 words of the 16 rows: 416 bytes per chunk). q3x is q3p, per 64-weight block 448
bytes: d, m of the 16 rows, then six code planes whose bytes hold two whole codes (bits 0-2 and
3-5) and a part of a third (bits 6-7), so that 12 of a block's 16 steps (4 codes of each of the 16
rows) are one vpermb level lookup on a plane as loaded and 4 are a shift, a bit select and a vpermb
(.mxq version 5; version 4's q3x, a 2-bit and a 1-bit plane, is read only by ``mxq.upgrade``).
Such a tensor is 2-D with a multiple of 16 rows; ``storage_format`` says which q4 / q6 / q3p tensors
are stored so (.mxq version 4), ``to_interleaved`` / ``from_interleaved`` convert the bytes. They are
not quantization formats of their own: recipes name q4, q6 and q3p.

Format ids and block sizes are defined once, in the C header src/common/mq_format.h (with
static_asserts on every block size); this module reads them from the extension (``_format``), so C
kernels, quantizers and Python cannot drift apart. The packing and dequantization code below is
numpy only and is the reference the C packers are checked against.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mixqrt.errors import QuantError

try:
    from mixqrt._kernels import _format
except ImportError as e:  # pragma: no cover - a source tree that was never built
    raise ImportError("mixqrt's C extensions are not built (pip install ., or python setup.py build_ext "
                      "--inplace): the format spec lives in them") from e

CHUNK = _format.CHUNK

# Unsigned integer levels of q3p: fine steps near the centre, coarse on the tails (see docs/quant-formats.md
# for how they were chosen). Kernels receive this table as an argument, so it can change freely.
# Measured (benchmarks/formats.py): Lloyd-Max levels of the per-group normalised FFN weights of
# Qwen2.5-Coder-0.5B, endpoints pinned to 0 and 63; the article's fine-centre table
# [0,8,13,16,19,22,27,35] was worse than uniform (docs/quant-formats.md, section l). Top 63 keeps u8*s8 pair sums (vpmaddubsw) far from int16 saturation.
Q3P_LEVELS = np.array([0, 12, 20, 28, 35, 43, 51, 63], dtype=np.uint8)
Q3P_LEVEL_MAX = _format.Q3P_LEVEL_MAX     # kernels' bound on any q3p level table (int16-safe pairs)
if Q3P_LEVELS.size != _format.Q3P_NLEVELS or Q3P_LEVELS.max() > Q3P_LEVEL_MAX:
    raise ImportError("Q3P_LEVELS does not fit the kernels' q3p table (mq_format.h)")


def q3p_table(levels, error=QuantError) -> np.ndarray:
    """A q3p level table from a tensor's meta or a file header as uint8, checked as the kernels and
    the reference decoder index it (Q3P_LEVELS.size integers in [0, Q3P_LEVEL_MAX]): a short table
    would be read past, an out-of-range value would wrap. Raises `error` naming the table."""
    try:
        a = np.asarray(levels)
    except (ValueError, TypeError):                 # ragged nesting
        a = np.zeros(0)
    if a.shape != Q3P_LEVELS.shape or a.dtype.kind not in "iu" or int(a.min()) < 0 or int(a.max()) > Q3P_LEVEL_MAX:
        raise error(f"q3p level table must be {Q3P_LEVELS.size} integers in [0, {Q3P_LEVEL_MAX}], "
                    f"got {str(levels)[:80]}")
    return np.ascontiguousarray(a, dtype=np.uint8)


@dataclass(frozen=True)
class Layout:
    name: str
    bits: int
    group: int          # weights per block
    header: int         # header bytes per block
    chunk_bytes: int    # bytes per 32 codes
    trailer: int = 0    # bytes after all rows (q5g: lo, hi)
    pack: int = 0       # chunk packing id: bits, or PACK3C

    @property
    def block_bytes(self) -> int:
        return self.header + (self.group // CHUNK) * self.chunk_bytes

    def blocks_per_row(self, k: int) -> int:
        return -(-k // self.group)

    def row_bytes(self, k: int) -> int:
        return self.blocks_per_row(k) * self.block_bytes

    def nbytes(self, shape) -> int:
        n, k = rows_cols(shape)
        return n * self.row_bytes(k) + self.trailer


PACK3C = _format.PACK3C
XROWS = _format.XROWS
NPACKED = _format.NPACKED             # kernel format ids below this are packed (q4x included)


@dataclass(frozen=True)
class Traits:
    """Everything mixqrt's Python side knows about one format. The first fields are the C table's
    (mq_format.h, through _format.format_specs), the rest the Python row in _ROWS below."""
    name: str
    id: int                 # the kernels' format id (internal, never stored)
    bits: int
    group: int              # weights per block (1: plain)
    header: int
    block_bytes: int        # bytes per block (plain: per value)
    trailer: int
    pack: int
    off: int                # the kernels' level offset (U = L + off)
    levels: str             # how the codes become levels U: codes | signed | table | block_lut (_format.LEVELS)
    base: str | None        # a row-interleaved storage form: the format whose blocks it holds
    kind: str               # uniform | symmetric | piecewise | codebook | global | plain | interleaved
    fp16_range: bool        # its scales (or values) are fp16: |w| must stay within 65504
    rotatable: bool         # may be stored Hadamard-rotated (a 2-D tensor; mixqrt.formats.rotation)
    searchable: bool        # quantize(search=True) fits its headers (formats.SEARCH_FORMATS)
    gptq: bool              # gptq_quantize takes it (gptq.GPTQ_FORMATS)
    vector: bool            # may hold a 1-D norm / bias vector (recipes)
    dtype: str | None       # plain formats: the numpy dtype of the stored values

    @property
    def packed(self) -> bool:
        return self.id < NPACKED


# One Python row per format, beside its C block in mq_format.h (the import fails if the two tables
# name different formats). Adding a format: docs/architecture.md, "Adding a format".
#      name    kind           fp16   rotate search gptq   vector dtype
_ROWS = (
    ("q2c",  "codebook",    True,  True,  False, False, False, None),
    ("q3p",  "piecewise",   True,  True,  True,  True,  False, None),
    ("q3u",  "uniform",     True,  True,  True,  True,  False, None),
    ("q4",   "uniform",     True,  True,  True,  True,  False, None),
    ("q5g",  "global",      False, False, False, False, True,  None),
    ("q6",   "symmetric",   True,  True,  True,  True,  False, None),
    ("q8",   "symmetric",   True,  True,  False, True,  True,  None),
    ("f16",  "plain",       True,  False, False, False, True,  "<f2"),
    ("bf16", "plain",       False, False, False, False, True,  "<u2"),
    ("f32",  "plain",       False, False, False, False, True,  "<f4"),
    ("q4x",  "interleaved", True,  True,  False, False, False, None),
    ("q6x",  "interleaved", True,  True,  False, False, False, None),
    ("q3x",  "interleaved", True,  True,  False, False, False, None),
)


def build_traits(spec_rows, rows) -> dict[str, Traits]:
    """The traits table: the C rows (dicts as _format.format_specs gives them) joined with the Python
    rows (as _ROWS); ImportError if the two name different formats."""
    specs = {r["name"]: r for r in spec_rows}
    if any("levels" not in r for r in specs.values()):
        raise ImportError("mixqrt's C extensions are older than its Python code (no level kind in the format "
                          "table): rebuild them (python setup.py build_ext --inplace)")
    names = {r[0] for r in rows}
    if names != set(specs):
        raise ImportError(f"the format tables differ: mq_format.h has {sorted(set(specs) - names)} without a "
                          f"row in layout._ROWS, _ROWS has {sorted(names - set(specs))} without a C block")
    by_id = {r["id"]: n for n, r in specs.items()}
    out = {}
    for name, kind, fp16, rot, search, gptq, vector, dtype in rows:
        c = specs[name]
        out[name] = Traits(name, c["id"], c["bits"], c["group"], c["header"], c["block_bytes"], c["trailer"],
                           c["pack"], c["off"], c["levels"], by_id.get(c["base"]), kind, fp16, rot, search,
                           gptq, vector, dtype)
    return out


def packed_layouts(traits: dict[str, Traits]) -> dict[str, Layout]:
    """The row formats' layouts (PACKED) of a traits table, in id order; ImportError where the C block
    size is not the one computed here."""
    out = {t.name: Layout(t.name, t.bits, t.group, t.header, t.bits * CHUNK // 8, t.trailer, t.pack)
           for t in sorted(traits.values(), key=lambda t: t.id) if t.packed and t.base is None}
    for t in traits.values():
        if t.packed and out[t.base or t.name].block_bytes != t.block_bytes:
            raise ImportError(f"format {t.base or t.name}: mq_format.h says {t.block_bytes} bytes per block, "
                              "layout.py computes otherwise")
    return out


TRAITS: dict[str, Traits] = build_traits(_format.format_specs(), _ROWS)
FMT_ID = {t.name: t.id for t in sorted(TRAITS.values(), key=lambda t: t.id)}   # the kernels' ids, in id order
# row-interleaved storage forms: name -> (the format whose blocks it holds, rows per group)
INTERLEAVED = {n: (t.base, XROWS) for n, t in TRAITS.items() if t.base is not None}
_XPERM = {"q4x": (2, 4), "q6x": (1, 6)}   # byte-permuted forms: 2-byte header fields, 4-byte code words per block
_STORED_AS = {base: name for name, (base, _g) in INTERLEAVED.items()}
PACKED = packed_layouts(TRAITS)
# plain formats: the numpy view of their values (bf16 as raw u16 bits)
PLAIN = {t.name: np.dtype(t.dtype) for t in sorted(TRAITS.values(), key=lambda t: t.id) if not t.packed}
for _t in TRAITS.values():   # the header's value sizes are what we compute
    if not _t.packed and PLAIN[_t.name].itemsize != _t.block_bytes:
        raise ImportError(f"format {_t.name}: mq_format.h says {_t.block_bytes} bytes per value, numpy {_t.dtype}")


def rows_cols(shape) -> tuple[int, int]:
    """[K] -> (1, K); [N, K] -> (N, K); higher ranks flatten the leading axes into rows."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        raise QuantError("cannot quantize a 0-d tensor; expected at least 1 dimension")
    if any(s <= 0 for s in shape):
        raise QuantError(f"shape {shape} has an empty or negative dimension")
    k = shape[-1]
    n = 1
    for s in shape[:-1]:
        n *= s
    return n, k


def expected_nbytes(fmt: str, shape) -> int:
    """Exact packed size of a tensor of `shape` in `fmt` (the .mxq reader checks spans with this)."""
    if fmt in INTERLEAVED:
        base, g = INTERLEAVED[fmt]
        if len(tuple(shape)) != 2 or int(shape[0]) % g:
            raise QuantError(f"{fmt} stores [N, K] tensors with N a multiple of {g}, not shape {tuple(shape)}")
        return PACKED[base].nbytes(shape)
    if fmt in PACKED:
        return PACKED[fmt].nbytes(shape)
    if fmt in PLAIN:
        n, k = rows_cols(shape)
        return n * k * PLAIN[fmt].itemsize
    raise QuantError(f"unknown format {fmt!r}")


def storage_format(fmt: str, shape) -> str:
    """The form a tensor quantized to `fmt` is stored in: q4 / q3p matrices with a multiple of XROWS
    rows as q4x / q3x (the row-interleaved decode layouts), everything else as quantized."""
    shape = tuple(shape)
    if fmt in _STORED_AS and len(shape) == 2 and shape[0] % XROWS == 0:
        return _STORED_AS[fmt]
    return fmt


def to_interleaved(fmt: str, data, shape) -> np.ndarray:
    """Bytes of a q4 / q6 / q3p [N, K] tensor (N % 16 == 0) -> the same blocks stored as fmt (q4x /
    q6x / q3x)."""
    if fmt in _XPERM:
        return _xperm(fmt, data, shape)
    if fmt != "q3x":
        raise QuantError(f"{fmt!r} is not a row-interleaved format")
    b, n, k = _bytes_of(fmt, data, shape, "q3p")
    p = disassemble("q3p", (n, k), b)
    return _q3x_parts(p.codes, p.d, p.m, n, PACKED["q3p"].blocks_per_row(k))


def from_interleaved(fmt: str, data, shape) -> np.ndarray:
    """Inverse of to_interleaved: q4x / q6x / q3x bytes -> q4 / q6 / q3p bytes (uint8 array)."""
    if fmt in _XPERM:
        return _xperm(fmt, data, shape, inverse=True)
    if fmt != "q3x":
        raise QuantError(f"{fmt!r} is not a row-interleaved format")
    b, n, k = _bytes_of(fmt, data, shape, fmt)
    codes, d, m = _q3x_unparts(b, n, PACKED["q3p"].blocks_per_row(k))
    return np.frombuffer(assemble("q3p", (n, k), Parts(codes=codes, d=d, m=m)), dtype=np.uint8)


def _q3x_parts(codes, d, m, n, nb):
    """q3p parts (codes [N, nb, 64], d, m [N, nb] fp16) -> q3x bytes (mq_format.h, .mxq version 5:
    six code planes; byte (w, r, j) holds code 8w + j in bits 0-2, 8w + 4 + j in bits 3-5, and in
    bits 6-7 the low bits (w < 4) or the bit 2 (w = 4, 5) of codes 48 + 4i + j)."""
    G = n // XROWS
    c = codes.reshape(G, XROWS, nb, 16, 4).astype(np.uint8)              # [g, r, b, step, j]
    planes = c[:, :, :, 0:12:2] | (c[:, :, :, 1:12:2] << 3)               # [g, r, b, w, j], w < 6
    tail = c[:, :, :, 12:16]                                             # steps 12-15
    planes[:, :, :, 0:4] |= (tail & 3) << 6
    hi = (tail >> 2) & 1
    planes[:, :, :, 4] |= (hi[:, :, :, 0] << 6) | (hi[:, :, :, 1] << 7)
    planes[:, :, :, 5] |= (hi[:, :, :, 2] << 6) | (hi[:, :, :, 3] << 7)
    codes_b = planes.transpose(0, 2, 3, 1, 4).reshape(G, nb, 384)         # [g, b, w, r, j]
    dd = np.ascontiguousarray(np.asarray(d, dtype="<f2").reshape(G, XROWS, nb).transpose(0, 2, 1)).view(np.uint8)
    mm = np.ascontiguousarray(np.asarray(m, dtype="<f2").reshape(G, XROWS, nb).transpose(0, 2, 1)).view(np.uint8)
    return np.ascontiguousarray(np.concatenate([dd, mm, codes_b], axis=-1)).reshape(-1)


def _q3x_header(g, n, nb):
    G = n // XROWS
    d = np.ascontiguousarray(g[..., 0:32]).view("<f2").reshape(G, nb, XROWS).transpose(0, 2, 1).reshape(n, nb)
    m = np.ascontiguousarray(g[..., 32:64]).view("<f2").reshape(G, nb, XROWS).transpose(0, 2, 1).reshape(n, nb)
    return d, m


def _q3x_unparts(b, n, nb):
    """q3x bytes -> (codes [N, nb, 64], d, m [N, nb] fp16)."""
    G = n // XROWS
    g = b.reshape(G, nb, 448)
    d, m = _q3x_header(g, n, nb)
    p = g[..., 64:448].reshape(G, nb, 6, XROWS, 4).transpose(0, 3, 1, 2, 4)   # [g, r, b, w, j]
    c = np.empty((G, XROWS, nb, 16, 4), np.uint8)
    c[:, :, :, 0:12:2] = p & 7
    c[:, :, :, 1:12:2] = (p >> 3) & 7
    hi = np.stack([p[:, :, :, 4] >> 6, p[:, :, :, 4] >> 7, p[:, :, :, 5] >> 6, p[:, :, :, 5] >> 7], axis=3) & 1
    c[:, :, :, 12:16] = (p[:, :, :, 0:4] >> 6) | (hi << 2)
    return c.reshape(n, nb, 64), d, m


def q3x_v4_unparts(b, n, nb):
    """The q3x bytes of .mxq version 4 (a 2-bit plane and a 1-bit plane per block) -> (codes [N, nb,
    64], d, m [N, nb] fp16); only `mxq.upgrade` reads them."""
    G = n // XROWS
    g = b.reshape(G, nb, 448)
    d, m = _q3x_header(g, n, nb)
    lo = g[..., 64:320].reshape(G, nb, 4, XROWS, 4)                      # [g, b, z, r, j]
    hb = g[..., 320:448].reshape(G, nb, 2, XROWS, 4)                     # [g, b, y, r, j]
    f = np.arange(4, dtype=np.uint8)
    lo2 = (lo[:, :, None] >> (2 * f)[None, None, :, None, None, None]) & 3          # [g, b, f, z, r, j]
    z = np.arange(4, dtype=np.uint8)
    y, f2 = f >> 1, f & 1
    hi = (hb[:, :, y][:, :, :, None] >> (4 * f2[:, None] + z[None, :])[None, None, :, :, None, None]) & 1   # [g, b, f, z, r, j]
    codes = (lo2 | (hi << 2)).transpose(0, 4, 1, 2, 3, 5).reshape(n, nb, 64)
    return codes.astype(np.uint8), d, m


def _bytes_of(fmt, data, shape, label):
    n, k = rows_cols(shape)
    want = expected_nbytes(fmt, (n, k))
    b = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)
    if b.size != want:
        raise QuantError(f"{label} tensor of shape {(n, k)} needs {want} bytes, got {b.size}")
    return b, n, k


def _xperm(fmt, data, shape, inverse=False) -> np.ndarray:
    """q4 <-> q4x, q6 <-> q6x: per row block, each 2-byte header field of the 16 rows of a group
    becomes 32 contiguous bytes and each 4-byte code word 64 (mq_format.h)."""
    base = INTERLEAVED[fmt][0]
    b, n, k = _bytes_of(fmt, data, shape, fmt if inverse else base)
    H, W = _XPERM[fmt]
    nc, bb, G = PACKED[base].blocks_per_row(k), PACKED[base].block_bytes, n // XROWS
    if not inverse:
        blk = b.reshape(G, XROWS, nc, bb)                              # [g, r, c, byte]
        hw = blk[..., :2 * H].reshape(G, XROWS, nc, H, 2).transpose(0, 2, 3, 1, 4).reshape(G, nc, 32 * H)
        wd = blk[..., 2 * H:].reshape(G, XROWS, nc, W, 4).transpose(0, 2, 3, 1, 4).reshape(G, nc, 64 * W)
        return np.ascontiguousarray(np.concatenate([hw, wd], axis=-1)).reshape(-1)
    g = b.reshape(G, nc, XROWS * bb)
    hw = g[..., :32 * H].reshape(G, nc, H, XROWS, 2).transpose(0, 3, 1, 2, 4).reshape(G, XROWS, nc, 2 * H)
    wd = g[..., 32 * H:].reshape(G, nc, W, XROWS, 4).transpose(0, 3, 1, 2, 4).reshape(G, XROWS, nc, 4 * W)
    return np.ascontiguousarray(np.concatenate([hw, wd], axis=-1)).reshape(-1)


# ----------------------------------------------------------------------------- chunk packers
def _pack2(c: np.ndarray) -> np.ndarray:
    c = c.astype(np.uint8)
    return (c[..., 0:8] | (c[..., 8:16] << 2) | (c[..., 16:24] << 4) | (c[..., 24:32] << 6)).astype(np.uint8)


def _unpack2(b: np.ndarray) -> np.ndarray:
    return np.concatenate([(b >> s) & 3 for s in (0, 2, 4, 6)], axis=-1).astype(np.uint8)


def _pack4(c: np.ndarray) -> np.ndarray:
    c = c.astype(np.uint8)
    return (c[..., 0:16] | (c[..., 16:32] << 4)).astype(np.uint8)


def _unpack4(b: np.ndarray) -> np.ndarray:
    return np.concatenate([b & 15, b >> 4], axis=-1).astype(np.uint8)


def _packbits32(bits: np.ndarray) -> np.ndarray:
    """[..., 32] of 0/1 -> [..., 4] bytes: bit i of the little-endian u32 is bits[i]."""
    return np.packbits(bits.astype(np.uint8), axis=-1, bitorder="little")


def _unpackbits32(b: np.ndarray) -> np.ndarray:
    return np.unpackbits(b, axis=-1, bitorder="little")


def _pack3c(c: np.ndarray) -> np.ndarray:
    bits = ((c[..., :, None] >> np.arange(3, dtype=np.uint8)) & 1).reshape(*c.shape[:-1], 3 * CHUNK)
    return np.packbits(bits, axis=-1, bitorder="little")


def _unpack3c(b: np.ndarray) -> np.ndarray:
    bits = np.unpackbits(b, axis=-1, bitorder="little").reshape(*b.shape[:-1], CHUNK, 3)
    return (bits[..., 0] | (bits[..., 1] << 1) | (bits[..., 2] << 2)).astype(np.uint8)


def pack_chunks(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes [..., 32] (uint8, or int8 for bits=8) -> packed bytes [..., chunk_bytes]. bits: the
    packing id (a Layout's pack: the bit count, or PACK3C)."""
    if codes.shape[-1] != CHUNK:
        raise QuantError(f"pack_chunks wants a last axis of {CHUNK}, got {codes.shape}")
    if bits == PACK3C:
        return _pack3c(codes.astype(np.uint8))
    if bits == 8:
        return codes.astype(np.int8).view(np.uint8)
    c = codes.astype(np.uint8)
    if bits == 2:
        return _pack2(c)
    if bits == 3:
        return np.concatenate([_pack2(c & 3), _packbits32((c >> 2) & 1)], axis=-1)
    if bits == 4:
        return _pack4(c)
    if bits == 5:
        return np.concatenate([_pack4(c & 15), _packbits32((c >> 4) & 1)], axis=-1)
    if bits == 6:
        return np.concatenate([_pack4(c & 15), _pack2(c >> 4)], axis=-1)
    raise QuantError(f"no chunk packing for {bits} bits")


def unpack_chunks(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of pack_chunks: [..., chunk_bytes] -> codes [..., 32] (int8 for bits=8)."""
    p = packed.astype(np.uint8, copy=False)
    if bits == PACK3C:
        return _unpack3c(p)
    if bits == 8:
        return p.view(np.int8)
    if bits == 2:
        return _unpack2(p)
    if bits == 3:
        return (_unpack2(p[..., :8]) | (_unpackbits32(p[..., 8:12]) << 2)).astype(np.uint8)
    if bits == 4:
        return _unpack4(p)
    if bits == 5:
        return (_unpack4(p[..., :16]) | (_unpackbits32(p[..., 16:20]) << 4)).astype(np.uint8)
    if bits == 6:
        return (_unpack4(p[..., :16]) | (_unpack2(p[..., 16:24]) << 4)).astype(np.uint8)
    raise QuantError(f"no chunk packing for {bits} bits")


# ----------------------------------------------------------------------------- whole tensors
@dataclass
class Parts:
    """A packed tensor taken apart. codes: [N, nb, G] (pad included); d, m: [N, nb] float16;
    lut: [N, nb, 4] uint8 (q2c only); lo_hi: (lo, hi) float32 (q5g only)."""
    codes: np.ndarray
    d: np.ndarray | None = None
    m: np.ndarray | None = None
    lut: np.ndarray | None = None
    lo_hi: tuple[float, float] | None = None


def assemble(fmt: str, shape, parts: Parts) -> bytes:
    """Parts -> packed bytes, in the layout above."""
    if fmt in INTERLEAVED:
        return to_interleaved(fmt, assemble(INTERLEAVED[fmt][0], shape, parts), shape).tobytes()
    lay = PACKED[fmt]
    n, k = rows_cols(shape)
    nb = lay.blocks_per_row(k)
    codes = np.asarray(parts.codes).reshape(n, nb, lay.group // CHUNK, CHUNK)
    body = pack_chunks(codes, lay.pack).reshape(n, nb, -1)
    heads = []   # the header by the format's traits: d, then m, then a block table (MQ_HDR_*)
    if lay.header >= 2:
        heads.append(np.asarray(parts.d, dtype="<f2").reshape(n, nb, 1).view(np.uint8))
    if lay.header >= 4:
        heads.append(np.asarray(parts.m, dtype="<f2").reshape(n, nb, 1).view(np.uint8))
    if TRAITS[fmt].levels == "block_lut":
        heads.append(np.asarray(parts.lut, dtype=np.uint8).reshape(n, nb, lay.header - 4))
    out = np.concatenate(heads + [body], axis=-1) if heads else body
    data = np.ascontiguousarray(out).tobytes()
    if lay.trailer:
        data += np.asarray(parts.lo_hi, dtype="<f4").tobytes()
    return data


def disassemble(fmt: str, shape, data) -> Parts:
    """Packed bytes -> Parts (inverse of assemble)."""
    if fmt in INTERLEAVED:
        return disassemble(INTERLEAVED[fmt][0], shape, from_interleaved(fmt, data, shape))
    lay = PACKED[fmt]
    n, k = rows_cols(shape)
    nb = lay.blocks_per_row(k)
    buf = np.frombuffer(data, dtype=np.uint8)
    if buf.size != lay.nbytes(shape):
        raise QuantError(f"{fmt} tensor of shape {tuple(shape)} needs {lay.nbytes(shape)} bytes, got {buf.size}")
    blocks = buf[: n * nb * lay.block_bytes].reshape(n, nb, lay.block_bytes)
    nch = lay.group // CHUNK
    body = blocks[:, :, lay.header:].reshape(n, nb, nch, lay.chunk_bytes)
    codes = unpack_chunks(body, lay.pack).reshape(n, nb, lay.group)
    p = Parts(codes=codes)
    if lay.header >= 2:
        p.d = np.ascontiguousarray(blocks[:, :, 0:2]).view("<f2").reshape(n, nb)
    if lay.header >= 4:
        p.m = np.ascontiguousarray(blocks[:, :, 2:4]).view("<f2").reshape(n, nb)
    if TRAITS[fmt].levels == "block_lut":
        p.lut = np.ascontiguousarray(blocks[:, :, 4:lay.header])
    if lay.trailer:
        lo, hi = np.frombuffer(bytes(buf[-8:]), dtype="<f4")
        p.lo_hi = (float(lo), float(hi))
    return p


def levels(fmt: str, parts: Parts) -> np.ndarray:
    """Integer level L[q] = U - off of every code, float32, shape like parts.codes (U: the kernels'
    u8 level, by the format's traits)."""
    t = TRAITS[fmt]
    c = parts.codes
    if t.levels == "signed":
        u = c.astype(np.uint8) ^ np.uint8(0x80)
    elif t.levels == "table":
        u = Q3P_LEVELS[c]
    elif t.levels == "block_lut":
        u = np.take_along_axis(parts.lut, c.astype(np.intp), axis=-1)
    else:
        u = c
    return u.astype(np.float32) - np.float32(t.off)


def dequantize_bytes(fmt: str, shape, data) -> np.ndarray:
    """Reference dequantization of packed bytes to float32 of `shape`."""
    n, k = rows_cols(shape)
    parts = disassemble(fmt, shape, data)
    lv = levels(fmt, parts)
    if parts.lo_hi is not None:   # q5g: the trailer's range
        lo, hi = np.float32(parts.lo_hi[0]), np.float32(parts.lo_hi[1])
        step = (hi - lo) / np.float32(31)
        w = lo + lv * step
    else:
        d = parts.d.astype(np.float32)[..., None]
        w = d * lv
        if parts.m is not None:
            w = w + parts.m.astype(np.float32)[..., None]
    return np.ascontiguousarray(w.reshape(n, -1)[:, :k].astype(np.float32)).reshape(shape)
