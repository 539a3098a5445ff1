"""Every Python snippet in the README that needs no download runs as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPETS = [s for s in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if "fishaudio/" not in s]


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[f"snippet{i}" for i in range(len(SNIPPETS))])
def test_readme_snippet_runs(snippet):
    exec(compile(snippet, str(README), "exec"), {})


def test_readme_has_runnable_snippets():
    assert SNIPPETS
