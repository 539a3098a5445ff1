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
- CPU inductor's vectorized reductions nested in a vectorized outer loop: up to torch 2.12 the C++
  code generator stores such a reduction's result through the full vector width (16 float lanes)
  even where the outer loop covers fewer (a Gated DeltaNet readout `o[h, v] = sum_k S[h, k, v]
  q[h, k]` of 4 value heads vectorized over the heads): it writes up to 15 rows past the output
  buffer, which corrupts the heap and crashes the process later (pytorch#196681 is this bug in a
  2D-tiled reduction; torch 2.13 selects the reduction's epilogue by the same main/tail range).
  `with_cpu_codegen_fixes(kwargs)` compiles the package's functions with the C++ kernels scalar
  (`cpp.simdlen=1`) where the installed torch has the bug; CUDA graphs use Triton and are not
  touched by the setting.
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

CPU_NESTED_REDUCTION_STORE_FIXED = (2, 13)
"""The first torch release whose CPU inductor stores a reduction nested in a vectorized outer loop
through the lanes that loop covers (earlier ones write past the output; see the module docstring)."""

CPU_CODEGEN_WORKAROUND = {"cpp.simdlen": 1}
"""The inductor settings the package compiles with where `CPU_NESTED_REDUCTION_STORE_FIXED` is not
reached: C++ kernels without vectorization (so without the faulty store); Triton ignores them."""

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


def overruns_cpu_nested_reduction_stores(version: str | None = None) -> bool:
    """Whether this torch's CPU inductor can store a nested reduction past its output buffer."""
    return torch_release(version) < CPU_NESTED_REDUCTION_STORE_FIXED


def cpu_codegen_settings(version: str | None = None) -> dict:
    """The inductor settings the package's compiled functions run under on `version`."""
    return dict(CPU_CODEGEN_WORKAROUND) if overruns_cpu_nested_reduction_stores(version) else {}


def with_cpu_codegen_fixes(compile_kwargs: dict) -> dict:
    """`torch.compile` keyword arguments with `cpu_codegen_settings()` added to inductor's options
    where the installed torch needs them; returned as they are otherwise (and for other backends).
    The settings go in at compile time (inductor reads them when it compiles a graph), so a
    compiled call costs nothing more. torch.compile takes `mode` or `options`, not both: a mode
    becomes the options it stands for (`torch._inductor.list_mode_options`), as torch does."""
    settings = cpu_codegen_settings()
    if not settings or compile_kwargs.get("backend", "inductor") != "inductor":
        return compile_kwargs
    from torch._inductor import list_mode_options

    kwargs = dict(compile_kwargs)
    mode = kwargs.pop("mode", None)
    mode_options = list_mode_options(mode, kwargs.get("dynamic")) if mode else {}  # (None lists every mode)
    kwargs["options"] = {**mode_options, **(kwargs.get("options") or {}), **settings}
    return kwargs


def recompile_limit_name(version: str | None = None) -> str:
    """The name of dynamo's limit on graphs per function on `version`."""
    return "recompile_limit" if torch_release(version) >= RECOMPILE_LIMIT_RENAMED else "cache_size_limit"


def raise_recompile_limit(at_least: int) -> None:
    """Let dynamo keep at least `at_least` graphs per function (one per batch size, for the benchmarks)."""
    config = torch._dynamo.config
    name = recompile_limit_name()
    setattr(config, name, max(getattr(config, name), at_least))
