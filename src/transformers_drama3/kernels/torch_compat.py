"""The torch settings the compiled GPU path needs that differ between the torch releases it runs on.

The package's CI runs torch 2.13; a GPU machine may run an older one (the device image this project
was lent runs torch 2.11, CUDA 13, triton 3.6). What differs, and what is done about it:

- CUDA-graph trees and inputs marked static (`torch._dynamo.mark_static_address`: the decode
  cache's tensors) whose addresses change between calls: every `generate()` sets up a new cache, so
  the compiled step (and the compiled prefill) meets new static addresses once per run and records
  its CUDA graph again. Up to torch 2.12 such a re-recording counts towards
  `torch._inductor.config.triton.cudagraph_unexpected_rerecord_limit` (128), past which the
  function runs without CUDA graphs for the rest of the process ("skipping cudagraph due to
  function ... exceeding max re-recording limit"): the 129th `generate()` of a shape would run the
  step uncaptured. From torch 2.13 they do not count (pytorch#182531).
  `keep_recording_new_static_inputs()` lifts the limit where they count, as 2.13 behaves.
- The recompile limit is `torch._dynamo.config.recompile_limit` from torch 2.7 and
  `cache_size_limit` before (`recompile_limit_name`); the benchmarks raise it to compile a graph per
  batch size.

Both 2.11 and 2.13 have the rest of what the GPU path calls (`torch.compiler.set_stance(...,
skip_guard_eval_unsafe=True)` and its recompilation error, `torch.library.custom_op` with fake
implementations, `auto_functionalized_v2`, `cudagraph_mark_step_begin`): the decode-step, capture
and kernel tests pass on both.
"""

from __future__ import annotations

import re
import sys

import torch

STATIC_INPUT_RERECORDS_UNCOUNTED = (2, 13)
"""The torch release from which CUDA-graph trees do not count re-recordings caused by inputs marked
static changing address towards their re-record limit."""

RECOMPILE_LIMIT_RENAMED = (2, 7)
"""The torch release that named dynamo's `cache_size_limit` `recompile_limit`."""


def torch_release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of a torch version string ("2.11.0+cu130", "2.13.0.dev20260501"); the
    installed torch's by default."""
    text = torch.__version__ if version is None else version
    match = re.match(r"(\d+)\.(\d+)", str(text))
    if match is None:
        raise ValueError(f"version: {text!r} is not a torch version (expected 'major.minor...')")
    return int(match.group(1)), int(match.group(2))


def counts_static_input_rerecords(version: str | None = None) -> bool:
    """Whether CUDA-graph trees of this torch stop capturing a function after 128 re-recordings
    caused by static inputs changing address (see the module docstring)."""
    return torch_release(version) < STATIC_INPUT_RERECORDS_UNCOUNTED


def rerecord_limit_for_new_static_inputs(version: str | None = None, current: int = 128) -> int:
    """The CUDA-graph trees' re-record limit the package runs with on `version`: unlimited where
    static-address churn counts towards it, `current` (left as it is) elsewhere."""
    return sys.maxsize if counts_static_input_rerecords(version) else current


def keep_recording_new_static_inputs() -> None:
    """Where the installed torch counts static-address re-recordings towards the CUDA-graph trees'
    limit, lift the limit (process-wide, as torch 2.13 behaves for them): a process that runs many
    `generate()` calls keeps its step captured. Called where the package compiles its step."""
    triton = torch._inductor.config.triton
    current = triton.cudagraph_unexpected_rerecord_limit
    wanted = rerecord_limit_for_new_static_inputs(current=current)
    if wanted > current:
        triton.cudagraph_unexpected_rerecord_limit = wanted


def recompile_limit_name(version: str | None = None) -> str:
    """The name of dynamo's limit on graphs per function on `version`."""
    return "recompile_limit" if torch_release(version) >= RECOMPILE_LIMIT_RENAMED else "cache_size_limit"


def raise_recompile_limit(at_least: int) -> None:
    """Let dynamo keep at least `at_least` graphs per function (one per batch size, for the benchmarks)."""
    config = torch._dynamo.config
    name = recompile_limit_name()
    setattr(config, name, max(getattr(config, name), at_least))
