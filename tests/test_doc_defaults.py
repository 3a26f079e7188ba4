"""The defaults and limits that docs/server.md and the README state, read from their text and compared
with the code's, so they cannot drift again (docs/server.md once gave a default recipe two recipes
old). The options table of docs/server.md against `mixqrt serve`'s parser, its request-field bounds
against mixqrt.generation.params, and the README's default recipe and context."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from mixqrt.generation import params
from mixqrt.quantize.recipes import DEFAULT_RECIPE

ROOT = Path(__file__).resolve().parents[1]
SERVER = (ROOT / "docs" / "server.md").read_text()
README = (ROOT / "README.md").read_text()


def _serve_parser() -> argparse.ArgumentParser:
    from mixqrt.serving.server.cli import add_serve_parser
    top = argparse.ArgumentParser()
    sub = top.add_subparsers()
    add_serve_parser(sub)
    return sub.choices["serve"]


def _options_table() -> dict[str, str]:
    """docs/server.md's options table: the first option of each row -> its default column."""
    start = SERVER.index("| option | default |")
    rows = {}
    for line in SERVER[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        m = re.match(r"`(-[-\w]+)", cells[0])
        if m:
            rows[m.group(1)] = cells[1]
    return rows


_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _as_value(text: str):
    """'8' -> 8, '1 MiB' -> 1048576, '`127.0.0.1`' -> '127.0.0.1', 'off' -> False, '10' -> 10."""
    t = text.strip("` ")
    if t == "off":
        return False
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(KiB|MiB|GiB)?(?: \(off\))?", t)
    if m:
        v = float(m.group(1)) * _UNITS.get(m.group(2) or "", 1)
        return int(v) if v.is_integer() else v
    return t


def test_every_documented_serve_option_exists_and_every_concrete_default_matches():
    actions = {o: a for a in _serve_parser()._actions for o in a.option_strings}
    rows = _options_table()
    assert len(rows) > 20
    checked = 0
    for opt, doc in rows.items():
        assert opt in actions, f"docs/server.md documents {opt}, which `mixqrt serve` does not have"
        default = actions[opt].default
        if default is None or isinstance(default, bool) and not default and doc == "":
            continue
        assert _as_value(doc) == default, f"docs/server.md: {opt} default {doc!r}, the code's {default!r}"
        checked += 1
    assert checked >= 10


def test_defaults_decided_at_run_time_are_stated_as_the_code_decides_them():
    from mixqrt.models.config_limits import context_window
    rows = _options_table()
    assert rows["--recipe"].startswith(DEFAULT_RECIPE + " "), rows["--recipe"]
    assert "the model's own" in rows["--ctx"] and context_window(32768) == 32768
    assert "a quarter of the memory" in rows["--kv-cache-bytes"]
    assert rows["--gemm-cache-bytes"].startswith("0")
    assert "the context" in rows["--max-tokens-cap"]


@pytest.mark.parametrize("field, limit", [
    ("`n`", str(params.MAX_N)), ("`logprobs`, `top_logprobs` (chat)", str(params.MAX_TOP_LOGPROBS)),
    ("`logit_bias`", f"at most {params.MAX_LOGIT_BIAS} entries"),
    ("`stop`", f"{params.MAX_STOP} strings of at most {params.MAX_STOP_BYTES} bytes"),
    ("`cache_salt`", f"{params.MAX_ID_CHARS} characters"),
])
def test_request_field_bounds_are_the_params_ones(field, limit):
    row = next(line for line in SERVER.splitlines() if line.startswith(f"| {field} |"))
    assert limit in row.split("|")[-2], f"docs/server.md {field}: {row}"


def test_the_readme_states_the_default_recipe_and_context():
    assert re.search(rf"default recipe,? `{re.escape(DEFAULT_RECIPE)}`", README), "README: the default recipe"
    assert f"`{DEFAULT_RECIPE}` (the default" in README
    assert "The context is the model's own" in README
