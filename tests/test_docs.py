"""The documentation site (mkdocs.yml, docs/) builds with `mkdocs build --strict`: no broken link
or anchor, no page left out of the nav, no API reference entry that fails to resolve. The guard is
forced too: a site with one planted fault of each kind must fail to build, naming the fault.

The Python blocks of the pages run in tests/test_doc_snippets.py.
"""

import logging
import re
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("material")
pytest.importorskip("mkdocstrings_handlers.python")

from mkdocs.commands.build import build  # noqa: E402
from mkdocs.config import load_config  # noqa: E402
from mkdocs.exceptions import Abort  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "mkdocs.yml"


@pytest.fixture(autouse=True)
def _quiet_mkdocs(monkeypatch):
    # mkdocs-material prints a banner about its successor on every build; it is not a warning of ours
    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")


def build_site(site_dir: Path, **overrides) -> None:
    """`mkdocs build --strict` of the project's mkdocs.yml, with `overrides` of its settings."""
    config = load_config(str(CONFIG), site_dir=str(site_dir), strict=True, **overrides)
    build(config)


def test_the_site_builds_strictly(tmp_path):
    build_site(tmp_path / "site")

    built = {path.relative_to(tmp_path / "site").as_posix() for path in (tmp_path / "site").rglob("index.html")}
    pages = {path.relative_to(ROOT / "docs").as_posix() for path in (ROOT / "docs").rglob("*.md")}
    expected = {page.removesuffix("index.md").removesuffix(".md").rstrip("/") for page in pages}  # mkdocs' page URLs
    expected = {f"{url}/index.html".lstrip("/") for url in expected}
    assert expected <= built, sorted(expected - built)
    # the API reference is generated, not empty: the model's page documents generate() and forward()
    model_page = (tmp_path / "site" / "reference" / "model" / "index.html").read_text(encoding="utf-8")
    for anchor in ("transformers_drama3.Drama3ForSpeechGeneration.generate",
                   "transformers_drama3.Drama3ForSpeechGeneration.forward",
                   "transformers_drama3.Drama3Config"):
        assert f'id="{anchor}"' in model_page, anchor


PLANTED = {
    "a link to a page that does not exist": ("See [the guide](missing.md).", "missing.md"),
    "a link to an anchor that does not exist": ("See [that part](other.md#no-such-part).", "#no-such-part"),
    "an API reference that does not resolve": ("::: transformers_drama3.NoSuchClass", "transformers_drama3.NoSuchClass"),
}


@pytest.mark.parametrize("fault", PLANTED, ids=list(PLANTED))
def test_a_planted_fault_fails_the_build(fault, tmp_path, caplog):
    text, named = PLANTED[fault]
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(f"# Home\n\n{text}\n", encoding="utf-8")
    (docs / "other.md").write_text("# Other\n\n## A part\n", encoding="utf-8")

    with caplog.at_level(logging.WARNING), pytest.raises(Abort):
        build_site(tmp_path / "site", docs_dir=str(docs), nav=["index.md", "other.md"])
    assert named in caplog.text  # the failure names what is broken


def test_a_page_left_out_of_the_nav_fails_the_build(tmp_path, caplog):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n", encoding="utf-8")
    (docs / "forgotten.md").write_text("# Forgotten\n", encoding="utf-8")

    with caplog.at_level(logging.WARNING), pytest.raises(Abort):
        build_site(tmp_path / "site", docs_dir=str(docs), nav=["index.md"])
    assert "forgotten.md" in caplog.text


def test_the_intact_planted_site_builds(tmp_path):
    """The planted sites fail for their fault alone: the same site without one builds."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [that part](other.md#a-part).\n\n::: transformers_drama3.plan_memory\n",
                                   encoding="utf-8")
    (docs / "other.md").write_text("# Other\n\n## A part\n", encoding="utf-8")

    build_site(tmp_path / "site", docs_dir=str(docs), nav=["index.md", "other.md"])
    assert 'id="transformers_drama3.plan_memory"' in (tmp_path / "site" / "index.html").read_text(encoding="utf-8")


def test_the_readme_links_to_pages_that_exist():
    """The README is read on GitHub and PyPI, outside the site: its relative links into docs/ are
    checked here (the site's own links are checked by the strict build)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [target for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme) if "://" not in target]
    missing = [target for target in targets if not (ROOT / target).exists()]
    assert not missing, missing
