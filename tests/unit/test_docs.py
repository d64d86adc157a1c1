"""The docs are part of the product: the README opens with what CI runs, stays short and points into a guide
whose every page is reachable, and the config reference is exactly what the schema renders."""

from __future__ import annotations

import re

import yaml

from paratrain.config.docs import PAGE, REGENERATE, render_page
from tests.harness import REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()
DOCS = REPO_ROOT / "docs"
# [text](target): a relative link (no scheme, not a bare #anchor within the page)
LINK = re.compile(r"\]\((?![a-z]+:)([^)#\s]+)(?:#([^)\s]+))?\)")


def test_config_reference_page_is_what_the_generator_renders():
    checked_in = (REPO_ROOT / PAGE).read_text()
    assert checked_in == render_page(), f"{PAGE} is out of date with the schema; regenerate it: {REGENERATE}"


def test_readme_opens_with_the_demo_and_test_commands_that_ci_runs():
    opening = README.split("```")[1].splitlines()
    commands = [line.split("#")[0].strip() for line in opening[1:] if line.strip()]
    assert commands == ["make demo", "make test"]
    assert "make test" in (REPO_ROOT / ".ci/run").read_text()


def test_readme_stays_a_front_page_of_at_most_200_lines():
    assert len(README.splitlines()) <= 200, "move the detail into a guide under docs/ and link to it"


def test_readme_links_resolve_to_files_and_headings_in_the_repository():
    broken = [
        f"{target}#{anchor}" if anchor else target
        for target, anchor in LINK.findall(README)
        if not (REPO_ROOT / target).exists()
        or (anchor and anchor not in heading_slugs((REPO_ROOT / target).read_text()))
    ]
    assert LINK.findall(README), "the README links into docs/"
    assert not broken, f"README.md links to files or headings that do not exist: {broken}"


def test_every_guide_under_docs_is_in_the_site_nav_and_every_nav_entry_exists():
    nav = set(nav_pages(yaml.safe_load((REPO_ROOT / "mkdocs.yml").read_text())["nav"]))
    pages = {path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")}
    assert pages - nav == set(), "add these pages to mkdocs.yml's nav"
    assert nav - pages == set(), "mkdocs.yml's nav names pages that do not exist"


def heading_slugs(markdown: str) -> set[str]:
    """The anchors GitHub (and mkdocs' toc) give a page's headings: lower case, punctuation dropped,
    spaces as hyphens. Headings inside code blocks are not headings."""
    without_code = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    headings = re.findall(r"^#{1,6} +(.+?) *$", without_code, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def nav_pages(entries: list) -> list[str]:
    """The page files of an mkdocs nav, sections flattened."""
    pages: list[str] = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages
