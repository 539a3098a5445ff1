"""Dynamo's guards on the compiled step, checked in full only where something may have changed.

Each call of a function `torch.compile` made first runs its guards: checks, on the host, that what
the graph assumed of its inputs still holds. The decode step's inputs are the whole model (every
submodule's type and hooks, every parameter, the config values it read), the cache and the
sampler: some 3,800 guards, measured at 3.7 ms per step for `draw` + `feed` at the published 40
layers (this CPU, `TorchDynamo Cache Lookup` in the profiler). A step that should take 3.3 ms on a
GPU (300 frames/s) cannot spend that on the host.

Within one decode run nothing those guards watch changes from step to step but tensor values: the
model, the sampler and the cache's capacity are the run's own. `SteadyGuards` therefore runs a
function's first call of a run (or of a serving batch) with every guard, and the next calls under
`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`: dynamo then checks only the guards that
tell its graphs apart (every tensor's shape, dtype, device and strides, and every guard that has
failed before: 0.6 ms per step at 40 layers). Safety nets:

- a skipped-guard call whose tensors fit none of the function's graphs raises in dynamo before
  running anything; it is called again with every guard (and compiles what it needs);
- every `CHECK_EVERY`-th call runs every guard again; if that call needed a new graph, something
  the skipped guards would have caught changed during the run, and `GuardsChangedInRun` is raised
  naming the function (the frames since the last full check may have been made by a stale graph).

torch's stance is process-wide while it is set: the library's compiled calls (the step's, and the
compiled prefill's through `checked_call`) hold one lock, so a full check of one run never overlaps
another run's skipped guards; a compiled function of another library called from another thread
during a skipped-guard call of the step skips its guards too.
"""

from __future__ import annotations

import inspect
import threading

import torch

CHECK_EVERY = 32
"""Every this many calls of a function in a run, its guards are run in full again."""

_RECOMPILE_UNDER_SKIP = "Recompilation triggered with skip_guard_eval_unsafe stance"
_LOCK = threading.Lock()


class GuardsChangedInRun(RuntimeError):
    """A full guard check in a run needed a new graph: inputs the skipped guards did not watch changed."""


def graphs_of(function) -> int:
    """How many graphs dynamo holds for `function`, a `torch.compile` of a function (or a wrapper
    of one): the cache entries of the traced function's code object (a private torch helper;
    where a torch lacks it, the graphs dynamo has compiled in this process, which only errs
    towards reporting a change)."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return len(_debug_get_cache_entry_list(inspect.unwrap(function).__code__))


def checked_call(function, *args):
    """`function(*args)` with every guard checked, never during another thread's skipped-guard call
    of the library (the compiled prefill: one call per run)."""
    with _LOCK:
        return function(*args)


class SteadyGuards:
    """Calls a run's compiled functions: every guard on each one's first call (after `reset`) and
    every `CHECK_EVERY`-th, only the guards that tell its graphs apart on the others."""

    def __init__(self):
        self.calls: dict = {}
        self.full_checks = 0
        """Calls run with every guard (counted for tests and benchmarks)."""

    def reset(self) -> None:
        """Something the guards watch may have changed (a new batch, a grown cache): the next call
        of each function runs every guard."""
        self.calls.clear()

    def __call__(self, function, *args):
        count = self.calls.get(function, 0)
        self.calls[function] = count + 1
        with _LOCK:
            if count % CHECK_EVERY == 0:
                return self._checked(function, count, *args)
            try:
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    return function(*args)
            except RuntimeError as error:
                if _RECOMPILE_UNDER_SKIP not in str(error):
                    raise
            # the tensors fit none of its graphs (dynamo raised before running one): compile it
            self.calls[function] = 1
            return self._checked(function, 0, *args)

    def _checked(self, function, count: int, *args):
        self.full_checks += 1
        before = graphs_of(function)
        result = function(*args)
        if count and graphs_of(function) != before:
            name = inspect.unwrap(function).__name__
            raise GuardsChangedInRun(
                f"{name}: call {count + 1} of this run needed a new graph, so something its skipped guards did "
                f"not watch changed since call {count + 1 - CHECK_EVERY} (its results since may come from a stale "
                f"graph); a decode run must not change its model, sampler or cache between steps"
            )
        return result
