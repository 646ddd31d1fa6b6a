"""The README is a guide and docs/ holds one page per subject (issue 42): every relative link in
them leads to a file that exists, and to a heading of it where it names one, so that moving a
section cannot leave a dead link behind; and the README stays short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 400

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text.replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text()):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    """The link targets of the page's prose (code spans and blocks are text, not links)."""
    spans = re.compile(r"`[^`]*`")
    return [
        m.group(1) for line in _prose(path.read_text()) for m in _LINK.finditer(spans.sub("", line))
    ]


def test_slug_is_githubs() -> None:
    assert (
        slug("Certificates (scripted, no openssl incantations)")
        == "certificates-scripted-no-openssl-incantations"
    )
    assert slug("A fleet that heals itself (`remedy:`)") == "a-fleet-that-heals-itself-remedy"
    assert slug("Metrics (`GET /metrics`)") == "metrics-get-metrics"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_a_file_and_heading(page: Path) -> None:
    dead = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            dead.append(
                f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}"
            )
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            dead.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not dead, f"{page.relative_to(ROOT)}: dead links: {dead}"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md")}
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_readme_stays_a_guide() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines < README_MAX_LINES, (
        f"README.md has {lines} lines (limit {README_MAX_LINES}): "
        "move the detail to its page under docs/"
    )
