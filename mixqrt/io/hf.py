"""Hugging Face folders: config.json + model.safetensors (or shards + model.safetensors.index.json).

The safetensors header is read here, strictly, as the format's own reader does: an 8-byte
little-endian length under a fixed limit, a JSON object, every tensor's byte span equal to
shape x dtype size, spans contiguous from the start of the data and ending exactly at the end of
the file. Reading it ourselves also lets BF16 load without ml_dtypes or torch (the u16 is the top
half of a float32) and keeps one error class with messages that name the file and tensor.
"""
from __future__ import annotations

import json
import re
import mmap
import os
import struct
from pathlib import Path

import numpy as np

from mixqrt.errors import FormatError, ModelError
from mixqrt.models.config_limits import check_generation_config, check_values
from mixqrt.platform.files import folder_file, read_text
from mixqrt.io.source import (PICKLE_SUFFIXES, Source, arch_from_config, check_config, check_layout,
                              refuse_pickle)

MAX_HEADER = 100 * 1024 * 1024          # the limit safetensors itself enforces
MAX_DIMS = 8

# safetensors dtype -> (item size, numpy dtype to read, or None for "cannot be a weight")
DTYPES = {"F64": (8, "<f8"), "F32": (4, "<f4"), "F16": (2, "<f2"), "BF16": (2, "<u2"),
          "I64": (8, None), "I32": (4, None), "I16": (2, None), "I8": (1, None), "U8": (1, None),
          "U16": (2, None), "U32": (4, None), "U64": (8, None), "BOOL": (1, None),
          "F8_E4M3": (1, None), "F8_E5M2": (1, None)}


