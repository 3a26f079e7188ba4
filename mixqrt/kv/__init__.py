"""The packed KV cache (types q4 and q8; the float types f32 / f16 are mixqrt.models.kv_cache.KVCache, and
mixqrt.models.kv_cache.make_kv_cache makes either): ``packed`` the cache, ``ref`` the numpy reference of its
format and attention (the spec the C kernels are tested against)."""

from mixqrt.errors import GenerationError


def check_room(cache, pos0: int, n: int) -> None:
    """Raise GenerationError unless positions pos0 .. pos0+n-1 fit `cache` (offset, max_len) and follow
    its filled ones: the write rule of every KV cache."""
    if pos0 < 0 or pos0 > cache.offset:
        raise GenerationError(f"cannot write at position {pos0}: the cache holds {cache.offset} positions "
                              f"(writes must start at or before the first empty position)")
    if pos0 + n > cache.max_len:
        raise GenerationError(f"KV cache overflow: writing {n} token(s) at position {pos0} needs "
                              f"{pos0 + n} positions, the cache holds at most {cache.max_len}")
