"""One home per policy: the atomic writer every file write goes through, and a pool that is not
restarted when asked twice for the same size (Pipeline and Engine both pass --threads)."""
import os

import pytest

from mixqrt import ops
from mixqrt.io.atomic import atomic_write


def test_atomic_write_replaces_on_success_and_leaves_nothing_on_error(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    with atomic_write(target, "w", encoding="utf-8") as f:
        f.write("new")
    assert target.read_text() == "new"
    with pytest.raises(RuntimeError):
        with atomic_write(target, "w", encoding="utf-8") as f:
            f.write("half")
            raise RuntimeError("writer died")
    assert target.read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["out.json"]
    with pytest.raises(ValueError):
        with atomic_write(target, "a"):
            pass


def test_set_num_threads_twice_starts_the_pool_once(monkeypatch):
    if ops._ops is None:
        pytest.skip("no native kernels")
    n = ops.get_num_threads()
    starts = []
    real = ops._ops

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def pool_start(self, *a):
            starts.append(a)
            return real.pool_start(*a)

    monkeypatch.setattr(ops, "_ops", Spy())
    assert ops.set_num_threads(n) == n
    assert ops.set_num_threads(n) == n
    assert starts == []


def test_lock_files_live_in_the_cache_not_beside_the_output(tmp_path, monkeypatch):
    """A writer's lock (io.atomic.output_lock) is a file in the cache folder's locks/, so quantizing or
    saving into a user's folder leaves only the output there."""
    from mixqrt.io.atomic import lock_path, output_lock
    monkeypatch.setenv("MIXQRT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "user" / "model.mxq"
    out.parent.mkdir()
    with output_lock(out):
        out.write_bytes(b"x")
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.mxq"]
    assert lock_path(out).parent == tmp_path / "cache" / "locks" and lock_path(out) != lock_path(tmp_path / "x")
