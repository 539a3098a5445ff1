"""Every Python block of the README and of the documentation pages (docs/**/*.md) runs as written,
unless it says it needs the published weights.

A block that loads `fishaudio/drama-3` (or its files) cannot run here; it opens with the line
`NEEDS_WEIGHTS` and is shown only. Every other block runs. A page reads as one session: its
blocks run in order in one namespace and one scratch folder (so a guide sets up a model once and
later blocks use it; blocks may write files such as a take). A block run alone (`-k`) first runs
the page's blocks before it. Tracebacks name the page and its line.
"""

import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NEEDS_WEIGHTS = "# needs the published weights (fishaudio/drama-3): shown, not run by the tests"
FENCE = re.compile(r"^( *)```python\n(.*?)^\1```", re.S | re.M)


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root, as ids and tracebacks show it
    line: int  # of the block's first code line in the page
    code: str

    @property
    def shown_only(self) -> bool:
        return self.code.startswith(NEEDS_WEIGHTS)

    def compiled(self):
        # padded so that a traceback's line number is the page's
        return compile("\n" * (self.line - 1) + self.code, str(ROOT / self.page), "exec")


def page_blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    return [
        Block(page.relative_to(ROOT).as_posix(), text.count("\n", 0, match.start(2)) + 1,
              textwrap.dedent(match.group(2)) if match.group(1) else match.group(2))
        for match in FENCE.finditer(text)
    ]


BLOCKS = [block for page in PAGES for block in page_blocks(page)]
RUNNABLE = [block for block in BLOCKS if not block.shown_only]


@dataclass
class Session:
    """One page's namespace and scratch folder, and how many of its runnable blocks have run."""

    folder: Path
    namespace: dict = field(default_factory=dict)
    ran: int = 0


SESSIONS: dict[str, Session] = {}


@pytest.mark.parametrize("block", RUNNABLE, ids=[f"{block.page}:{block.line}" for block in RUNNABLE])
def test_snippet_runs(block, tmp_path_factory, monkeypatch):
    page = [each for each in RUNNABLE if each.page == block.page]
    index = page.index(block)
    session = SESSIONS.get(block.page)
    if session is None or session.ran > index:  # a fresh page, or a block run again
        session = SESSIONS[block.page] = Session(tmp_path_factory.mktemp(Path(block.page).stem))
    monkeypatch.chdir(session.folder)
    for earlier in page[session.ran : index]:  # catch up: the blocks before it on its page
        exec(earlier.compiled(), session.namespace)
        session.ran += 1
    exec(block.compiled(), session.namespace)
    session.ran += 1
    if session.ran == len(page):  # the page's last block: let its models go
        del SESSIONS[block.page]


def test_only_blocks_that_need_the_published_weights_are_left_unrun():
    shown_only = [block for block in BLOCKS if block.shown_only]
    assert all("fishaudio/drama-3" in block.code or "codec.pth" in block.code for block in shown_only)
    # a block that names the published weights without the mark would run, and fail: say it
    assert not [f"{block.page}:{block.line}" for block in RUNNABLE if 'from_pretrained("fishaudio/' in block.code]


def test_the_pages_have_runnable_snippets():
    pages = {block.page for block in RUNNABLE}
    assert "README.md" in pages
    assert len(RUNNABLE) >= 10


def test_blocks_are_found_with_their_lines():
    text = "intro\n\n```python\nx = 1\n```\n\n- item:\n\n  ```python\n  y = x + 1\n  ```\n"
    page = ROOT / "docs" / "example.md"
    found = [(block.line, block.code) for block in _blocks_of(text, page)]
    assert found == [(4, "x = 1\n"), (10, "y = x + 1\n")]


def _blocks_of(text: str, page: Path) -> list[Block]:
    class Page:
        def read_text(self, encoding):
            return text

        def relative_to(self, root):
            return page.relative_to(root)

    return page_blocks(Page())
