"""The README and the pages under docs/: every relative link and anchor resolves, every code block
runs, and nothing points at notes that are not part of this repository.

Anchors follow GitHub's heading slugs: the heading's text without markup, lower-cased, with
everything but letters, digits, spaces, ``-`` and ``_`` dropped and spaces turned into ``-``; a
repeated slug gets ``-1``, ``-2``, ... appended.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", flags=re.S | re.M)
_CODE_SPAN = re.compile(r"(`+).+?\1", flags=re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and code spans (links in code are not links)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"[`*_~]{1,3}(?=\S)|(?<=\S)[`*_~]{1,3}", "", text)  # emphasis, code marks
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in _FENCE.sub("", path.read_text()).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        n = counts.get(base, 0)
        counts[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: pathlib.Path) -> list[str]:
    return _LINK.findall(_prose(path.read_text()))


@pytest.mark.quick
def test_slugs_follow_github():
    assert slug("The conformance report") == "the-conformance-report"
    assert slug("Decode path: a cache layout problem (measured, not fixed here)") == (
        "decode-path-a-cache-layout-problem-measured-not-fixed-here"
    )
    assert slug("Quiet re-run (the numbers docs/performance.md quotes)") == (
        "quiet-re-run-the-numbers-docsperformancemd-quotes"
    )
    assert slug("`fa.generate` in one jit") == "fagenerate-in-one-jit"
    assert slug("Weights across [frameworks](x.md)") == "weights-across-frameworks"


@pytest.mark.quick
def test_link_parser_finds_links_and_ignores_code(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\nSee [a](a.md#x), ![img](b.png) and [c](https://c.org).\n"
        "`[not](code.md)`\n\n```python\nx = [y](z)\n```\n\n## Title\n"
    )
    assert links(page) == ["a.md#x", "b.png", "https://c.org"]
    assert anchors(page) == {"title", "title-1"}


@pytest.mark.quick
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    problems = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            problems.append(f"{target}: {resolved} does not exist")
            continue
        if not resolved.is_relative_to(ROOT):
            problems.append(f"{target}: {resolved} is outside the repository")
        if anchor:
            if resolved.suffix != ".md":
                problems.append(f"{target}: an anchor into a file that is not Markdown")
            elif anchor not in anchors(resolved):
                problems.append(f"{target}: no heading with slug {anchor!r} in {resolved.name}")
    assert not problems, "\n".join(problems)


@pytest.mark.quick
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_table_rows_have_as_many_cells_as_their_header(page):
    """A ``|`` inside a code span splits a table cell on GitHub unless written ``\\|``."""
    problems, cells = [], None
    text = _FENCE.sub(lambda block: "\n" * block.group(0).count("\n"), page.read_text())
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.startswith("|"):
            cells = None
            continue
        count = len(re.split(r"(?<!\\)\|", line)) - 2
        if cells is None:
            cells = count
        elif count != cells:
            problems.append(f"line {number}: {count} cells, header has {cells}")
    assert not problems, "\n".join(problems)


@pytest.mark.quick
def test_every_page_under_docs_is_linked_from_the_readme():
    linked = {
        (ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md") if "://" not in t
    }
    orphans = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not orphans, f"docs pages the README does not link: {orphans}"


@pytest.mark.quick
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_points_at_private_notes(page):
    text = page.read_text()
    for word in ("shared/", "API.md", "seeds/"):
        assert word not in text, f"{page.name} mentions {word!r}"


def _python_blocks(page):
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


#: Blocks run elsewhere: the sharding example needs 8 devices, so the sharding tests run it in
#: their subprocess (``sharded_tests.py``); the README's blocks are run by
#: ``test_readme.py``.
RUN_ELSEWHERE = {"fa.shard(": "conformance_tests/tests/sharded_tests.py"}

DOC_BLOCKS = [
    pytest.param(block, id=f"{page.name}[{i}]")
    for page in PAGES[1:]
    for i, block in enumerate(_python_blocks(page))
    if not any(marker in block for marker in RUN_ELSEWHERE)
]


@pytest.mark.quick
def test_blocks_run_elsewhere_are_run_there():
    for marker, runner in RUN_ELSEWHERE.items():
        blocks = [b for page in PAGES[1:] for b in _python_blocks(page) if marker in b]
        assert len(blocks) == 1, f"{marker}: {len(blocks)} blocks"
        assert "docs/sharding.md" in (ROOT / runner).read_text(), f"{runner} must run it"


@pytest.mark.quick
def test_the_docs_have_code_blocks_to_run():
    assert len(DOC_BLOCKS) >= 2


@pytest.mark.parametrize("block", DOC_BLOCKS)
def test_docs_code_block_runs(block):
    """Each block runs as written; the blocks assert their own results."""
    assert "assert " in block, "a block that is run must check what it shows"
    exec(compile(block, "docs code block", "exec"), {})


@pytest.mark.quick
def test_no_code_points_at_private_notes():
    """Docstrings and comments name the documents by title, never the team's private notes."""
    packages = ("flax_attention", "torch_reference", "conformance_tests", "benchmarks", "examples")
    this = pathlib.Path(__file__).resolve()
    found = [
        f"{path.relative_to(ROOT)}: {word}"
        for package in packages
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.resolve() != this
        for word in re.findall(
            r"shared/(?:API|seeds|STYLE)|seeds' (?:README|errata)", path.read_text()
        )
    ]
    assert not found, found
