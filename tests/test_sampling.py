"""make_sampler / SamplingParams.logits_processors: greedy, truncation filters, determinism, validation."""
import numpy as np
import pytest

from mixqrt.errors import GenerationError
from mixqrt.generation.params import SamplingParams
from mixqrt.generation.sampling import make_sampler


def make_logits_processors(**kw):
    return SamplingParams(**kw).logits_processors(0, None)


def draws(sampler, logits, n=400):
    return np.array([sampler(logits.copy()) for _ in range(n)])


def test_greedy():
    logits = np.array([0.1, 3.0, -1.0, 2.9], dtype=np.float32)
    s = make_sampler(0.0, top_k=1, top_p=0.5)
    assert s(logits) == 1 and isinstance(s(logits), int)


def test_tiny_temperature_is_greedy():
    """5e-324 used to overflow 1/t into NaN probabilities and draw the last token."""
    logits = np.array([0.1, 3.0, -1.0, 2.9, 0.0], dtype=np.float32)
    for t in (5e-324, 1e-300, 1e-8, 9.99e-6):
        assert set(draws(make_sampler(t, seed=0), logits, 50)) == {1}
    assert len(set(draws(make_sampler(1e-2 + 1.0, seed=0), logits, 400))) > 1   # real sampling above


def test_top_k_top_p_min_p_truncate():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.05, 0.05])).astype(np.float32)
    assert set(draws(make_sampler(1.0, top_k=2, seed=0), logits)) == {0, 1}
    # nucleus 0.65: {0.4, 0.3} reaches 0.7 >= 0.65 -> tokens 0, 1
    assert set(draws(make_sampler(1.0, top_p=0.65, seed=0), logits)) == {0, 1}
    # just above 0.7 of mass needs token 2
    assert set(draws(make_sampler(1.0, top_p=0.71, seed=0), logits)) == {0, 1, 2}
    # min_p 0.6: keep p >= 0.24 -> tokens 0, 1
    assert set(draws(make_sampler(1.0, min_p=0.6, seed=0), logits)) == {0, 1}
    # all filters off: every token shows up, frequencies near the distribution
    d = draws(make_sampler(1.0, seed=1), logits, n=4000)
    freq = np.bincount(d, minlength=5) / d.size
    np.testing.assert_allclose(freq, [0.4, 0.3, 0.2, 0.05, 0.05], atol=0.03)
    # top_k then top_p on the renormalised remainder (transformers' order): top2 -> {0.571, 0.429}
    assert set(draws(make_sampler(1.0, top_k=2, top_p=0.5, seed=0), logits)) == {0}


def test_top_p_on_large_flat_and_peaked_vocab():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(150_000).astype(np.float32)
    logits[7] = 30.0
    assert set(draws(make_sampler(0.7, top_p=0.9, seed=0), logits, 50)) == {7}
    flat = np.zeros(1000, dtype=np.float32)           # threshold prefilter must fall back to all tokens
    assert len(set(draws(make_sampler(1.0, top_p=0.5, seed=0), flat, 300))) > 100


def test_temperature_sharpens():
    logits = np.array([1.0, 0.0], dtype=np.float32)
    hot = draws(make_sampler(5.0, seed=0), logits, 2000).mean()
    cold = draws(make_sampler(0.2, seed=0), logits, 2000).mean()
    assert cold < 0.02 < 0.3 < hot


def test_seed_determinism():
    logits = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    a = draws(make_sampler(0.8, top_k=50, top_p=0.9, seed=123), logits, 50)
    b = draws(make_sampler(0.8, top_k=50, top_p=0.9, seed=123), logits, 50)
    c = draws(make_sampler(0.8, top_k=50, top_p=0.9, seed=124), logits, 50)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_repetition_penalty_hf_semantics():
    (proc,) = make_logits_processors(repetition_penalty=2.0, repetition_context_size=3)
    logits = np.array([4.0, -4.0, 4.0, -4.0, 1.0], dtype=np.float32)
    out = proc(np.array([9 % 5, 0, 1, 1, 3]), logits.copy())          # window = last 3: {1, 3}
    np.testing.assert_array_equal(out, [4.0, -8.0, 4.0, -8.0, 1.0])
    out = proc(np.array([0, 2]), logits.copy())
    np.testing.assert_array_equal(out, [2.0, -4.0, 2.0, -4.0, 1.0])
    assert make_logits_processors() == [] and make_logits_processors(repetition_penalty=1.0) == []


@pytest.mark.parametrize("kw,msg", [({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"),
                                    ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
                                    ({"top_k": 2.5}, "top_k"), ({"min_p": 2.0}, "min_p"),
                                    ({"temperature": float("nan")}, "temperature"), ({"seed": "x"}, "seed")])
def test_sampler_bad_args(kw, msg):
    with pytest.raises(GenerationError, match=msg):
        make_sampler(**kw)
    assert issubclass(GenerationError, ValueError)


def test_processor_bad_args():
    with pytest.raises(GenerationError, match="repetition_penalty"):
        make_logits_processors(repetition_penalty=0.0)
    with pytest.raises(GenerationError, match="repetition_context_size"):
        make_logits_processors(repetition_penalty=1.1, repetition_context_size=0)
