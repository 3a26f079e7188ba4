"""The prompt cache on edits of a prompt's tail (what an editor sends at each keystroke): the K/V of
every token up to the first differing one is reused, not only for pure extensions."""
from __future__ import annotations

import numpy as np
import pytest

from mixqrt.engine import Engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from serve_helpers import tiny_pipeline
    pipe = tiny_pipeline(tmp_path_factory.mktemp("fimcache"))
    eng = Engine(pipe, max_slots=2)
    yield eng
    eng.close()


def _run(eng, ids):
    last = None
    for r in eng.submit(ids, max_new_tokens=3, temperature=0):
        last = r
    return last


@pytest.mark.parametrize("edit", ["replace", "insert", "delete", "extend"])
def test_tail_edit_reuses_kv_up_to_the_first_difference(engine, edit):
    rng = np.random.default_rng(hash(edit) % 1000)
    base = [int(t) for t in rng.integers(10, 300, size=120)]
    _run(engine, base)
    k = 100                                        # the first differing position
    new = {"replace": base[:k] + [301] + base[k + 1:], "insert": base[:k] + [302, 303] + base[k:],
           "delete": base[:k] + base[k + 3:], "extend": base + [304, 305]}[edit]
    first = next(i for i, (a, b) in enumerate(zip(base, new)) if a != b) if edit != "extend" else len(base)
    r = _run(engine, new)
    assert r.cached_tokens == min(first, len(new) - 1)


def test_edited_prompt_gives_the_same_tokens_as_a_cold_one(engine):
    base = list(range(20, 140))
    new = base[:90] + [7, 8, 9] + base[95:]
    _run(engine, base)
    warm = [r.token for r in engine.submit(new, max_new_tokens=6, temperature=0) if r.token is not None]
    cold = [r.token for r in engine.submit(new, max_new_tokens=6, temperature=0, cache_prompt=False)
            if r.token is not None]
    assert warm == cold
