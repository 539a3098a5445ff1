"""Every Python snippet in the README that needs no download runs as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
# Snippets that load the published weights or the reader's own files are shown, not run.
NEEDS_FILES = ("fishaudio/", "path/to/")
SNIPPETS = [
    s for s in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if not any(m in s for m in NEEDS_FILES)
]


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[f"snippet{i}" for i in range(len(SNIPPETS))])
def test_readme_snippet_runs(snippet):
    exec(compile(snippet, str(README), "exec"), {})


def test_readme_has_runnable_snippets():
    assert SNIPPETS
