"""Model graphs, one module per architecture (mlx-lm style), and a registry by HF model_type."""
from __future__ import annotations

from mixqrt.models import arch as _arch


def _module(arch: str):
    """The graph of architecture `arch` (an HF model_type, mixqrt.models.arch): its module."""
    import importlib
    a = _arch.get(arch)
    import sys
    mod = a.module or a.name
    return importlib.import_module(mod if "." in mod or mod in sys.modules else f"mixqrt.models.{mod}")


def get_model_class(arch: str):
    """An architecture name (mixqrt.models.arch) -> the Model class (its config dataclass is Model.args_class)."""
    return _module(arch).Model


def build_model(config: dict, weights: dict, arch: str | None = None, generation_config: dict | None = None):
    """Model from an HF config dict and a dict of HF-named tensors (QTensor or float32 arrays)."""
    arch = arch or (config or {}).get("model_type")
    cls = get_model_class(arch)
    return cls(cls.args_class.from_dict(config, model_type=arch), weights, generation_config)


def load_f32(source, tensor_filter=None):
    """Model with every tensor from ``source`` (mixqrt.io Source) as a float32 array (reference runs)."""
    names = [n for n in source.tensor_names() if tensor_filter is None or tensor_filter(n)]
    weights = {n: source.get(n) for n in names}
    return build_model(source.config, weights, arch=source.arch,
                       generation_config=getattr(source, "generation_config", None))
