"""The .mxq model file: a strict reader over a read-only mmap and an atomic, streaming writer.

Layout (spec and rationale: docs/mxq-file.md):

    [0, 64)            prefix: magic b"MXQ\\0", version, header offset/length, file size, header CRC-32
    [page, ...)        spans, each starting on a page boundary: one per transformer layer holding
                       all of that layer's tensors, one per non-layer tensor (embedding, final norm,
                       lm_head). Inside a span tensors follow each other at 64 B boundaries.
    [hdr_off, EOF)     UTF-8 JSON header (format, version, alignment, page, meta, tensors, spans);
                       it starts on the page after the last span and ends exactly at end of file.

The reader trusts nothing: the prefix, the header's size (<= MAX_HEADER), its CRC, every type, every
integer and every offset are checked before a single tensor byte is touched, and any violation
raises FormatError naming the tensor. Tensors come back as zero-copy QTensor views of the mmap.
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from mixqrt.errors import FormatError, MixqrtError
from mixqrt.io.atomic import mkstemp_for, umask as _umask
from mixqrt.formats import layout
from mixqrt.io.arena import ALIGN, PAGE, Arena, align_up, drop_cached, is_pow2

MAGIC = b"MXQ\0"
# 2: q3p codes are packed pack3c (layout.py). Version 1 files still load unless they hold q3p tensors
# (their codes are in the old planar packing, which no kernel reads any more): those raise
# FormatError asking to re-quantize.
# 3: a tensor entry may carry "rot" (a rotated tensor, mixqrt.formats.rotation). Files without one are
# still written as version 2, so older readers keep reading them; a version 2 reader refuses a
# version 3 file by its version, never misreading its rotated rows.
# 4: tensors may be stored q4x / q6x / q3x (q4's / q6's / q3p's blocks with rows interleaved by 16,
# layout.py). Written only when a file holds one; a version 3 reader refuses the file by its version.
# 5: q3x's codes are six planes of whole codes (mq_format.h), no longer version 4's 2-bit + 1-bit
# planes. Written when a file holds a q3x tensor; a version 5 reader refuses a version 4 file's q3x
# tensors with a FormatError that says to re-quantize or `upgrade`, which converts them losslessly.
VERSION = 2
VERSION_ROT = 3
VERSION_X = 4
VERSION_Q3X = 5
READABLE = (1, 2, 3, 4, 5)
PREFIX = struct.Struct("<4sIQQQI28x")          # magic, version, hdr_off, hdr_len, file_size, hdr_crc32
PREFIX_SIZE = PREFIX.size                      # 64
MAX_HEADER = 64 << 20                          # bytes of JSON header; Qwen's tokenizer.json is ~7 MB
MAX_DIMS = 8
MAX_DIM = 1 << 40
MAX_LAYER = 1 << 20
MAX_NAME = 4096
MAX_PAGE = 1 << 30
FORMATS = frozenset(layout.PACKED) | frozenset(layout.PLAIN) | frozenset(layout.INTERLEAVED)
BLOB_MIN = 1 << 16                             # top-level meta strings this long are stored as blobs
_TOP_KEYS = frozenset({"format", "version", "alignment", "page", "meta", "blobs", "tensors", "spans"})
_BLOB_KEYS = frozenset({"offset", "nbytes", "crc32"})
_TENSOR_KEYS = frozenset({"fmt", "shape", "offset", "nbytes", "layer"})
_TENSOR_OPT = frozenset({"rot"})               # version 3 on
_SPAN_KEYS = frozenset({"key", "offset", "nbytes"})
# (format, first version with its current layout, what changed): older files' tensors of that
# format are refused unless read for `upgrade`
_RELAYOUTS = (("q3p", 2, "q3p's codes are packed pack3c"), ("q3x", VERSION_Q3X, "q3x holds whole codes per byte"))


@dataclass(frozen=True)
class TensorInfo:
    name: str
    fmt: str
    shape: tuple
    offset: int           # absolute file offset, multiple of the file's alignment
    nbytes: int           # == layout.expected_nbytes(fmt, shape)
    layer: int | None     # None: embedding, final norm, lm_head (each in a span of its own)
    rot: dict | None = None   # rotation record (version 3), mixqrt.formats.rotation


# ============================================================================ header parsing
def _isint(x) -> bool:
    return type(x) is int                                      # bool and float are not offsets


def _no_dup_keys(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise FormatError(f"duplicate key {k!r} in header")
        d[k] = v
    return d


def _bad_constant(name):
    raise FormatError(f"non-finite number {name} in header")


def _loads(raw: bytes, where: str):
    try:
        text = raw.decode("utf-8")
        return json.loads(text, object_pairs_hook=_no_dup_keys, parse_constant=_bad_constant)
    except FormatError as e:
        raise FormatError(f"{where}: {e}") from None
    except (ValueError, RecursionError, MemoryError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise FormatError(f"{where}: header is not valid UTF-8 JSON: {type(e).__name__}: {str(e)[:200]}") from None


def _parse_prefix(arena: Arena) -> tuple[int, int, int, int]:
    where = arena.path
    if arena.size < PREFIX_SIZE:
        raise FormatError(f"{where}: {arena.size} bytes is too small for an .mxq file (prefix is {PREFIX_SIZE})")
    magic, version, hoff, hlen, fsize, crc = PREFIX.unpack(arena.read(0, PREFIX_SIZE))
    if magic != MAGIC:
        raise FormatError(f"{where}: not an .mxq file (magic {magic!r})")
    if version not in READABLE:
        raise FormatError(f"{where}: unsupported .mxq version {version} (this reader knows {list(READABLE)})")
    if arena.read(PREFIX.size - 28, 28) != bytes(28):
        raise FormatError(f"{where}: reserved prefix bytes are not zero")
    if fsize != arena.size:
        raise FormatError(f"{where}: prefix says the file has {fsize} bytes, it has {arena.size} (truncated or padded)")
    if not 2 <= hlen <= MAX_HEADER:
        raise FormatError(f"{where}: header length {hlen} outside [2, {MAX_HEADER}]")
    if hoff < PREFIX_SIZE or hoff + hlen != fsize:
        raise FormatError(f"{where}: header [{hoff}, {hoff + hlen}) must end exactly at end of file ({fsize})")
    return version, hoff, hlen, crc


def _check_tensor(name, e, hoff: int, alignment: int, page: int, version: int = VERSION) -> TensorInfo:
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME:
        raise FormatError(f"tensor name {str(name)[:80]!r} must be a string of 1..{MAX_NAME} characters")
    where = f"tensor {name!r}"
    opt = _TENSOR_OPT if version >= VERSION_ROT else frozenset()
    if not isinstance(e, dict) or not _TENSOR_KEYS <= set(e) <= _TENSOR_KEYS | opt:
        raise FormatError(f"{where}: entry must be an object with keys {sorted(_TENSOR_KEYS)}"
                          + (f" (optional: {sorted(opt)})" if opt else ""))
    fmt, shape, off, nb, lay = e["fmt"], e["shape"], e["offset"], e["nbytes"], e["layer"]
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise FormatError(f"{where}: unknown format {str(fmt)[:40]!r}; known: {', '.join(sorted(FORMATS))}")
    if fmt in layout.INTERLEAVED and version < VERSION_X:
        raise FormatError(f"{where}: format {fmt} needs .mxq version {VERSION_X}, the file says {version}")
    if (not isinstance(shape, list) or not 1 <= len(shape) <= MAX_DIMS
            or not all(_isint(s) and 1 <= s <= MAX_DIM for s in shape)):
        raise FormatError(f"{where}: shape {str(shape)[:80]} must be 1..{MAX_DIMS} integers in [1, 2**40]")
    if lay is not None and not (_isint(lay) and 0 <= lay < MAX_LAYER):
        raise FormatError(f"{where}: layer {str(lay)[:40]} must be null or an integer in [0, {MAX_LAYER})")
    if not (_isint(off) and _isint(nb)):
        raise FormatError(f"{where}: offset and nbytes must be integers")
    if fmt in layout.INTERLEAVED and (len(shape) != 2 or shape[0] % layout.INTERLEAVED[fmt][1]):
        raise FormatError(f"{where}: a {fmt} tensor is [N, K] with N a multiple of {layout.INTERLEAVED[fmt][1]}, "
                          f"not {tuple(shape)}")
    want = layout.expected_nbytes(fmt, shape)          # Python ints: no overflow, compared below
    if nb != want:
        raise FormatError(f"{where}: nbytes {nb} != {want}, the size of a {fmt} tensor of shape {tuple(shape)}")
    if off % alignment:
        raise FormatError(f"{where}: offset {off} is not {alignment}-byte aligned")
    if off < page or off + nb > hoff:
        raise FormatError(f"{where}: bytes [{off}, {off + nb}) outside the data region [{page}, {hoff})")
    rot = e.get("rot")
    if rot is not None:
        rot = _rot_record(rot, fmt, shape, f"{where}: rot")
    return TensorInfo(name, fmt, tuple(shape), off, nb, lay, rot)


def _rot_record(rot, fmt, shape, where: str) -> dict:
    """formats.rotation.record, its QuantError as a FormatError (reader and writer)."""
    from mixqrt.errors import QuantError
    from mixqrt.formats import rotation
    try:
        return rotation.record(rot, fmt, shape, where)
    except QuantError as err:
        raise FormatError(str(err)) from None


def parse_header(arena: Arena, *, old_layouts: bool = False) -> tuple["MetaView", dict[str, TensorInfo], dict, int]:
    """Validate everything but tensor contents and blob contents (checked when read).
    Returns (meta, tensors, spans, header_bytes). old_layouts: let a version 1 file's q3p tensors
    (planar codes) and a version 4 file's q3x tensors (two bit planes) through, for `upgrade` only."""
    where = arena.path
    version, hoff, hlen, crc = _parse_prefix(arena)
    raw = arena.read(hoff, hlen)
    if zlib.crc32(raw) != crc:
        raise FormatError(f"{where}: header CRC-32 mismatch (corrupt header)")
    h = _loads(raw, where)
    del raw
    if not isinstance(h, dict) or set(h) != _TOP_KEYS:
        raise FormatError(f"{where}: header must be an object with keys {sorted(_TOP_KEYS)}")
    if h["format"] != "mxq" or not _isint(h["version"]) or h["version"] != version:
        raise FormatError(f"{where}: header format/version {str(h['format'])[:20]!r}/{str(h['version'])[:20]} "
                          f"!= 'mxq'/{version} (the prefix's version)")
    page, alignment = h["page"], h["alignment"]
    if not (_isint(page) and is_pow2(page) and PAGE <= page <= MAX_PAGE):
        raise FormatError(f"{where}: page {str(page)[:40]} must be a power of two in [{PAGE}, {MAX_PAGE}]")
    if not (_isint(alignment) and is_pow2(alignment) and ALIGN <= alignment <= page):
        raise FormatError(f"{where}: alignment {str(alignment)[:40]} must be a power of two in [{ALIGN}, page]")
    meta, ttab, stab = h["meta"], h["tensors"], h["spans"]
    if not isinstance(meta, dict):
        raise FormatError(f"{where}: meta must be an object")
    if not isinstance(ttab, dict) or not isinstance(stab, list):
        raise FormatError(f"{where}: tensors must be an object and spans a list")

    tensors = {name: _check_tensor(name, e, hoff, alignment, page, version) for name, e in ttab.items()}
    for fmt, since, why in _RELAYOUTS:     # storage forms an older version laid out otherwise
        if old_layouts or h["version"] >= since:
            continue
        old = next((t.name for t in tensors.values() if t.fmt == fmt), None)
        if old is not None:
            raise FormatError(f"{where}: {fmt} tensor {old!r} is in the layout of .mxq version {h['version']}, which "
                              f"this mixqrt no longer reads ({why} since version {since}, docs/mxq-file.md): "
                              f"re-quantize the model (mixqrt quantize), or convert the file losslessly: "
                              f"mixqrt upgrade OLD.mxq NEW.mxq")
    groups: dict = {}
    for t in tensors.values():
        groups.setdefault(t.name if t.layer is None else t.layer, []).append(t)

    spans: dict = {}
    for s in stab:
        if not isinstance(s, dict) or set(s) != _SPAN_KEYS:
            raise FormatError(f"{where}: span entry must be an object with keys {sorted(_SPAN_KEYS)}")
        key, off, nb = s["key"], s["offset"], s["nbytes"]
        if not (isinstance(key, str) or (_isint(key) and 0 <= key < MAX_LAYER)):
            raise FormatError(f"{where}: span key {str(key)[:80]} must be a layer index or a tensor name")
        what = f"span of layer {key}" if _isint(key) else f"span of tensor {key!r}"
        if key in spans:
            raise FormatError(f"{where}: duplicate {what}")
        if key not in groups:
            raise FormatError(f"{where}: {what} holds no tensor")
        if not (_isint(off) and _isint(nb)) or off % page or nb < 1 or off < page or off + nb > hoff:
            raise FormatError(f"{where}: {what}: [{str(off)[:40]}, +{str(nb)[:40]}) must be page aligned "
                              f"and inside the data region [{page}, {hoff})")
        # inside a span: tensors back to back at `alignment`, first at the span start, last at its end
        pos = off
        for t in sorted(groups[key], key=lambda t: t.offset):
            if t.offset != align_up(pos, alignment):
                raise FormatError(f"{where}: tensor {t.name!r} at {t.offset} should start at {align_up(pos, alignment)} "
                                  f"in the {what} (tensors overlap, leave gaps or escape their span)")
            pos = t.offset + t.nbytes
        if pos != off + nb:
            raise FormatError(f"{where}: {what} says {nb} bytes, its tensors end {pos - off} bytes in")
        spans[key] = (off, nb)
    for key, ts in groups.items():
        if key not in spans:
            raise FormatError(f"{where}: tensor {ts[0].name!r} (layer {ts[0].layer}) has no span")
    # spans back to back on page boundaries, each on pages of its own; header on the page after them
    pos = page
    for key, (off, nb) in sorted(spans.items(), key=lambda kv: kv[1][0]):
        if off != pos:
            raise FormatError(f"{where}: span {key!r} at {off} should start at {pos} (spans overlap or leave a gap)")
        pos = align_up(off + nb, page)
    # blobs: large meta strings, back to back on the pages after the spans
    btab = h["blobs"]
    if not isinstance(btab, dict):
        raise FormatError(f"{where}: blobs must be an object")
    blobs = {}
    for key, b in btab.items():
        if not 1 <= len(key) <= MAX_NAME or key in meta:
            raise FormatError(f"{where}: blob {key[:80]!r} must have a 1..{MAX_NAME} character name not used in meta")
        if (not isinstance(b, dict) or set(b) != _BLOB_KEYS or not all(_isint(b[k]) for k in _BLOB_KEYS)
                or not 0 <= b["crc32"] < 1 << 32):
            raise FormatError(f"{where}: blob {key!r}: entry must hold integers {sorted(_BLOB_KEYS)}")
        blobs[key] = (b["offset"], b["nbytes"], b["crc32"])
    for key, (off, nb, _) in sorted(blobs.items(), key=lambda kv: kv[1][0]):
        if off != pos or nb < 0 or off + nb > hoff:
            raise FormatError(f"{where}: blob {key!r} [{off}, +{nb}) should start at {pos} and end before {hoff}")
        pos = off + nb
    pos = align_up(pos, page)
    if hoff != pos:
        raise FormatError(f"{where}: header at {hoff} should start at {pos}, the page after the last span or blob")
    meta = MetaView(meta, blobs, arena)
    return meta, tensors, spans, PREFIX_SIZE + sum(b[1] for b in blobs.values()) + hlen


