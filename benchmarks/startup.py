"""Start-up time: what a user waits for before anything happens.

    python benchmarks/startup.py [--runs 5]

Each figure is a fresh interpreter (the way a user starts a command), timed as a whole process;
prints the minimum and median of `--runs` runs:
  - `python -c pass`                  the interpreter alone (the floor);
  - `import torch`                    what any model code has to pay;
  - `import transformers_drama3`      the package import (registers the Auto classes);
  - `drama3 --help`                   the command line's help;
  - `drama3 say` with no text         an argument error;
and, for the two command-line figures, whether torch was imported on the way (it should not be).
Run it before and after a change to start-up; it asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

CLI = "import sys; from drama3_cli import main; sys.argv = ['drama3', *{args!r}]; main()"
TORCH_PROBE = "import atexit, sys; atexit.register(lambda: print('TORCH-IMPORTED' if 'torch' in sys.modules else 'TORCH-ABSENT', file=sys.stderr))"

CASES = {
    "python -c pass": "pass",
    "import torch": "import torch",
    "import transformers_drama3": "import transformers_drama3",
    "drama3 --help": CLI.format(args=["--help"]),
    "drama3 say (no text)": CLI.format(args=["say"]),
}


def time_once(code: str) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", f"{TORCH_PROBE}\n{code}"], capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    torch_state = "imports torch" if "TORCH-IMPORTED" in done.stderr else "no torch"
    return elapsed, torch_state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(f"{'what':<30} {'min s':>7} {'median s':>9}  torch")
    for name, code in CASES.items():
        results = [time_once(code) for _ in range(args.runs)]
        seconds = [elapsed for elapsed, _ in results]
        print(f"{name:<30} {min(seconds):7.2f} {statistics.median(seconds):9.2f}  {results[-1][1]}")


if __name__ == "__main__":
    main()
