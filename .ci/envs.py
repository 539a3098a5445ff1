"""Separate Python environments for the tests that need other packages than the project's test
environment: the client packages driven against `drama3 serve` (pipecat, LiveKit, LiteLLM, the openai
SDK; wyoming-openai on Python >= 3.12), and one environment per extra of the project ([serve],
[train], [demo], [quant], [gpu]) holding torch, the core requirements and that extra alone.

    python .ci/envs.py clients wyoming extra-serve      # builds what is missing; prints {name: python or skip reason}

An environment is built once and kept under the cache folder (`$DRAMA3_ENVS`, else
~/.cache/transformers-drama3/envs), named by a hash of what it is built from (its requirements: for the
extras, setup.py's core requirements and that extra's; the interpreter), so a change rebuilds it and a CI run on a machine that
built it before starts at once. A build is written under a temporary name and renamed when whole; a
lock keeps two builds of one environment apart. The extras' environments hold the project's
dependencies, not the project: run them with PYTHONPATH=<checkout>/src.

Each extra's environment starts from one core environment (torch==2.13.0 first, as the README says,
then the core requirements), hard-linked rather than copied (cp -al: seconds, no disk), then the
extra is installed into it by pip.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import runpy
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"
EXTRAS = ("serve", "train", "demo", "quant", "gpu")
CLIENTS = {
    # the releases the client tests were written against; pinned so that a client's release cannot
    # turn CI red on its own (bump them here, and the environments rebuild)
    "clients": ("3.10", ["pipecat-ai[openai]==1.14.0", "livekit-agents==1.8.9", "livekit-plugins-openai==1.8.9",
                         "litellm==1.110.2", "openai==3.63.0", "fish-audio-sdk==1.3.0",
                         "livekit-plugins-fishaudio==1.8.9"]),
    "wyoming": ("3.12", ["wyoming-openai==0.8.0"]),
}


@dataclass
class Built:
    name: str
    python: str | None  # the environment's interpreter, None when it could not be built here
    reason: str = ""  # why not
    seconds: float = 0.0  # what building it cost now (0: it was there)


def cache_folder() -> Path:
    return Path(os.environ.get("DRAMA3_ENVS") or Path.home() / ".cache" / "transformers-drama3" / "envs")


def interpreter(minimum: str) -> str | None:
    """A Python of at least `minimum` that runs (this one, python3.N on PATH, or one of pyenv's
    versions), or None."""
    wanted = tuple(int(part) for part in minimum.split("."))
    if sys.version_info[:2] >= wanted:
        return sys.executable
    minors = range(wanted[1], 15)
    candidates = [shutil.which(f"python{wanted[0]}.{minor}") for minor in minors]
    pyenv = shutil.which("pyenv")
    if pyenv:
        root = subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip()
        for minor in minors:
            candidates += sorted(glob.glob(f"{root}/versions/{wanted[0]}.{minor}.*/bin/python"), reverse=True)
    for candidate in filter(None, candidates):
        version = subprocess.run([candidate, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True,
                                 text=True)  # a pyenv shim of a version not selected here fails
        if version.returncode == 0 and tuple(map(int, version.stdout.split())) >= wanted:
            return candidate
    return None


def version_of(python: str) -> str:
    return subprocess.run([python, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True,
                          text=True, check=True).stdout.strip()


def pip(python: str, *arguments: str) -> None:
    command = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *arguments]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def digest(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def build_once(folder: Path, make) -> float:
    """`make(temporary_folder)` unless `folder` exists; the seconds it took (0 when it was there)."""
    if (folder / "pyvenv.cfg").exists():
        return 0.0
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "pyvenv.cfg").exists():  # built by another process while this one waited
            return 0.0
        started = time.perf_counter()
        partial = folder.parent / f".{folder.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        make(partial)
        partial.rename(folder)
        return time.perf_counter() - started


def client_env(name: str) -> Built:
    minimum, requirements = CLIENTS[name]
    python = interpreter(minimum)
    if python is None:
        return Built(name, None, f"needs Python >= {minimum} (found none: this interpreter, python3.N on PATH, pyenv)")
    folder = cache_folder() / f"{name}-{digest(version_of(python), *requirements)}"

    def make(into: Path) -> None:
        subprocess.run([python, "-m", "venv", str(into)], check=True)
        pip(str(into / "bin" / "python"), *requirements)

    seconds = build_once(folder, make)
    return Built(name, str(folder / "bin" / "python"), seconds=seconds)


def project_requirements() -> tuple[list[str], dict[str, list[str]]]:
    """setup.py's install_requires and extras_require, read by running it with `setup()` captured."""
    import setuptools

    captured, original = {}, setuptools.setup
    setuptools.setup = lambda **arguments: captured.update(arguments)
    try:
        runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    finally:
        setuptools.setup = original
    return list(captured["install_requires"]), {name: list(value) for name, value in captured["extras_require"].items()}


def core_env() -> tuple[Path, float]:
    """torch and the core requirements (no extra, not the project itself); the seconds building it took."""
    core, _ = project_requirements()
    folder = cache_folder() / f"core-{digest(version_of(sys.executable), TORCH, *core)}"

    def make(into: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", str(into)], check=True)
        python = str(into / "bin" / "python")
        pip(python, TORCH)  # first, pinned: a bare torch requirement would pull a CUDA build
        pip(python, str(ROOT))  # the core requirements, through the project's own metadata
        subprocess.run([python, "-m", "pip", "uninstall", "--quiet", "--yes", "transformers-drama3"], check=True)

    return folder, build_once(folder, make)


def extra_env(extra: str) -> Built:
    core, core_seconds = core_env()
    requirements = project_requirements()[1][extra]
    folder = cache_folder() / f"extra-{extra}-{digest(core.name, *requirements)}"  # rebuilt when its extra changes

    def make(into: Path) -> None:
        subprocess.run(["cp", "-al", str(core), str(into)], check=True)  # hard links: the core is never written
        python = str(into / "bin" / "python")
        pip(python, f"{ROOT}[{extra}]")
        subprocess.run([python, "-m", "pip", "uninstall", "--quiet", "--yes", "transformers-drama3"], check=True)

    seconds = build_once(folder, make)
    if core_seconds:
        print(f"envs.py: built the extras' core environment (torch and the core requirements) in {core_seconds:.0f} s",
              file=sys.stderr)
    return Built(f"extra-{extra}", str(folder / "bin" / "python"), seconds=seconds)


def build(name: str) -> Built:
    if name in CLIENTS:
        return client_env(name)
    if name.startswith("extra-") and name[len("extra-"):] in EXTRAS:
        return extra_env(name[len("extra-"):])
    raise SystemExit(f"envs.py: no environment {name!r}; known: {[*CLIENTS, *(f'extra-{e}' for e in EXTRAS)]}")


def main(names: list[str]) -> int:
    report = {}
    for name in names or [*CLIENTS, *(f"extra-{extra}" for extra in EXTRAS)]:
        built = build(name)
        report[name] = built.python or f"skip: {built.reason}"
        if built.seconds:
            print(f"envs.py: built {name} in {built.seconds:.0f} s", file=sys.stderr)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