class MetaView(Mapping):
    """The file's meta: small values parsed from the JSON header, large strings (tokenizer.json) read
    from their blob only when asked for, so that loading a model does not pay for them in RSS.
    Blobs are read with pread(), so they need the file open: use dict(f.meta) to keep them past close()."""

    def __init__(self, small: dict, blobs: dict, arena: Arena):
        self._small, self._blobs, self._arena = small, blobs, arena

    def __getitem__(self, key):
        if key in self._small:
            return self._small[key]
        off, nb, crc = self._blobs[key]
        raw = self._arena.read(off, nb)
        if zlib.crc32(raw) != crc:
            raise FormatError(f"{self._arena.path}: meta {key!r}: blob CRC-32 mismatch")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise FormatError(f"{self._arena.path}: meta {key!r}: blob is not UTF-8 ({e})") from None

    def __iter__(self):
        yield from self._small
        yield from self._blobs

    def __len__(self) -> int:
        return len(self._small) + len(self._blobs)

    def __contains__(self, key) -> bool:
        return key in self._small or key in self._blobs

    def blob_keys(self) -> list:
        return list(self._blobs)

    def __repr__(self) -> str:
        return f"MetaView({sorted(self._small)} + blobs {sorted(self._blobs)})"


# ============================================================================ reader
class MxqFile:
    """A .mxq file mapped read-only.

    meta:          MetaView (a read-only Mapping) of the writer's meta: config, tokenizer, chat_template,
                   generation_config, recipe, source; large strings are read from their blob on access
    tensors:       name -> QTensor whose .raw is a zero-copy view of the mmap (in header order)
    info:          name -> TensorInfo (fmt, shape, offset, nbytes, layer)
    spans:         layer (int) or non-layer tensor name (str) -> (offset, nbytes); page aligned
    header_bytes:  int, every byte that is not tensor data: prefix + blobs + JSON header
    arena:         the mixqrt.io.arena.Arena (arena.prefetch(*spans[i]) reads a layer ahead)
    """

    def __init__(self, path, *, hugepages: bool = False, willneed: bool = False, copy: bool = False,
                 _old_layouts: bool = False):
        from mixqrt.formats.qtensor import QTensor
        self.path = os.fspath(path)
        self.arena = Arena(self.path, hugepages=hugepages, willneed=willneed, copy=copy)
        try:
            self.meta, self.info, self.spans, self.header_bytes = parse_header(self.arena, old_layouts=_old_layouts)
            self.tensors = {}
            for name, t in self.info.items():
                try:
                    qt = QTensor.from_bytes(self.arena.view(t.offset, t.nbytes), t.fmt, t.shape)
                    if t.rot is not None:
                        qt.meta = {"rot": t.rot}
                    self.tensors[name] = qt
                except MixqrtError as e:
                    raise FormatError(f"{self.path}: tensor {name!r}: {e}") from None
        except BaseException:
            self.arena.close()
            raise

    def layer_tensors(self, layer: int) -> dict:
        return {n: self.tensors[n] for n, t in self.info.items() if t.layer == layer}

    @property
    def num_layers(self) -> int:
        return sum(1 for k in self.spans if isinstance(k, int))

    def close(self) -> None:
        """Drop the views and unmap (deferred while the caller still holds a view)."""
        self.tensors = {}
        self.arena.close()

    def __enter__(self) -> "MxqFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MxqFile({self.path!r}, tensors={len(self.info)}, spans={len(self.spans)}, size={self.arena.size})"


