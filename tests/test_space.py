"""The Hugging Face Space folder is self-consistent: its front matter parses and says what the
Space runs, it pins the Gradio the tests ran against, its requirements install this package, and
its app file imports and builds the demo."""

import importlib.util
import re
from pathlib import Path

import pytest

gr = pytest.importorskip("gradio")
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
SPACE = ROOT / "spaces" / "drama3"
SETUP = (ROOT / "setup.py").read_text(encoding="utf-8")
CI = (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def front_matter() -> dict:
    text = (SPACE / "README.md").read_text(encoding="utf-8")
    match = re.match(r"---\n(.*?)\n---\n", text, re.S)
    assert match, "README.md must open with a --- front matter block ---"
    return yaml.safe_load(match.group(1))


def setup_value(name: str) -> str:
    return re.search(rf'^\s*{name}\s*=\s*"([^"]+)"', SETUP, re.M).group(1)


def test_the_front_matter_declares_a_gradio_space_running_the_app_file():
    meta = front_matter()
    assert meta["sdk"] == "gradio"
    assert (SPACE / meta["app_file"]).is_file()
    assert meta["models"] == ["fishaudio/drama-3"]
    assert meta["suggested_hardware"]


def test_the_space_pins_the_gradio_the_tests_run_and_the_demo_extra_pins():
    assert str(front_matter()["sdk_version"]) == setup_value("GRADIO_VERSION") == gr.__version__


def test_the_licence_is_named_and_built_with_fish_audio_is_shown():
    meta = front_matter()
    assert meta["license"] == "other" and meta["license_name"] == "fish-audio-research-license"
    assert meta["license_link"].startswith("https://")
    assert "Built with Fish Audio" in (SPACE / "README.md").read_text(encoding="utf-8")
    assert "Fish Audio Research License" in (SPACE / "NOTICE").read_text(encoding="utf-8")


def test_the_requirements_install_this_package_with_its_demo_extra_and_the_ci_torch():
    requirements = (SPACE / "requirements.txt").read_text(encoding="utf-8").split()
    version = re.search(r'version="([^"]+)"', SETUP).group(1)
    assert f"transformers-drama3[demo]=={version}" in requirements
    torch_pin = re.search(r"pip install --quiet (torch==\S+)", CI).group(1)
    assert torch_pin in requirements


@pytest.mark.slow
def test_the_app_file_imports_and_builds_the_demo_with_its_endpoints():
    spec = importlib.util.spec_from_file_location("space_app", SPACE / "app.py")
    app = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(app)  # loads drama3-tiny (no DRAMA3_MODEL here) and builds the page
    try:
        assert isinstance(app.demo, gr.Blocks)
        assert app.backend.service.model_name == "drama3-tiny"
        names = {dependency.api_name for dependency in app.demo.fns.values()}
        assert {"generate", "revise"} <= names
    finally:
        app.backend.service.engine.stop()