class SafetensorsFile:
    """One .safetensors file, memory-mapped; .read(name) -> float32 array."""

    def __init__(self, path):
        self.path = Path(path)
        self._file = open(self.path, "rb")
        try:
            size = self.path.stat().st_size
            if size < 8:
                raise FormatError(f"{self.path}: truncated safetensors file ({size} bytes, header length needs 8)")
            n = struct.unpack("<Q", self._file.read(8))[0]
            # the messages never print n: for a file that is not safetensors it is 8 bytes of its content
            if n > MAX_HEADER:
                raise FormatError(f"{self.path}: not a safetensors file (header length field exceeds the "
                                  f"{MAX_HEADER}-byte limit)")
            if 8 + n > size:
                raise FormatError(f"{self.path}: truncated safetensors file: the header length field runs "
                                  f"past the end of the file ({size} bytes)")
            raw = self._file.read(n)
            try:
                header = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
                raise FormatError(f"{self.path}: header is not valid UTF-8 JSON ({type(e).__name__} "
                                  f"at byte {getattr(e, 'pos', getattr(e, 'start', '?'))})") from None
            if not isinstance(header, dict):
                raise FormatError(f"{self.path}: header is not a JSON object")
            self.metadata = header.pop("__metadata__", None) or {}
            if not isinstance(self.metadata, dict):
                raise FormatError(f"{self.path}: __metadata__ is not a JSON object")
            self.data_start = 8 + n
            self.tensors = self._check(header, size - self.data_start)
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size > self.data_start else None
        except BaseException:
            self._file.close()
            raise

    def _check(self, header: dict, data_len: int) -> dict:
        out, spans = {}, []
        for name, e in header.items():
            where = f"{self.path}: tensor {name[:200]!r}"
            if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= set(e):
                raise FormatError(f"{where}: entry needs dtype, shape and data_offsets")
            dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
            if not isinstance(dtype, str) or dtype not in DTYPES:
                raise FormatError(f"{where}: unknown dtype {str(dtype)[:40]!r}")
            if (not isinstance(shape, list) or len(shape) > MAX_DIMS or
                    not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
                raise FormatError(f"{where}: shape {str(shape)[:80]} is not a list of at most {MAX_DIMS} "
                                  "non-negative integers")
            if (not isinstance(offs, list) or len(offs) != 2 or
                    not all(isinstance(o, int) and not isinstance(o, bool) for o in offs) or not 0 <= offs[0] <= offs[1]):
                raise FormatError(f"{where}: data_offsets {str(offs)[:80]} must be [begin, end] with 0 <= begin <= end")
            want = DTYPES[dtype][0]
            for d in shape:
                want *= d                          # Python ints: no overflow to check
            if offs[1] - offs[0] != want:
                raise FormatError(f"{where}: byte span {offs[1] - offs[0]} != shape {tuple(shape)} x "
                                  f"{dtype} ({want} bytes)")
            if offs[1] > data_len:
                raise FormatError(f"{where}: data_offsets {offs} run past the end of the file "
                                  f"({data_len} data bytes; truncated?)")
            out[name] = (tuple(shape), dtype, offs[0], offs[1])
            spans.append((offs[0], offs[1], name))
        pos = 0
        for begin, end, name in sorted(spans):
            if begin != pos:
                what = "overlaps the previous tensor" if begin < pos else f"leaves a gap at byte {pos}"
                raise FormatError(f"{self.path}: tensor {name!r} starts at {begin} and {what}")
            pos = end
        if pos != data_len:
            raise FormatError(f"{self.path}: tensors cover {pos} data bytes but the file has {data_len}")
        return out

    def read(self, name: str) -> np.ndarray:
        shape, dtype, begin, end = self.tensors[name]
        np_dtype = DTYPES[dtype][1]
        if np_dtype is None:
            raise ModelError(f"{self.path}: tensor {name!r} is {dtype}, not a floating-point weight")
        count = (end - begin) // DTYPES[dtype][0]
        if count == 0:
            return np.zeros(shape, np.float32)
        # pread in slices instead of touching the mmap: mapped file pages would count in RSS and
        # stay there, so quantizing a 15 GB checkpoint would look (and be accounted) like 15 GB.
        out = np.empty(count, dtype=np.float32)
        step = max(1, (64 << 20) // DTYPES[dtype][0])
        buf = np.empty(min(count, step), dtype=np_dtype)
        fd = self._file.fileno()
        for i in range(0, count, step):
            n = min(step, count - i)
            chunk = buf[:n]
            want = n * DTYPES[dtype][0]
            got = os.preadv(fd, [memoryview(chunk).cast("B")], self.data_start + begin + i * DTYPES[dtype][0])
            if got != want:
                raise FormatError(f"{self.path}: tensor {name!r} is truncated ({got} of {want} bytes read)")
            if dtype == "BF16":
                # bf16 is the high half of a float32: write it there, zero the low half
                halves = out[i:i + n].view(np.uint16)
                halves[0::2] = 0
                halves[1::2] = chunk
            else:
                out[i:i + n] = chunk
        return out.reshape(shape)

    def close(self):
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass
            self._map = None
        self._file.close()


MAX_JSON = 64 << 20                     # config / index / generation_config: a few KB in practice


def _read_json(folder: Path, name: str, what: str, *, required: bool = True) -> dict | None:
    """folder/name parsed as a JSON object (confined to the folder: folder_file); None when absent
    and not `required`."""
    path = folder_file(folder, name, what=what or "file")
    if path is None:
        if required:
            raise ModelError(f"{folder}: no {name} ({what})")
        return None
    try:
        data = json.loads(read_text(path, MAX_JSON))
    except (json.JSONDecodeError, RecursionError) as e:
        raise FormatError(f"{path}: not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise FormatError(f"{path}: expected a JSON object")
    return check_values(data, str(path))


class HFSource(Source):
    """An HF model folder with safetensors weights."""
    declares_tie = True              # config.json's tie_word_embeddings (see Source.declares_tie)

    # tensors a checkpoint may carry that no graph reads
    _IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

    def __init__(self, folder):
        super().__init__()
        self.path = Path(folder)
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, SafetensorsFile] = {}   # HF name -> file holding it
        try:
            self.config = _read_json(self.path, "config.json", "every HF model folder has one")
            self._rename = self._text_only()
            self.arch = arch_from_config(self.config, str(self.path / "config.json"))
            check_config(self.config, str(self.path / "config.json"))
            self._open_weights()
            check_layout(self)
            self.generation_config = check_generation_config(
                _read_json(self.path, "generation_config.json", "", required=False) or {},
                str(self.path / "generation_config.json"))
            self.embedding, self._dense = sentence_transformers_info(self.path, self.config)
        except BaseException:
            self.close()
            raise

    # Gemma 3 with its vision tower (Gemma3ForConditionalGeneration, model_type "gemma3"): the text
    # decoder's tensors under these prefixes (transformers before / after 4.52), the rest skipped
    _TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                      ("language_model.lm_head.", "lm_head."))
    _VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                        "model.multi_modal_projector.")

    def _text_only(self):
        """For a multimodal Gemma 3 folder: its text_config as the config, and a rename of its text
        tensors to the text model's names (None for every other folder)."""
        tc = self.config.get("text_config")
        if self.config.get("model_type") != "gemma3" or not isinstance(tc, dict):
            return None
        top = self.config
        self.config = {**tc, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
                       "tie_word_embeddings": top.get("tie_word_embeddings", tc.get("tie_word_embeddings", True))}
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if k in top and k not in self.config:
                self.config[k] = top[k]

        def rename(name: str) -> str | None:
            for old, new in self._TEXT_PREFIXES:
                if name.startswith(old):
                    return new + name[len(old):]
            return None if name.startswith(self._VISION_PREFIXES) else name
        return rename

    def _weight_files(self) -> tuple[list[Path], dict | None]:
        index = self.path / "model.safetensors.index.json"
        index_json = _read_json(self.path, index.name, "safetensors index", required=False)
        if index_json is not None:
            weight_map = index_json.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise FormatError(f"{index}: no weight_map")
            files = sorted({self._shard(index, f) for f in weight_map.values()})
            return files, weight_map
        files = [self._shard(None, f.name) for f in sorted(self.path.glob("*.safetensors"))]
        if not files:
            pickles = sorted(p.name for p in self.path.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
            if pickles:
                refuse_pickle(self.path / pickles[0])
            raise ModelError(f"{self.path}: no *.safetensors weights in the folder")
        return files, None

    def _shard(self, index, name) -> Path:
        """The folder's file `name`, refusing anything that leads out of the model folder
        (platform.files.folder_file): an absolute path, "..", a subfolder, a symlink whose target is
        elsewhere (except into the hub cache's blobs/) or a non-regular file."""
        try:
            return folder_file(self.path, name, required=True, what="shard", where=index)
        except ModelError:
            raise ModelError(f"{index or self.path}: shard {str(name)[:80]} is listed but missing from the "
                             "folder") from None

    def _open_weights(self) -> None:
        files, weight_map = self._weight_files()
        for f in files:
            self._files[f.name] = SafetensorsFile(f)
        tied = bool(self.config.get("tie_word_embeddings", False))
        self._stored = {}                           # HF name -> name in the file, where they differ
        for fname, sf in self._files.items():
            for stored, (shape, dtype, _, _) in sf.tensors.items():
                if stored.endswith(self._IGNORED_SUFFIXES):
                    continue
                if weight_map is not None and weight_map.get(stored) != fname:
                    continue                        # the index decides which shard owns a name
                name = stored if self._rename is None else self._rename(stored)
                if name is None:
                    continue                        # a vision tensor of a multimodal Gemma 3
                if name != stored:
                    self._stored[name] = stored
                if name in self._info:
                    raise FormatError(f"{self.path}: tensor {name!r} appears in both "
                                      f"{self._where[name].path.name} and {fname}")
                if tied and name == "lm_head.weight":
                    continue                        # contract: absent when tied (some checkpoints save a copy)
                self._info[name] = (shape, dtype)
                self._where[name] = sf
        if weight_map is not None:
            for name, fname in weight_map.items():
                if name not in self._files[fname].tensors:
                    raise FormatError(f"{self.path / fname}: tensor {name!r} is listed in the index "
                                      "but not stored in this shard")

    def _read(self, name: str) -> np.ndarray:
        return self._where[name].read(self._stored.get(name, name))

    def extra_tensor(self, name: str) -> np.ndarray:
        where = self._dense.get(name)
        if where is None:
            return super().extra_tensor(name)
        sf = SafetensorsFile(where[0])
        try:
            arr = np.asarray(sf.read(where[1]), dtype=np.float32)
        finally:
            sf.close()
        if not np.isfinite(arr).all():
            raise FormatError(f"{where[0]}: tensor {where[1]!r} holds NaN/Inf values")
        return arr

    def _load_tokenizer(self):
        from mixqrt.generation.tokenizer import Tokenizer, vocab_id
        eos = []
        for d in (self.generation_config, self.config):
            v = d.get("eos_token_id")
            eos += [i for i in (v if isinstance(v, list) else [v]) if isinstance(i, int) and not isinstance(i, bool)]
        tk = Tokenizer.from_folder(self.path, extra_eos_ids=eos)
        if tk.bos_token_id is None and self.config.get("bos_token_id") is not None:
            tk.bos_token_id = vocab_id("config.json: bos_token_id", self.config["bos_token_id"], tk.vocab_size)
        return tk

    def close(self) -> None:
        for sf in self._files.values():
            sf.close()
        self._files.clear()


_MODULE_DIR = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_ST = "sentence_transformers.models."
_POOL_KEYS = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
              ("pooling_mode_cls_token", "cls"))
