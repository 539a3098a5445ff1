"""The drama3-tiny recipe's commands, as the README, the model card and docs/ write them, name
modules of recipes/drama3_tiny that exist and have a command line."""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "model_card.md", ROOT / "recipes" / "drama3_tiny" / "README.md",
         *sorted((ROOT / "docs").rglob("*.md"))]
COMMANDS = sorted({
    (page.relative_to(ROOT).as_posix(), module)
    for page in PAGES
    for module in re.findall(r"python -m (recipes\.drama3_tiny\.\w+)", page.read_text(encoding="utf-8"))
})


def test_the_pages_name_recipe_commands():
    assert {page for page, _ in COMMANDS} >= {"docs/drama3_tiny.md", "model_card.md", "recipes/drama3_tiny/README.md"}


@pytest.mark.parametrize("page, module", COMMANDS, ids=[f"{page}:{module}" for page, module in COMMANDS])
def test_each_recipe_command_is_a_module_with_a_command_line(page, module, capsys):
    command = importlib.import_module(module)
    with pytest.raises(SystemExit) as exit_:
        command.main(["--help"])
    assert exit_.value.code == 0
    assert module in capsys.readouterr().out  # its usage line names how it is run
