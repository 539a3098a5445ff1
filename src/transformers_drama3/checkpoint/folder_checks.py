"""Checks of what a checkpoint folder holds, made before transformers reads it, so that a broken
download is reported as one line naming the file and what to do, not a deserialisation traceback.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

_HEADER_LENGTH_BYTES = 8  # safetensors: a little-endian u64 header length, the JSON header, the data


def check_safetensors_file(path: str | os.PathLike) -> None:
    """Raise ValueError naming `path` when the file is shorter than its own header says (an
    interrupted download or copy) or its header is not safetensors."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as reader:
        prefix = reader.read(_HEADER_LENGTH_BYTES)
        if len(prefix) < _HEADER_LENGTH_BYTES:
            raise ValueError(_incomplete(path, size, "the header"))
        (header_length,) = struct.unpack("<Q", prefix)
        if _HEADER_LENGTH_BYTES + header_length > size:
            raise ValueError(_incomplete(path, size, f"a header of {header_length} bytes"))
        try:
            header = json.loads(reader.read(header_length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError(f"{path}: not a safetensors file (its header is not JSON)") from None
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    needed = _HEADER_LENGTH_BYTES + header_length + max(ends, default=0)
    if needed > size:
        raise ValueError(_incomplete(path, size, f"{needed} bytes"))


def _incomplete(path: Path, size: int, promised: str) -> str:
    return (
        f"{path}: the file is incomplete ({size} bytes; it needs {promised}), probably an interrupted "
        f"download or copy; download it again"
    )


def check_weight_files(folder: str | os.PathLike) -> None:
    """`check_safetensors_file` for every weight file of a local checkpoint folder."""
    for path in sorted(Path(folder).glob("*.safetensors")):
        check_safetensors_file(path)


def check_dtype(dtype) -> None:
    """Refuse a dtype string that is neither "auto" nor a torch dtype name, naming it."""
    if not isinstance(dtype, str) or dtype == "auto":
        return
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"dtype={dtype!r}: not a torch dtype; expected 'auto', 'float32', 'bfloat16' or 'float16'")


__all__ = ["check_dtype", "check_safetensors_file", "check_weight_files"]
