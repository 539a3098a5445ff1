"""Loading a script of the project (a benchmark) as a module in a test."""

from __future__ import annotations

import importlib.util
import sys
from contextlib import contextmanager
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@contextmanager
def loaded_script(path: Path, name: str):
    """The module of the script at `path`, in `sys.modules` as `name` while it is in use (a script's
    dataclasses resolve their module by name)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
