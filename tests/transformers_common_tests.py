"""transformers' own model test battery (`ModelTesterMixin`, `ConfigTester`), imported from the test
files of the INSTALLED transformers version's source distribution.

Those files are not a package on PyPI and are never copied into this repository: `.ci/run` downloads
the source distribution of the installed version at test time and extracts its `tests/*.py` into
`.transformers-tests/<version>/` (ignored by git); `DRAMA3_TRANSFORMERS_TESTS` names another folder
holding them. The tests that use them are skipped, naming both, when neither is there.

The source distribution carries transformers' top-level test files only, not the `generation/`,
`exporters/` and `utils/` test packages three of them import at module level. Those three imports
get stand-ins here, each with what it leaves out:

- `generation.test_utils.GenerationTesterMixin` (the generation tester): a marker class. A model test
  that does not mix the generation tester in declares `all_generative_model_classes = ()`, as
  transformers' own `test_generation_tester_mixin_inheritance` asks; the project's generation tests
  check `generate()` instead.
- `exporters.test_export.ExportTesterMixin` (the export tests, a base of `ModelTesterMixin`): empty,
  so the battery runs no export tests (the project's own tests export the decode step).
- `utils.test_configuration_utils.config_common_kwargs`: empty; `ConfigTester` reads it only for
  configs without sub-configs, and Drama 3's config has two.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

import transformers

ENV_VARIABLE = "DRAMA3_TRANSFORMERS_TESTS"
PACKAGE = "transformers_sdist_tests"
REPOSITORY = Path(__file__).resolve().parent.parent
# The files the battery imports; `.ci/run` extracts all of the source distribution's `tests/*.py`.
REQUIRED_FILES = ("__init__.py", "test_modeling_common.py", "test_configuration_common.py")


def tests_folder() -> Path:
    """Where the installed version's test files are expected: `$DRAMA3_TRANSFORMERS_TESTS`, else
    `.transformers-tests/<installed version>/` at the repository root."""
    configured = os.environ.get(ENV_VARIABLE)
    if configured:
        return Path(configured)
    return REPOSITORY / ".transformers-tests" / transformers.__version__


def missing_reason() -> str | None:
    """Why the battery cannot run here (None when it can)."""
    folder = tests_folder()
    absent = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if not absent:
        return None
    return (
        f"transformers {transformers.__version__}'s test files ({', '.join(absent)}) are not in {folder}: "
        f"`bash .ci/run` downloads them (pip download transformers=={transformers.__version__} --no-binary "
        f":all: --no-deps, then its tests/*.py), or set {ENV_VARIABLE} to a folder holding them"
    )


def _stand_in(name: str, **attributes) -> None:
    module = types.ModuleType(f"{PACKAGE}.{name}")
    module.__dict__.update(attributes)
    sys.modules[module.__name__] = module


def _stand_in_package(name: str) -> None:
    package = types.ModuleType(f"{PACKAGE}.{name}")
    package.__path__ = []
    sys.modules[package.__name__] = package


def load(module: str) -> types.ModuleType:
    """`module` (e.g. "test_modeling_common") of the installed version's tests, imported as a
    submodule of one package so that their relative imports resolve."""
    folder = tests_folder()
    if PACKAGE not in sys.modules:
        package = types.ModuleType(PACKAGE)
        package.__path__ = [str(folder)]
        sys.modules[PACKAGE] = package
        if not (folder / "generation" / "test_utils.py").is_file():
            _stand_in_package("generation")
            _stand_in("generation.test_utils", GenerationTesterMixin=type("GenerationTesterMixin", (), {}))
        if not (folder / "exporters" / "test_export.py").is_file():
            _stand_in_package("exporters")
            _stand_in("exporters.test_export", ExportTesterMixin=type("ExportTesterMixin", (), {}))
        if not (folder / "utils" / "test_configuration_utils.py").is_file():
            _stand_in_package("utils")
            _stand_in("utils.test_configuration_utils", config_common_kwargs={})
    return importlib.import_module(f"{PACKAGE}.{module}")
