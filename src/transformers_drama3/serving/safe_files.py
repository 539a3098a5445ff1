"""Reading files that a client may have placed on the server's disk (adapter folders under
`--adapter-root`, stored voices and adapters): nothing here blocks on a FIFO or a device, follows a
link out of its folder, or parses without a bound.

    data = read_regular_file(folder / "adapter_config.json", root, max_bytes=2**20, timeout=30, name="adapter_config.json")
    config = parse_json(data, "adapter_config.json")

A file is resolved through every link (its folder's included) and must lie inside `root`; it is
opened without blocking and checked on the opened descriptor (a regular file, at most `max_bytes`)
before a byte is read; the descriptor's own path is checked against `root` again where the
system tells it (Linux: a folder swapped for a link between the two checks is caught); the read
stops at `timeout` seconds. JSON is counted against the bounds a request body is held to
(`json_bounds`) before it is parsed. Every refusal is a `ValueError` naming the file as the caller named it,
never the server's absolute path.
"""

from __future__ import annotations

import json
import os
import stat
import time

from .json_bounds import JsonBounds, json_cost

READ_CHUNK = 16 * 2**20
"""Bytes read between two looks at the clock."""


class OutsideRoot(ValueError):
    """A file that lies outside the folder it must lie in once its links are resolved."""


def is_inside(path: str, root: str) -> bool:
    """Whether the resolved `path` is `root` or lies under it (both absolute and resolved)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _opened_path(descriptor: int) -> str | None:
    """The path of the file open on `descriptor`, where the system tells it (Linux's /proc); else None."""
    try:
        return os.readlink(f"/proc/self/fd/{descriptor}")
    except OSError:
        return None


def read_regular_file(path: str | os.PathLike, root: str | os.PathLike | None, max_bytes: int, timeout: float,
                      name: str, root_name: str = "its folder") -> bytes:
    """The bytes of the regular file `path`, which must lie inside `root` (None: anywhere) once
    every link is resolved. FileNotFoundError when there is none; `OutsideRoot` for a file outside
    `root` (`root_name` says which folder that is); ValueError for a FIFO, device, socket or folder, a file over `max_bytes`, or one not
    read within `timeout` seconds."""
    real = os.path.realpath(path)
    real_root = os.path.realpath(root) if root is not None else None
    if real_root is not None and not is_inside(real, real_root):
        raise OutsideRoot(f"{name}: lies outside {root_name} once its links are resolved")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        descriptor = os.open(real, flags)
    except FileNotFoundError:
        raise
    except OSError as error:
        raise ValueError(f"{name}: cannot be opened ({os.strerror(error.errno) if error.errno else error})") from None
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{name}: not a regular file (a folder, FIFO, device or socket)")
        opened = _opened_path(descriptor) if real_root is not None else None
        if opened is not None and not is_inside(opened, real_root):
            raise OutsideRoot(f"{name}: lies outside {root_name} once its links are resolved")
        if info.st_size > max_bytes:
            raise ValueError(f"{name}: {info.st_size} bytes; at most {max_bytes} for this file")
        return _read_within(descriptor, max_bytes, timeout, name)
    finally:
        os.close(descriptor)


def _read_within(descriptor: int, max_bytes: int, timeout: float, name: str) -> bytes:
    """Read to the end in chunks, refusing a file that grows past `max_bytes` or takes over `timeout` s."""
    deadline = time.monotonic() + timeout
    chunks, size = [], 0
    while True:
        chunk = os.read(descriptor, min(READ_CHUNK, max_bytes + 1 - size))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > max_bytes:
            raise ValueError(f"{name}: over {max_bytes} bytes (it grew while it was read)")
        if time.monotonic() > deadline:
            raise ValueError(f"{name}: not read within {timeout:g} s ({size} bytes came)")


def parse_json(data: bytes, name: str, bounds: JsonBounds = JsonBounds()):
    """The JSON value of a stored file's bytes; ValueError naming `name` for bytes that are not
    UTF-8 JSON, or whose parse would pass `bounds` (depth, items, keys: counted from the bytes by
    `json_bounds.json_cost` before anything is parsed; a file nested 100,000 deep is refused so)."""
    if json.detect_encoding(data) not in ("utf-8", "utf-8-sig"):
        raise ValueError(f"{name}: not JSON in UTF-8")  # UTF-16's bytes would hide brackets from the count
    cost = json_cost(data, bounds)
    if cost.over is not None:
        raise ValueError(f"{name}: {cost.over}")
    try:
        return json.loads(data)
    except RecursionError:  # not reached within the depth bound; kept for a bound set past the parser's stack
        raise ValueError(f"{name}: nested too deeply") from None
    except ValueError as error:  # not JSON, or not UTF-8
        raise ValueError(f"{name}: not JSON ({error})") from None
