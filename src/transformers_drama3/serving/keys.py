"""Where the server's API key comes from: `--api-key`, `--api-key-file` or `$DRAMA3_API_KEY`.

A key on the command line is visible to every user of the machine (`ps`); a file (readable by the
server's user only) or the environment keeps it out of the process list.
"""

from __future__ import annotations

import os

API_KEY_VARIABLE = "DRAMA3_API_KEY"


def read_api_key_file(path: str) -> str:
    """The key in `path`: its first line, surrounding whitespace removed. ValueError naming the file
    when it cannot be read or holds no key (a server that meant to need a key never starts open)."""
    try:
        with open(path, encoding="utf-8") as handle:
            key = handle.readline().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--api-key-file {path}: cannot be read ({type(error).__name__}: {error})") from None
    if not key:
        raise ValueError(f"--api-key-file {path}: the first line holds no key")
    return key


def resolve_api_key(given: str | None, key_file: str | None, environ=os.environ) -> str | None:
    """The key: `--api-key`, else `--api-key-file`'s, else `$DRAMA3_API_KEY`, else None (no key).
    ValueError when both options are given, or an option's key is empty."""
    if given is not None and key_file is not None:
        raise ValueError("give either --api-key or --api-key-file, not both")
    if given is not None:
        if not given.strip():
            raise ValueError("--api-key '': expected a key")
        return given.strip()
    if key_file is not None:
        return read_api_key_file(key_file)
    return environ.get(API_KEY_VARIABLE) or None