MAX_MODULES = 16


def _module_folder(folder: Path, sub) -> Path:
    """A sentence-transformers module's folder: a plain name directly inside the model folder."""
    if not isinstance(sub, str) or not _MODULE_DIR.fullmatch(sub) or ".." in sub:
        raise FormatError(f"{folder / 'modules.json'}: module path {str(sub)[:80]!r} is not a plain folder name")
    d = folder / sub
    if d.is_symlink() or not d.is_dir():
        raise FormatError(f"{folder / 'modules.json'}: module folder {sub!r} is missing or not a folder")
    return d


def sentence_transformers_info(folder: Path, config: dict) -> tuple[dict | None, dict]:
    """mixqrt.generation.embed's settings from a sentence-transformers folder (modules.json: Pooling from
    1_Pooling/config.json, Dense projections, Normalize) -> (embedding dict or None, {mxq dense
    name: (safetensors file, tensor name)}). None for a folder without modules.json."""
    from mixqrt.generation.embed import dense_name
    mods = folder_file(folder, "modules.json", what="sentence-transformers modules")
    if mods is None:
        return None, {}
    try:
        data = json.loads(read_text(mods, MAX_JSON))
    except (json.JSONDecodeError, RecursionError) as e:
        raise FormatError(f"{mods}: not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(data, list) or len(data) > MAX_MODULES or not all(isinstance(m, dict) for m in data):
        raise FormatError(f"{mods}: expected a list of at most {MAX_MODULES} module objects")
    info = {"pooling": None, "normalize": False, "causal": not config.get("use_bidirectional_attention", False),
            "dense": [], "matryoshka": False}
    dense = {}
    for m in data:
        kind = m.get("type")
        if kind == _ST + "Pooling":
            cfg = _read_json(_module_folder(folder, m.get("path")), "config.json", "pooling config")
            modes = [name for key, name in _POOL_KEYS if cfg.get(key) is True]
            others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True
                      and k not in dict(_POOL_KEYS)]
            if len(modes) != 1 or others:
                raise ModelError(f"{mods}: pooling {', '.join(modes + others) or 'none'} is not supported "
                                 "(one of last token, mean, CLS)")
            info["pooling"] = modes[0]
        elif kind == _ST + "Dense":
            sub = _module_folder(folder, m.get("path"))
            cfg = _read_json(sub, "config.json", "dense config")
            wfile = folder_file(sub, "model.safetensors", what="dense weights")
            if wfile is None:
                raise ModelError(f"{sub}: no model.safetensors (the dense layer's weights)")
            i = len(info["dense"])
            act = cfg.get("activation_function")
            bias = bool(cfg.get("bias", False))
            dense[dense_name(i)] = (wfile, "linear.weight")
            if bias:
                dense[dense_name(i, "bias")] = (wfile, "linear.bias")
            info["dense"].append([dense_name(i), dense_name(i, "bias") if bias else None,
                                  "identity" if act in (None, "torch.nn.modules.linear.Identity") else str(act)[:80]])
        elif kind == _ST + "Normalize":
            info["normalize"] = True
        elif kind != _ST + "Transformer":
            raise ModelError(f"{mods}: module type {str(kind)[:80]!r} is not supported")
    info["matryoshka"] = bool(info["dense"]) or info["pooling"] == "last"
    return info, dense
