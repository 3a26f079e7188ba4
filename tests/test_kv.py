"""The packed KV cache (mixqrt.kv): its packer and attention kernel against the numpy reference on
every ISA tier, bit for bit; rows of a prompt against single steps; the batch against one sequence;
the cache's write / trim / release rules; the model end to end."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mixqrt.models import kv_cache as cache
from mixqrt import ops
from mixqrt.kv import packed
from mixqrt.errors import GenerationError, KernelError
from mixqrt.kv import ref
from mixqrt.platform import isa

TIERS = list(isa.TIERS[:isa.TIERS.index(isa.best()) + 1])


@pytest.fixture(autouse=True)
def _restore_tier():
    yield
    isa.set_isa(isa.current_default() if hasattr(isa, "current_default") else isa.best())


def _stores(rng, hkv, s, dh, outlier=5.0):
    # keys with per-channel offsets (Qwen's k bias makes such outlier channels)
    kf = (rng.standard_normal((hkv, s, dh)) * 2 + rng.standard_normal((1, 1, dh)) * outlier).astype(np.float16)
    vf = rng.standard_normal((hkv, s, dh)).astype(np.float16)
    return kf, vf


def _packed(kf, vf, nblocks, bits):
    hkv, s, dh = kf.shape
    pk = np.zeros((hkv, s // ref.G, ref.block_bytes(dh, bits)), np.uint8)
    if nblocks > 1:
        ops.pool._ops.kv_pack(kf, vf, 1, nblocks, bits, pk)
    return pk


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), dh=st.sampled_from([32, 64, 128, 256]), bits=st.sampled_from([4, 8]),
       hkv=st.integers(1, 3))
def test_packer_is_the_reference(seed, dh, bits, hkv):
    rng = np.random.default_rng(seed)
    kf, vf = _stores(rng, hkv, 192, dh)
    pk = _packed(kf, vf, 3, bits)
    for h in range(hkv):
        assert not pk[h, 0].any()                                  # block 0 is never packed
        for b in (1, 2):
            want = ref.pack_block(kf[h, b * 64:(b + 1) * 64].astype(np.float32),
                                  vf[h, b * 64:(b + 1) * 64].astype(np.float32), bits)
            assert np.array_equal(pk[h, b], want)


@given(seed=st.integers(0, 2**31 - 1), dh=st.sampled_from([32, 64, 96, 128, 256]))
@settings(max_examples=20, deadline=None)
def test_value_rotation_is_orthonormal(seed, dh):
    """q4's value rotation (blocks of head_dim's largest power-of-two divisor) keeps norms and undoes
    itself; the fused decode layer's C rotation is checked bit for bit in tests/test_fused_decode.py."""
    x = np.random.default_rng(seed).standard_normal((3, dh)).astype(np.float32)
    y = ref.fwht(x)
    assert np.allclose(np.linalg.norm(y, axis=1), np.linalg.norm(x, axis=1), rtol=1e-5)
    assert np.allclose(ref.fwht(y), x, atol=1e-5)


def test_layouts_round_trip():
    rng = np.random.default_rng(1)
    for bits in (4, 8):
        for dh in (32, 64, 128):
            c = rng.integers(0, 1 << bits, (64, dh))
            assert np.array_equal(ref.k_unlayout(ref.k_layout(c, bits), dh, bits), c)
            assert np.array_equal(ref.v_unlayout(ref.v_layout(c, bits), dh, bits), c)


