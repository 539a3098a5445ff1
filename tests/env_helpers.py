"""The separate environments some tests run in (`.ci/envs.py`): the client packages, each extra alone."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def environment(name: str) -> str:
    """The Python of one of `.ci/envs.py`'s environments (built if missing, which takes minutes the
    first time on a machine); skips where it cannot be built here (no Python the client needs)."""
    done = subprocess.run([sys.executable, str(ROOT / ".ci" / "envs.py"), name], capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, f".ci/envs.py {name} failed:\n{done.stderr[-4000:]}"
    python = json.loads(done.stdout.strip().splitlines()[-1])[name]
    if python.startswith("skip: "):
        pytest.skip(f"{name}: {python[len('skip: '):]}")
    return python


def bare_environment(**extra: str) -> dict:
    """The variables a subprocess in another environment gets: none of this one's Python settings."""
    return {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp"), **extra}
