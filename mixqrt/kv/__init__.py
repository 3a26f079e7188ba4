"""The packed KV cache (types q4 and q8; the float types f32 / f16 are mixqrt.cache.KVCache, and
mixqrt.cache.make_kv_cache makes either): ``packed`` the cache, ``ref`` the numpy reference of its
format and attention (the spec the C kernels are tested against)."""
