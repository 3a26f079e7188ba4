"""The documentation stays navigable: every relative link in README.md and docs/**/*.md resolves to a
file of the repository, no page names a path outside it (a scratch script, a lock file, a shared
folder: a reader cannot follow those), and docs/README.md lists every page of docs/ and docs/lab/."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))

# [text](target) and ![alt](target); the target ends at whitespace or ')'. Code spans and fenced
# blocks are removed first, so a link-like string inside code is not a link.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
OUTSIDE = re.compile(r"(?<![\w.~-])(/tmp/|/work/|/root/|/home/)|\.\./shared\b")


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def _links(text: str) -> list[str]:
    text = CODE.sub("", FENCE.sub("", text))
    return [t for t in LINK.findall(text) if not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:|#", t)]


def test_pages_found():
    assert (DOCS / "README.md") in PAGES and len(PAGES) > 10


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page):
    dead = []
    for target in _links(page.read_text(encoding="utf-8")):
        path = target.split("#", 1)[0]
        if not path:
            continue
        dest = (page.parent / path).resolve()
        if not dest.exists() or ROOT not in (dest, *dest.parents):
            dead.append(target)
    assert not dead, f"{_rel(page)}: links that do not resolve inside the repository: {dead}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_paths_outside_the_repository(page):
    bad = [f"{i}: {line.strip()[:120]}" for i, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
           if OUTSIDE.search(line)]
    assert not bad, f"{_rel(page)} names paths outside the repository (use benchmarks/… or describe the method):\n" \
                    + "\n".join(bad)


def test_docs_index_lists_every_top_level_page():
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    listed = {(DOCS / t.split("#", 1)[0]).resolve() for t in _links(index)}
    pages = [p for p in sorted(DOCS.glob("*.md")) + sorted(DOCS.glob("lab/*.md")) if p.name != "README.md"]
    missing = [_rel(p) for p in pages if p.resolve() not in listed]
    assert not missing, f"docs/README.md does not link to: {missing}"


def test_the_checks_catch_what_they_should(tmp_path):
    """The link and path patterns themselves: a dead link, a code span and an outside path."""
    text = ("see [a](missing.md) and [b](README.md#x), `[c](nope.md)`, [d](https://example.com), [e](#top)\n"
            "```\n[f](fenced.md)\n```\n")
    assert _links(text) == ["missing.md", "README.md#x"]
    assert OUTSIDE.search("ran /tmp/x.py") and OUTSIDE.search("texts in ../shared/data")
    assert OUTSIDE.search("`flock /work/bench.lock`") and not OUTSIDE.search("docs/lab/tmp/x")
    assert not OUTSIDE.search("the cache ~/.cache/mixqrt")