def validate(path, *, deep: bool = False) -> dict:
    """Check a .mxq file; raise FormatError on any problem, else return a summary.

    Blobs (large meta strings) are always read and checked.
    deep=True also reads every tensor (touching all pages): plain float tensors must be finite and
    q5g's (lo, hi) trailer finite with lo <= hi.
    """
    import numpy as np
    with MxqFile(path) as f:
        for key in f.meta:
            f.meta[key]                                   # blobs: CRC and UTF-8 checked on read
        if deep:
            for name, t in f.info.items():
                raw = f.tensors[name].raw
                if t.fmt in ("f32", "f16"):
                    vals = raw.view(layout.PLAIN[t.fmt])
                elif t.fmt == "q5g":
                    vals = raw[-8:].copy().view("<f4")
                    if not vals[0] <= vals[1]:
                        raise FormatError(f"{path}: tensor {name!r}: q5g range lo {vals[0]} > hi {vals[1]}")
                else:
                    int(raw.sum(dtype=np.uint64))          # touch every page: proves the mapping is whole
                    continue
                if not np.isfinite(vals).all():
                    raise FormatError(f"{path}: tensor {name!r}: non-finite values")
        out = {"path": os.fspath(path), "tensors": len(f.info), "spans": len(f.spans), "layers": f.num_layers,
               "file_bytes": f.arena.size, "header_bytes": f.header_bytes,
               "tensor_bytes": sum(t.nbytes for t in f.info.values())}
        f.tensors = {}
    return out


