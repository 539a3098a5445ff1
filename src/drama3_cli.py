"""The `drama3` console script: parse the command line, then import the package and run it.

Importing the package imports torch and transformers (seconds), which `--help` and a mistyped flag
should not wait for. So the parser's module, `transformers_drama3.runtime.command_line`, and the option
schema its flags are made from, `transformers_drama3.decoding.options`, and the quantisation
schemes its `--quant` choices are, `transformers_drama3.checkpoint.quantization.schemes` (all standard
library only), are loaded from the package's folder without running the package's `__init__`; the package
itself is imported once there is work to do, and `transformers_drama3.cli.run` does it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ARGUMENTS_MODULE = "transformers_drama3.runtime.command_line"
STANDALONE_MODULES = (
    "transformers_drama3.decoding.options",
    "transformers_drama3.checkpoint.quantization.schemes",
    ARGUMENTS_MODULE,
)
"""The modules the parser needs, in import order: each imports only the standard library and those before it."""


def load_arguments_module():
    """`transformers_drama3.runtime.command_line`, loaded from its file without importing the package (the
    package's own `from .runtime.command_line import ...` later finds this same module in `sys.modules`),
    after the option schema it reads, loaded the same way."""
    package = importlib.util.find_spec("transformers_drama3")  # finds the folder, runs nothing
    folder = Path(package.submodule_search_locations[0])
    for name in STANDALONE_MODULES:
        if name in sys.modules:
            continue
        path = folder.joinpath(*name.split(".")[1:]).with_suffix(".py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[ARGUMENTS_MODULE]


def main(argv: list[str] | None = None) -> int:
    """The console script: parse (argparse answers --help and usage errors itself, at once), then
    import the package and run the command."""
    args = load_arguments_module().build_parser().parse_args(argv)
    from transformers_drama3.cli import run  # the heavy import, only once there is work to do

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
