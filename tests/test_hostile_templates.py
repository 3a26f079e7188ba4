"""Hostile chat templates (issue 39, item 2): a template comes with a downloaded model and is
untrusted. Each render is bounded (output, work, loop steps, time); anything a template raises or
exceeds is a TemplateError for that request (a 400 from the server, never a 500 or an OOM kill);
a template that fails on a probe conversation is a warning at load; config ids are checked
against the vocabulary at load."""
from __future__ import annotations

import json
import logging
import resource
import time

import pytest

from mixqrt.generation.chat_template import TemplateError, render
from mixqrt.errors import MixqrtError, ModelError
from mixqrt.testing.tiny import make_tiny_hf_model
from mixqrt.generation.tokenizer import Tokenizer

MSGS = [{"role": "user", "content": "hi"}]
BOMBS = {
    "division by zero": "{{ 1/0 }}",
    "a 1 GB string": "{{ 'x' * 10**9 }}",
    "a list printed 1000 times a MB": "{{ [('x' * 1000000)] * 1000 }}",
    "join of 1000 MB strings": "{{ ([('x' * 1000000)] * 1000) | join }}",
    "doubling with ~": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "doubling with +": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "10^10 loop steps": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "ljust": "{{ 'x'.ljust(10**9) }}",
    "% width": "{{ '%1000000000d' % 1 }}",
    "format width": "{{ '{:>1000000000}'.format(1) }}",
    "center filter": "{{ 'x' | center(10**9) }}",
    "indent filter": "{{ 'a\nb' | indent(10**9) }}",
    "replace blow-up": "{{ ('x' * 100000).replace('x', 'y' * 100000) }}",
    "expandtabs": "{{ '\t'.expandtabs(10**9) }}",
    "huge power": "{{ 7 ** 10000000 }}",
    "recursive macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "dict printed": "{% set s = 'x' * 4000000 %}{{ {'a': s, 'b': s, 'c': s} }}",
    "string filter": "{% set s = 'x' * 4000000 %}{{ [s, s, s] | string }}",
    "tojson indent": "{{ messages | tojson(indent=1000000000) }}",
    "type error": "{{ messages + 1 }}",
    "unsafe": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_template_bombs_are_typed_errors_in_bounded_time_and_memory(name):
    peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    with pytest.raises(MixqrtError) as e:
        render(BOMBS[name], MSGS)
    assert isinstance(e.value, (TemplateError, ModelError))
    assert time.perf_counter() - t < 30                   # (a hang would be the failure; not a timing claim)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak0 < 400 << 10    # KiB: under 400 MiB more


def test_ordinary_templates_still_render():
    assert render("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}{% endfor %}{{ 'x' ~ 1 }}", MSGS) == "<user>hix1"
    assert render("{{ messages | map(attribute='content') | join(', ') }}{{ ' '.join(['a', 'b']) }}", MSGS) == "hia b"
    assert render("{% set mixqrt_bounded_iter = 1 %}{% for i in range(3) %}{{ i }}{% endfor %}", MSGS) == "012"
    assert render("{{ '%s-%d' % ('a', 2) }}{{ 'x' * 3 }}{{ 2 ** 10 }}{{ messages | tojson(indent=2) | length > 0 }}",
                  MSGS) == "a-2xxx1024True"


def _tiny(tmp_path, tokenizer_cfg=None, config=None):
    d = make_tiny_hf_model(tmp_path / "hf")
    for name, over in (("tokenizer_config.json", tokenizer_cfg), ("config.json", config)):
        if over:
            cfg = json.loads((d / name).read_text())
            cfg.update(over)
            (d / name).write_text(json.dumps(cfg))
    return d


def test_a_template_failing_its_probe_is_a_warning_at_load(tmp_path, caplog):
    d = _tiny(tmp_path, {"chat_template": "{{ 1/0 }}"})
    with caplog.at_level(logging.WARNING, logger="mixqrt"):
        tok = Tokenizer.from_folder(d)
    assert "fails on a probe conversation" in caplog.text and "ZeroDivisionError" in caplog.text
    with pytest.raises(TemplateError, match="ZeroDivisionError"):
        tok.apply_chat_template(MSGS)


@pytest.mark.parametrize("key,value", [("bos_token_id", -1), ("bos_token_id", 10**30), ("bos_token_id", "1"),
                                       ("eos_token_id", -5), ("eos_token_id", [1, 2 ** 70])])
def test_config_ids_are_checked_against_the_vocabulary(tmp_path, key, value):
    from mixqrt.io.hf import HFSource
    d = _tiny(tmp_path, config={key: value})
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("bos_token", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(MixqrtError, match=key):       # FormatError (outside int64) or ModelError (the vocabulary)
        with HFSource(d) as src:
            src.tokenizer


def test_server_answers_a_broken_template_with_a_400(tmp_path):
    pytest.importorskip("starlette")
    from asgi_helpers import call
    from serve_helpers import tiny_pipeline

    from mixqrt.serving.server.app import create_app
    pipe = tiny_pipeline(tmp_path)
    app = create_app(pipe, model="tiny")
    try:
        for src in ("{{ 1/0 }}", "{{ 'x' * 10**9 }}", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"):
            pipe.tokenizer.chat_template = src
            status, _, body = call(app, "POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2})
            assert status == 400, (src, status, body)
            assert "chat template" in body["error"]["message"]
    finally:
        app.state.server.engine.close()
