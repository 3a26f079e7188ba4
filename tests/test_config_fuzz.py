"""Lying configs (issue 39, item 3): every field of config.json, generation_config.json,
tokenizer_config.json and GGUF metadata set to hostile values (lone surrogates, huge and negative
ints, NaN, wrong types, nested junk) must load and answer or raise a typed mixqrt error naming the
field: never a raw UnicodeEncodeError, OverflowError, MemoryError or ZeroDivisionError. CI runs a
few hundred cases; the 10^5-case run is `python -m mixqrt.testing.config_fuzz --examples 100000`
(its figures in docs/runtime.md)."""
from __future__ import annotations

import pytest

pytest.importorskip("hypothesis")

from mixqrt.errors import FormatError  # noqa: E402
from mixqrt.models.config_limits import check_generation_config, check_values  # noqa: E402
from mixqrt.testing.config_fuzz import Harness, fuzz  # noqa: E402


def test_config_fuzz_has_no_untyped_errors(tmp_path):
    h = Harness(tmp_path)
    counts = fuzz(h, 400)
    assert counts["untyped"] == 0, h.untyped[:3]
    assert counts["ok"] > 20 and counts["typed"] > 20          # the fuzz reaches both outcomes


@pytest.mark.parametrize("obj,field", [({"top_p": "\ud800"}, "top_p"), ({"a": {"b": ["x", "\udfff"]}}, "a.b[1]"),
                                       ({"n": 2 ** 64}, "n"), ({"eps": float("inf")}, "eps"),
                                       ({"\ud800": 1}, "its key")])
def test_one_helper_names_the_field(obj, field):
    with pytest.raises(FormatError, match=field.replace("[", r"\[").replace("]", r"\]")):
        check_values(obj, "generation_config.json")


def test_generation_config_types():
    assert check_generation_config({"top_p": 0.9, "top_k": 20, "eos_token_id": [1, 2], "other": "kept"}, "g")
    for bad in ({"top_p": "0.9"}, {"top_k": -1}, {"temperature": float("nan")}, {"eos_token_id": ["1"]},
                {"do_sample": "yes"}):
        with pytest.raises(FormatError, match=next(iter(bad))):
            check_generation_config(bad, "g")


def test_a_surrogate_in_generation_config_is_a_typed_error_at_load_and_quantize(tmp_path, monkeypatch):
    import json

    from mixqrt.pipeline import Pipeline
    from mixqrt.testing.tiny import make_tiny_hf_model
    monkeypatch.setenv("MIXQRT_CACHE", str(tmp_path / "cache"))
    d = make_tiny_hf_model(tmp_path / "hf")
    g = json.loads((d / "generation_config.json").read_text())
    g["top_p"] = "\ud800"
    (d / "generation_config.json").write_text(json.dumps(g))
    with pytest.raises(FormatError, match="generation_config.json: top_p"):
        Pipeline(d, recipe="f32", progress=False, offline=True)


def test_template_fuzz_through_the_server_has_no_500_and_bounded_memory(tmp_path):
    from mixqrt.testing.config_fuzz import template_fuzz
    r = template_fuzz(tmp_path, 300)
    assert 500 not in r["statuses"], r["untyped"][:3]
    assert r["statuses"].get(400, 0) > 10 and r["statuses"].get(200, 0) > 0
    assert r["peak_rss"] < 2 * r["idle_rss"], r