def test_packed_block_error_is_small():
    rng = np.random.default_rng(2)
    kf, vf = _stores(rng, 1, 128, 64)
    for bits, tol in ((4, 0.08), (8, 0.005)):
        k, v = ref.dequant_block(ref.pack_block(kf[0, 64:].astype(np.float32), vf[0, 64:].astype(np.float32), bits),
                                 64, bits)
        kk, vv = kf[0, 64:].astype(np.float32), vf[0, 64:].astype(np.float32)
        rk = np.abs(k - kk).max(0) / (kk.max(0) - kk.min(0))       # per channel, against its range
        if bits == 4:      # NF4 levels: at most half the widest gap (-127 .. -88) of the position's scale,
            rv = np.abs(v - vv).max(1) / np.abs(vv).max(1)        # absmax / 127 rounded up by < 2^(1/12)
            assert rk.max() <= tol and rv.max() <= 19.5 * 2 ** (1 / 12) / 127 + 1e-3
        else:
            rv = np.abs(v - vv).max(1) / (vv.max(1) - vv.min(1))
            assert rk.max() <= tol and rv.max() <= tol


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), spread=st.sampled_from([0.2, 1.0, 30.0]))
def test_q4_key_ranges_are_searched(seed, spread):
    """Each half-block's (a, b) is the least-error candidate: never worse, channel by channel, than
    the range that just covers the half (the first round's choice), and better on the whole."""
    rng = np.random.default_rng(seed)
    k = (rng.standard_normal((64, 64)) * rng.uniform(0.1, spread, 64)
         + rng.standard_normal(64) * 3).astype(np.float16).astype(np.float32)
    ks, km, adj, codes = ref._q4_keys(k)
    total_search = total_cover = 0.0
    for i in range(ref.NSUB):
        x = k[i * ref.SUB:(i + 1) * ref.SUB]
        got = ref._sub_error(x, *ref.sub_ranges(ks, km, adj[i]))
        pos = ks > 0
        div = np.where(pos, ks, np.float32(1))
        a = np.where(pos, np.clip(np.floor((x.min(0) - km) / div), 0, 15), 0).astype(np.int32)
        need = ((x.max(0) - (km + ks * a.astype(np.float32))) * np.float32(16)) / (div * np.float32(15))
        b1 = np.where(pos, np.clip(np.ceil(need), 1, 16), 16).astype(np.int32)
        cover = ref._sub_error(x, *ref.sub_ranges(ks, km, (a | ((b1 - 1) << 4)).astype(np.uint8)))
        assert (got <= cover).all()
        total_search += got.sum(); total_cover += cover.sum()
    assert total_search <= total_cover


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), dh=st.sampled_from([64, 96, 128, 256]), g=st.sampled_from([1, 2, 4, 7, 9, 17]),
       hkv=st.integers(1, 2), t=st.integers(1, 11), pos0=st.integers(0, 400), bits=st.sampled_from([4, 8]),
       window=st.sampled_from([0, 0, 5, 64, 70]))
