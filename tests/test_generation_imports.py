"""Generation's place among the modules: the model imports generation, never the reverse; long-form
sits above the processor; neither hides an import inside a function."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "transformers_drama3"


def imports_of(path: Path) -> list[tuple[str, bool]]:
    """(module imported, relative to the package where it is ours; whether at module level)."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            name = ("." * node.level) + (node.module or "")
            found.append((name, id(node) in top_level))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, id(node) in top_level) for alias in node.names)
    return found


def internal(name: str) -> str | None:
    """`.codec.streaming` -> "codec.streaming"; a module outside the package -> None."""
    if name.startswith("transformers_drama3."):
        return name.removeprefix("transformers_drama3.")
    return name.lstrip(".") if name.startswith(".") else None


GENERATION = ["generation_drama3.py", "generation/call.py", "generation/outputs.py", "generation/arguments.py"]


@pytest.mark.parametrize("module", GENERATION)
def test_generation_imports_nothing_above_it(module):
    # prompting's text rules (the CJK reading rate) sit below the processor and import no model
    above = ("modeling_drama3", "processing_drama3", "processing", "runtime", "pipeline_drama3", "training", "serving")
    ours = [internal(name) for name, _ in imports_of(PACKAGE / module) if internal(name) is not None]
    assert not [name for name in ours if name.split(".")[0] in above]
    if module == "generation_drama3.py":
        assert ours, "generation imports some of the package (configuration, codec streaming)"


def test_text_streaming_imports_nothing_above_generation():
    # it drives the processor it is given (duck typed) and builds rows with prompting, below it
    above = ("modeling_drama3", "processing_drama3", "processing", "runtime", "pipeline_drama3", "training", "serving")
    ours = [internal(name) for name, _ in imports_of(PACKAGE / "generation/live_text.py") if internal(name) is not None]
    assert {"generation_drama3", "prompting"} <= set(ours)
    assert not [name for name in ours if name.split(".")[0] in above]


def test_the_model_gets_stream_text_from_generation_live_text():
    ours = {internal(name): top for name, top in imports_of(PACKAGE / "modeling_drama3.py") if internal(name)}
    assert ours.get("generation.live_text") is True


def test_the_model_gets_its_cache_and_generate_from_generation():
    ours = {internal(name): top for name, top in imports_of(PACKAGE / "modeling_drama3.py") if internal(name)}
    assert ours.get("generation_drama3") is True


@pytest.mark.parametrize("module", [*GENERATION, "generation/live_text.py", "runtime/long_form.py", "modeling_drama3.py"])
def test_no_import_is_hidden_inside_a_function(module):
    hidden = [name for name, top in imports_of(PACKAGE / module) if not top and name != "__future__"]
    assert hidden == []


def test_long_form_sits_above_the_processor():
    ours = {internal(name) for name, _ in imports_of(PACKAGE / "runtime/long_form.py")} - {None}
    assert {"processing_drama3", "prompting", "generation_drama3"} <= ours