# ============================================================================ writer
class MxqWriter:
    """Streams tensors into `path` atomically.

    with MxqWriter("m.mxq", meta) as w:
        w.add("model.embed_tokens.weight", qt, layer=None)
        w.add("model.layers.0.self_attn.q_proj.weight", qt, layer=0)   # a layer's tensors arrive together
    # committed here: temp file fsynced and os.replace()d; on any exception (KeyboardInterrupt too)
    # the temp file is removed and `path` is untouched.

    Only the tensor table (a few hundred small entries) stays in memory, never tensor data.
    """

    def __init__(self, path, meta: dict, *, page: int = PAGE, blob_min: int = BLOB_MIN, alignment: int = ALIGN):
        if not isinstance(meta, dict):
            raise FormatError(f"meta must be a dict, got {type(meta).__name__}")
        if not (is_pow2(page) and PAGE <= page <= MAX_PAGE):
            raise FormatError(f"page {page} must be a power of two in [{PAGE}, {MAX_PAGE}]")
        # every tensor starts on a multiple of `alignment` (the header's "alignment"): ALIGN (64) by
        # default; `page` for a mixture of experts, so each expert's tensors sit on pages of their own
        # and an expert no token routes to is never read in from disk under mmap (docs/mxq-file.md)
        if not (is_pow2(alignment) and ALIGN <= alignment <= page):
            raise FormatError(f"alignment {alignment} must be a power of two in [{ALIGN}, page {page}]")
        self.alignment = alignment
        try:  # fail now, not after hours of quantization; the copy also freezes meta against later edits
            self._meta = json.loads(json.dumps(meta, allow_nan=False, ensure_ascii=False))
            self._blobs = {k: v.encode("utf-8") for k, v in self._meta.items()
                           if isinstance(v, str) and len(v) >= blob_min}
        except (TypeError, ValueError) as e:
            raise FormatError(f"meta is not JSON-serializable UTF-8 (finite numbers, str keys): {e}") from None
        for k in self._blobs:
            del self._meta[k]
        self.path = os.fspath(path)
        self.page = page
        fd, self._tmp = mkstemp_for(self.path)      # unique, pid-named: see io/atomic.py
        self._f = os.fdopen(fd, "wb")
        self._tensors: dict[str, dict] = {}
        self._spans: list[dict] = []
        self._done_layers: set[int] = set()
        self._span = None               # the open span: {"key", "offset", "nbytes"}
        try:
            self._f.write(bytes(page))  # prefix placeholder + padding to the first span
        except BaseException:
            self.abort()
            raise
        self._pos = page

    # ------------------------------------------------------------------ streaming
    def _pad_to(self, pos: int) -> None:
        if pos > self._pos:
            self._f.write(bytes(pos - self._pos))
            self._pos = pos

    def _close_span(self) -> None:
        if self._span is not None:
            self._span["nbytes"] = self._pos - self._span["offset"]
            self._spans.append(self._span)
            if isinstance(self._span["key"], int):
                self._done_layers.add(self._span["key"])
            self._span = None
            self._pad_to(align_up(self._pos, self.page))

    def add(self, name: str, qtensor, layer: int | None = None) -> None:
        """Append one tensor (a QTensor, or anything with .fmt, .shape and a uint8 .raw)."""
        if self._f is None:
            raise FormatError(f"tensor {name!r}: writer is already committed or aborted")
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME:
            raise FormatError(f"tensor name {name!r} must be a string of 1..{MAX_NAME} characters")
        if name in self._tensors:
            raise FormatError(f"tensor {name!r} added twice")
        if layer is not None and not (_isint(layer) and 0 <= layer < MAX_LAYER):
            raise FormatError(f"tensor {name!r}: layer {layer!r} must be None or an int in [0, {MAX_LAYER})")
        fmt, shape = qtensor.fmt, tuple(int(s) for s in qtensor.shape)
        if fmt not in FORMATS:
            raise FormatError(f"tensor {name!r}: unknown format {fmt!r}")
        if not 1 <= len(shape) <= MAX_DIMS or not all(1 <= s <= MAX_DIM for s in shape):
            raise FormatError(f"tensor {name!r}: shape {shape} must have 1..{MAX_DIMS} positive dims")
        import numpy as np
        raw = np.ascontiguousarray(qtensor.raw).reshape(-1).view(np.uint8)
        want = layout.expected_nbytes(fmt, shape)
        if raw.size != want:
            raise FormatError(f"tensor {name!r}: {fmt} of shape {shape} needs {want} bytes, got {raw.size}")
        meta = getattr(qtensor, "meta", None)
        rot = meta.get("rot") if meta else None
        if rot is not None:          # checked before any byte is written
            rot = _rot_record(rot, fmt, shape, f"tensor {name!r}: rot")
        key = name if layer is None else layer
        if self._span is None or self._span["key"] != key or layer is None:
            self._close_span()
            if layer is not None and layer in self._done_layers:
                raise FormatError(f"tensor {name!r}: layer {layer} was already closed; a layer's tensors "
                                  "must be added one after another")
            self._span = {"key": key, "offset": self._pos, "nbytes": 0}
        self._pad_to(align_up(self._pos, self.alignment))
        off = self._pos
        self._f.write(memoryview(raw))
        self._pos += want
        self._tensors[name] = {"fmt": fmt, "shape": list(shape), "offset": off, "nbytes": want, "layer": layer}
        if rot is not None:
            self._tensors[name]["rot"] = rot

    # ------------------------------------------------------------------ commit / abort
    def commit(self) -> None:
        if self._f is None:
            raise FormatError(f"{self.path}: writer is already committed or aborted")
        try:
            self._close_span()
            self._pad_to(align_up(self._pos, self.page))    # no span: blobs/header right after the prefix page
            blobs = {}
            for k, b in self._blobs.items():
                blobs[k] = {"offset": self._pos, "nbytes": len(b), "crc32": zlib.crc32(b)}
                self._f.write(b)
                self._pos += len(b)
            self._pad_to(align_up(self._pos, self.page))
            hoff = self._pos
            version = (VERSION_Q3X if any(t["fmt"] == "q3x" for t in self._tensors.values())
                       else VERSION_X if any(t["fmt"] in layout.INTERLEAVED for t in self._tensors.values())
                       else VERSION_ROT if any("rot" in t for t in self._tensors.values()) else VERSION)
            header = {"format": "mxq", "version": version, "alignment": self.alignment, "page": self.page,
                      "meta": self._meta, "blobs": blobs, "tensors": self._tensors, "spans": self._spans}
            raw = json.dumps(header, allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
            if len(raw) > MAX_HEADER:
                raise FormatError(f"{self.path}: header of {len(raw)} bytes exceeds the {MAX_HEADER} byte limit")
            self._f.write(raw)
            size = hoff + len(raw)
            self._f.seek(0)
            self._f.write(PREFIX.pack(MAGIC, version, hoff, len(raw), size, zlib.crc32(raw)))
            self._f.flush()
            os.fchmod(self._f.fileno(), 0o666 & ~_umask())
            os.fsync(self._f.fileno())
            drop_cached(self._f.fileno())        # read back in 2 MiB folios, not write()'s small ones
            self._f.close()
            self._f = None
            os.replace(self._tmp, self.path)
            self._tmp = None
        except BaseException:
            self.abort()
            raise
        try:  # make the rename itself durable
            dfd = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass

    def abort(self) -> None:
        """Discard everything written; `path` is left as it was."""
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass
        tmp, self._tmp = self._tmp, None
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "MxqWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def __del__(self):
        if getattr(self, "_tmp", None) is not None:
            self.abort()


def upgrade(src, dst) -> int:
    """Rewrite an older .mxq in the current storage forms, losslessly: q3p tensors of a version 1 file
    get their codes repacked from the planar packing (the one q3u keeps) to pack3c, q3x tensors of a
    version 4 file get version 5's code planes, and q4 / q6 / q3p matrices with a multiple of 16 rows
    are stored q4x / q6x / q3x (the same blocks, rows interleaved for the decode kernels, layout.py);
    everything else is copied unchanged. Returns the number of tensors repacked. The output is
    written atomically like any .mxq."""
    import numpy as np
    from mixqrt.formats.codec import to_storage
    from mixqrt.formats.qtensor import QTensor
    n = 0
    with MxqFile(src, _old_layouts=True) as f:
        version = _parse_prefix(f.arena)[0]
        with MxqWriter(dst, {k: f.meta[k] for k in f.meta}) as w:
            for name, t in f.info.items():
                qt = f.tensors[name]
                if version < 2 and t.fmt == "q3p":
                    parts = layout.disassemble("q3u", t.shape, qt.raw)   # same blocks, planar codes
                    qt = QTensor("q3p", t.shape, np.frombuffer(layout.assemble("q3p", t.shape, parts), np.uint8))
                if version < VERSION_Q3X and t.fmt == "q3x":
                    rows, nb = t.shape[0], layout.PACKED["q3p"].blocks_per_row(t.shape[1])
                    codes, d, m = layout.q3x_v4_unparts(np.asarray(qt.raw, np.uint8), rows, nb)
                    meta = f.tensors[name].meta
                    qt = QTensor("q3x", t.shape, layout._q3x_parts(codes, d, m, rows, nb),
                                 meta=dict(meta) if meta else None)
                stored = to_storage(qt)
                n += stored is not f.tensors[name]
                w.add(name, stored, t.layer)
    return n
