"""benchmarks/_common.py's docs/ writer: generated tables between markers, hand-written prose kept."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from _common import replace_blocks, update_doc, write_json  # noqa: E402

PAGE = """# Page

Hand-written intro.

<!-- BEGIN mixqrt:t1 -->
| old | table |
<!-- END mixqrt:t1 -->

Prose between.

<!-- BEGIN mixqrt:t2 -->
old 2
<!-- END mixqrt:t2 -->
Closing words.
"""


def test_update_keeps_prose_and_replaces_tables(tmp_path):
    p = tmp_path / "page.md"
    p.write_text(PAGE)
    update_doc(p, {"t1": "| new | table |\n|---|---|", "t2": "new 2\n"})
    text = p.read_text()
    assert text == (PAGE.replace("| old | table |", "| new | table |\n|---|---|").replace("old 2", "new 2"))
    update_doc(p, {"t1": "| new | table |\n|---|---|", "t2": "new 2"})
    assert p.read_text() == text                                   # idempotent
    assert [x.name for x in tmp_path.iterdir()] == ["page.md"]     # no temporary left behind


def test_missing_page_gets_a_skeleton_and_missing_markers_are_appended(tmp_path, capsys):
    p = tmp_path / "new.md"
    update_doc(p, {"a": "A", "b": "B"}, title="New page")
    text = p.read_text()
    assert text.startswith("# New page\n") and text.index("mixqrt:a") < text.index("mixqrt:b")
    p.write_text("# Page\n\nprose only\n")
    update_doc(p, {"a": "A"})
    assert p.read_text().startswith("# Page\n\nprose only\n") and "A\n<!-- END mixqrt:a -->" in p.read_text()
    assert "no markers for a" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["<!-- BEGIN mixqrt:t -->\nx\n",
                                 "<!-- END mixqrt:t -->\n<!-- BEGIN mixqrt:t -->\n",
                                 "<!-- BEGIN mixqrt:t -->\n<!-- END mixqrt:t -->\n<!-- BEGIN mixqrt:t -->\n"])
def test_broken_markers_raise_and_leave_the_page(tmp_path, bad):
    with pytest.raises(ValueError, match="block 't'"):
        replace_blocks(bad, {"t": "x"})
    p = tmp_path / "page.md"
    p.write_text(bad)
    with pytest.raises(ValueError):
        update_doc(p, {"t": "x"})
    assert p.read_text() == bad


def test_write_json_is_atomic_and_readable(tmp_path):
    p = tmp_path / "data" / "r.json"
    write_json(p, {"b": (1, 2), "a": Path("/x")})
    assert json.loads(p.read_text()) == {"a": "/x", "b": [1, 2]}
    assert [x.name for x in p.parent.iterdir()] == ["r.json"]

