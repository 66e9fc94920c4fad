"""The README and docs/ as a reader meets them: every relative link lands, the README stays short."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of `page`: lower case, punctuation dropped, spaces to '-', repeats '-1'."""
    seen: Counter[str] = Counter()
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", FENCE.sub("", page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        out.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
        seen[slug] += 1
    return out


def relative_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def broken(page: Path) -> list[str]:
    bad = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no such heading)")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_lands(page: Path) -> None:
    assert broken(page) == [], f"{page.relative_to(ROOT)} links to what does not exist"


def test_readme_is_short_and_reaches_every_doc_in_one_click() -> None:
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 300
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in relative_links(readme)}
    missing = [str(d.relative_to(ROOT)) for d in (ROOT / "docs").glob("*.md") if d.resolve() not in linked]
    assert missing == [], "docs the README does not link to"


def test_a_broken_link_or_anchor_is_reported(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Top\n\n## Exit status\n\n[ok](#exit-status) [gone](b.md)\n")
    (tmp_path / "c.md").write_text("[ok](a.md#top) [no heading](a.md#nowhere)\n```\n[in code](x.md)\n```\n")
    assert broken(tmp_path / "a.md") == ["b.md (no such file)"]
    assert broken(tmp_path / "c.md") == ["a.md#nowhere (no such heading)"]