def test_attention_every_tier_is_the_reference(seed, dh, g, hkv, t, pos0, bits, window):
    rng = np.random.default_rng(seed)
    s = -(-(pos0 + t) // 64) * 64 + 64 * rng.integers(0, 2)
    kf, vf = _stores(rng, hkv, s, dh)
    # a windowed layer keeps f16 only; otherwise the blocks complete at the last row are packed
    pk = None if window else _packed(kf, vf, (pos0 + t) // 64, bits)
    q = rng.standard_normal((t, g * hkv, dh)).astype(np.float32)
    want = ref.attention(q, kf.astype(np.float32), vf.astype(np.float32), pk, pos0, bits, window or None)
    for tier in TIERS:
        isa.set_isa(tier)
        got = ops.kv_attention(q, kf, vf, pk, pos0, bits, window or None)
        assert np.array_equal(got, want), (tier, np.abs(got - want).max())


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), pos0=st.integers(0, 300), t=st.integers(2, 40), bits=st.sampled_from([4, 8]))
def test_prompt_rows_are_single_steps(seed, pos0, t, bits):
    """Row r of a T-row call equals the one-row call at pos0 + r on the stores as they are after the
    whole write (what a row reads depends on its position only)."""
    rng = np.random.default_rng(seed)
    s = -(-(pos0 + t) // 64) * 64
    kf, vf = _stores(rng, 2, s, 64)
    pk = _packed(kf, vf, (pos0 + t) // 64, bits)
    q = rng.standard_normal((t, 14, 64)).astype(np.float32)
    rows = ops.kv_attention(q, kf, vf, pk, pos0, bits)
    for r in range(t):
        one = ops.kv_attention(q[r:r + 1], kf, vf, pk, pos0 + r, bits)
        assert np.array_equal(rows[r:r + 1], one)


def test_batch_is_single_sequences():
    rng = np.random.default_rng(3)
    caches, qs, pos = [], [], []
    for b, n in enumerate((1, 63, 64, 65, 200, 129)):
        c = packed.PackedKVCache(2, 2, 64, 256, "q4", windows=[None, 40])
        for li in range(2):
            k, v = rng.standard_normal((2, n, 2, 64)).astype(np.float32)
            c.write(li, k, v, 0)
        c.advance(n)
        caches.append(c)
        pos.append(n - 1)
    q = rng.standard_normal((len(caches), 14, 64)).astype(np.float32)
    for li in range(2):
        got = ops.kv_attention_batch(q, caches, li, pos)
        for b, c in enumerate(caches):
            assert np.array_equal(got[b:b + 1], c.attend(li, q[b:b + 1], pos[b]))


def test_bad_arguments_are_typed_errors():
    rng = np.random.default_rng(4)
    kf, vf = _stores(rng, 2, 128, 64)
    q = np.zeros((1, 14, 64), np.float32)
    with pytest.raises(KernelError):
        ops.kv_attention(q, kf, vf, None, 128, 4)                  # past the stores
    with pytest.raises(KernelError):
        ops.kv_attention(np.zeros((1, 13, 64), np.float32), kf, vf, None, 0, 4)   # 13 % 2
    with pytest.raises(KernelError):
        ops.kv_attention(q, kf, vf, np.zeros((2, 2, 10), np.uint8), 0, 4)          # wrong packed shape
    with pytest.raises(KernelError):
        ops.kv_attention(q, kf, vf, None, 0, 5)
    with pytest.raises(GenerationError):
        packed.PackedKVCache(2, 2, 48, 128, "q4")                      # head_dim not a multiple of 32
    with pytest.raises(GenerationError):
        cache.make_kv_cache("q3", 2, 2, 64, 128)


def _fill(c, rng, n, start=0):
    for li in range(c.num_layers):
        k, v = rng.standard_normal((2, n, c.num_kv_heads, c.head_dim)).astype(np.float32)
        c.write(li, k, v, start)
    c.advance(start + n)


def test_trim_and_release():
    rng = np.random.default_rng(5)
    c = packed.PackedKVCache(1, 1, 64, 2048, "q4")
    _fill(c, rng, 100)
    assert c.trim(10) == 10 and c.offset == 90                   # within the f16 blocks kept: exact
    _fill(c, rng, 1000, 90)
    assert c.offset == 1090 and c.freed_upto == 1090 // 64 - packed.KEEP
    gone = c.trim(1090 - 300)                                    # into a block whose f16 rows went
    assert gone == 1090 - 256 and c.offset == 256               # down to its start
    _fill(c, rng, 10, 256)                                       # and writing there works
    assert c.offset == 266
    with pytest.raises(GenerationError):
        c.check_room(300, 1)                                     # writes follow the filled positions
    assert c.resident_bytes(c.offset) > 0 and c.nbytes > c.resident_bytes(c.offset)


def test_trimmed_cache_reads_as_a_fresh_one():
    """After a trim and a rewrite, attention equals a cache written straight."""
    rng = np.random.default_rng(6)
    k = rng.standard_normal((300, 2, 64)).astype(np.float32)
    v = rng.standard_normal((300, 2, 64)).astype(np.float32)
    k2 = rng.standard_normal((300, 2, 64)).astype(np.float32)
    a = packed.PackedKVCache(1, 2, 64, 512, "q4")
    a.write(0, k[:200], v[:200], 0); a.advance(200)
    a.write(0, k2[200:300], k2[200:300], 200); a.advance(300)
    a.trim(100 + 20)                                             # to 180: block 2 partial again
    a.write(0, k[180:300], v[180:300], 180); a.advance(300)
    b = packed.PackedKVCache(1, 2, 64, 512, "q4")
    b.write(0, k, v, 0); b.advance(300)
    q = rng.standard_normal((1, 4, 64)).astype(np.float32)
    assert np.array_equal(a.attend(0, q, 299), b.attend(0, q, 299))


def test_windowed_layer_keeps_its_window():
    rng = np.random.default_rng(7)
    c = packed.PackedKVCache(2, 1, 64, 8192, "q4", windows=[128, None])
    assert c.pk[0] is None and c.pk[1] is not None
    _fill(c, rng, 4000)
    q = rng.standard_normal((1, 2, 64)).astype(np.float32)
    want = ref.attention(q, c.kf[0].astype(np.float32), c.vf[0].astype(np.float32), None, 3999, 4, 128)
    assert np.array_equal(c.attend(0, q, 3999), want)
    per_token = cache.kv_bytes_per_token("q4", 2, 1, 64, windows=[128, None])
    assert per_token == cache.kv_bytes_per_token("q4", 1, 1, 64)


def test_bytes_per_value():
    assert cache.kv_bits_per_value("q4", 64) == 4.5 and cache.kv_bits_per_value("q4", 128) == 4.46875
    assert cache.kv_bits_per_value("q8", 64) == 8.5 and cache.kv_bits_per_value("f16", 64) == 16
    assert cache.kv_bytes_per_token("f32", 24, 2, 64) == 24576


def test_model_decode_steps_equal_verify_rows():
    """A tiny model: 9 verification rows in one call give the logits of 9 single steps, bit for bit,
    with the q4 cache, across a block boundary (the rows' products are rows-exact up to 17 rows)."""
    from test_model import tiny_config, tiny_weights

    from mixqrt.models import build_model
    cfg = dict(tiny_config("qwen2", hq=4, hkv=2, dh=64, d=64, inter=96, layers=2, vocab=97),
               max_position_embeddings=256)
    m = build_model(cfg, tiny_weights(cfg, seed=1))
    ids = np.random.default_rng(8).integers(0, m.args.vocab_size, 70)
    a = m.make_cache(128, kv_type="q4")
    m(ids[:60], a, 0)
    rows = m(ids[60:69], a, 60, last_only=False)
    b = m.make_cache(128, kv_type="q4")
    m(ids[:60], b, 0)
    for i in range(9):
        one = m(ids[60 + i:61 + i], b, last_only=True)
        assert np.array_equal(one, rows[i])


def test_blocks_export_and_import():
    """A prompt cache's whole blocks: a cache that imports another's blocks and goes on reads as the
    original does (block 0 and windowed layers travel in f16, the others packed)."""
    rng = np.random.default_rng(9)
    R, B = packed.RECENT, packed.KEEP + 3            # B whole blocks: the oldest have given back their f16 rows
    P = B * 64
    for windows in ([None, None], [None, 2 * P]):
        a = packed.PackedKVCache(2, 2, 64, 4096, "q4", windows=windows)
        _fill(a, rng, P + 8)
        assert a.exportable_blocks() == B
        bare = packed.PackedKVCache(2, 2, 64, 4096, "q4", windows=windows)
        for i in range(B):
            bare.import_block(i, a.export_block(i))
        assert bare.offset == P
        assert bare.freed_upto == B                                  # blocks 1 .. B - 1 came packed only
        k1, v1 = rng.standard_normal((2, 1, 2, 64)).astype(np.float32)
        bare.write(0, k1, v1, P)                                     # rows after it read the R blocks before in f16:
        assert bare.freed_upto == B - R                              # their rows come back dequantized
        for blk in range(B - R, B):
            dk, dv = packed.ref.dequant_block(bare.pk[0][1, blk], 64, 4)
            assert np.array_equal(bare.kf[0][1, blk * 64:(blk + 1) * 64], dk.astype(np.float16))
            assert np.array_equal(bare.vf[0][1, blk * 64:(blk + 1) * 64], dv.astype(np.float16))
        b = packed.PackedKVCache(2, 2, 64, 4096, "q4", windows=windows)
        assert b.copy_from(a, P + 3) == P                           # whole blocks, and the last R blocks' f16 rows
        a.trim(8)
        k, v = rng.standard_normal((2, 40, 2, 64)).astype(np.float32)
        for c in (a, b):
            for li in range(2):
                c.write(li, k, v, P)
            c.advance(P + 40)
        q = rng.standard_normal((3, 14, 64)).astype(np.float32)
        for li in range(2):
            assert np.array_equal(a.attend(li, q, P + 37), b.attend(li, q, P + 37))
        deep = (B - R - 1) * 64 + 36                                 # in a block that came without f16 rows:
        assert b.trim(P + 40 - deep) == P + 40 - (B - R - 1) * 64    # to its start
        with pytest.raises(GenerationError):
            b.import_block(B + 5, a.export_block(0))
    c = packed.PackedKVCache(1, 1, 64, 8192, "q4", windows=[64])
    _fill(c, rng, 1000)
    assert c.exportable_blocks() == 0                            # its window's pages went: nothing to share


def test_block_tree_tails_on_a_packed_cache():
    """The prompt cache keeps a finished sequence's partial last block in f16: a new prompt sharing
    part of it gets whole blocks plus those rows, which read as the original cache's."""
    from mixqrt.generation.prompt_cache import BlockTree
    rng = np.random.default_rng(10)
    a = packed.PackedKVCache(2, 2, 64, 1024, "q4")
    _fill(a, rng, 150)
    toks = rng.integers(0, 1000, 150)
    tree = BlockTree(64)
    assert tree.insert(None, toks, a) == 3                       # 2 blocks and the tail
    prompt = np.concatenate([toks[:140], [5, 6, 7]])
    n, path = tree.match(None, prompt)
    assert n == 140 and isinstance(path[-1], tuple)
    b = packed.PackedKVCache(2, 2, 64, 1024, "q4")
    assert tree.copy_into(path, b) == 140
    q = rng.standard_normal((1, 14, 64)).astype(np.float32)
    a.trim(10)
    for li in range(2):
        assert np.array_equal(a.attend(li, q, 139), b.attend(li, q, 139))
    assert tree.match("other salt", prompt)[0] == 0
    tree.evict(0)
    assert tree.bytes == 0 and not tree.tails and not tree.roots


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-125.0, 0.0, width=32), min_size=1, max_size=64))
def test_fexp2_is_exp2_within_3e6(xs):
    """The attention's base-2 exp (the kernels' kexp2_, ref.fexp2; the tiers equal it bit for bit through
    the attention tests above): within 2.9e-6 of 2^x on its range, exactly 2^n at integers (1 at 0:
    alpha = 1 when the running max stays)."""
    x = np.asarray(xs, np.float32)
    got = ref.fexp2(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    assert np.all(np.abs(got / want - 1.0) <= 3e-6)
    ints = np.arange(-125, 1, dtype=np.float32)                  # f = 0: exactly 2^n, 1 at 0
    assert np.all(ref.fexp2(ints) == np.exp2(ints))
