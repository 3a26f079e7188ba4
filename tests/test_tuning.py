"""mixqrt.platform.tuning: every MIXQRT_* switch in one table, validated, pushed into the kernels, shown by doctor."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mixqrt
from mixqrt import ops
from mixqrt.platform import tuning
from mixqrt.errors import KernelError

ROOT = Path(mixqrt.__file__).resolve().parent


def test_every_switch_parses_its_default_and_rejects_garbage():
    for s in tuning.SWITCHES:
        assert tuning.parse(s.name, None) == s.default
        with pytest.raises(KernelError, match=s.name):
            tuning.parse(s.name, "nonsense")
    assert tuning.parse("MIXQRT_LEAN_MV", "0") == 0 and tuning.parse("MIXQRT_GAP_PF", " 4096 ") == 4096
    assert tuning.parse("MIXQRT_ISA", "AVX2") == "avx2"
    for name, bad in (("MIXQRT_NUM_THREADS", "0"), ("MIXQRT_Q3X_PF", "-1"), ("MIXQRT_LEAN_MV", "2")):
        with pytest.raises(KernelError, match=name):
            tuning.parse(name, bad)
    with pytest.raises(KernelError, match="not a mixqrt switch"):
        tuning.value("MIXQRT_NOPE")


def test_no_switch_is_read_outside_tuning():
    """The C sources never call getenv, and the switches' names appear in Python only in tuning.py."""
    src = Path(__file__).resolve().parents[1] / "mixqrt" / "_kernels" / "src"   # the checkout's (a wheel has none)
    assert any(src.rglob("*.c"))
    readers = [p for p in src.rglob("*.[ch]") if "getenv(" in p.read_text()]
    assert readers == []
    names = [s.name for s in tuning.SWITCHES]
    for p in ROOT.rglob("*.py"):
        if p.name == "tuning.py":
            continue
        text = p.read_text()
        for n in names:
            assert f'environ.get("{n}"' not in text and f"environ.get('{n}'" not in text, (p, n)


def test_push_sets_the_kernels_state():
    _ops = ops._ops
    if _ops is None:
        pytest.skip("kernels not built")
    assert _ops.set_q3x_prefetch() == tuning.value("MIXQRT_Q3X_PF")
    assert _ops.set_decode_chunk() == tuning.value("MIXQRT_DECODE_CHUNK")
    old = _ops.set_lean_mv(None)
    try:
        _ops.set_lean_mv(False)
        tuning.push(_ops)
        assert _ops.set_lean_mv(None) == bool(tuning.value("MIXQRT_LEAN_MV")) or _ops.get_isa() == 0
    finally:
        _ops.set_lean_mv(old)


def _run(code, **env):
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                          text=True, cwd=ROOT.parent)


def test_environment_reaches_the_kernels_and_a_bad_value_names_itself():
    out = _run("from mixqrt import ops; print(ops._ops.set_q3x_prefetch(), ops._ops.set_lean_mv(None), "
               "ops.GAP_PREFETCH_BYTES)", MIXQRT_Q3X_PF="4096", MIXQRT_LEAN_MV="0", MIXQRT_GAP_PF="0")
    assert out.returncode == 0, out.stderr
    lean = out.stdout.split()[1]
    assert out.stdout.split()[0] == "4096" and out.stdout.split()[2] == "0"
    assert lean in ("False", "0")   # off (a non-x86 build answers 0 too)
    bad = _run("import mixqrt.ops", MIXQRT_SPIN_US="fast")
    assert bad.returncode != 0 and "MIXQRT_SPIN_US='fast'" in bad.stderr


def test_doctor_lists_every_switch():
    rows = tuning.report()
    assert [r["name"] for r in rows if r["group"] == "switch"] == [s.name for s in tuning.SWITCHES]
    text = tuning.format_report(rows)
    for s in tuning.SWITCHES + tuning.CONFIG:
        assert s.name in text
    json.dumps(rows)
    secret = [r for r in tuning.report() if r["name"] == "MIXQRT_API_KEY"][0]
    assert secret["value"] in (None, "(set)")
