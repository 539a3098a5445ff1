"""The one question every CUDA path of the package asks: does this tensor take it?

The device routers (`device_dispatch`), the decode-row kernels' gates (`short_conv.kernel_serves`,
`recurrent_decode.kernel_serves`), the fused step's gate (`fused_step.use_kernel`), the FP8 experts'
gate and the compiled prefill's choice of experts implementation each branch on whether a tensor
is on CUDA, and what a CUDA branch calls is what a GPU traces into its compiled step. They all ask
`takes_cuda_path(tensor)`, so that a machine without a GPU can trace those branches too:

    with cuda_stand_in("meta"):    # meta tensors take every CUDA path inside
        capture_report(step, model_on_meta, cache_on_meta, ...)

Meta tensors hold no data: a trace on them runs every op a GPU would run and computes nothing, and
a tensor the code leaves on the CPU stands out (`capture_check` names every op that touches one).
Only the package's own branches follow the stand-in; transformers' and torch's own device checks
still see a meta tensor (a FakeTensor on "cuda", where torch is a CUDA build, passes those too).
Host-side choices that never enter a compiled region (queuing steps ahead, pinned copies, the
default compile config) keep reading the real device.
"""

from __future__ import annotations

import contextlib

import torch

_STAND_INS: frozenset[str] = frozenset()
"""Device types that take the CUDA paths besides CUDA itself (`cuda_stand_in`)."""

STAND_IN_TYPES = ("meta",)
"""The device types `cuda_stand_in` accepts: devices that compute nothing (a CPU tensor taking a
CUDA path would launch a GPU kernel on host memory)."""


def takes_cuda_path(value: torch.Tensor | torch.device) -> bool:
    """Whether `value` (a tensor, or a device) takes the package's CUDA paths: it is on CUDA, or on a
    device standing in for CUDA (`cuda_stand_in`)."""
    device_type = value.type if isinstance(value, torch.device) else value.device.type
    return device_type == "cuda" or device_type in _STAND_INS


@contextlib.contextmanager
def cuda_stand_in(device_type: str = "meta"):
    """Inside: tensors on `device_type` take every CUDA path of the package (see the module
    docstring). Process-wide while it lasts; a compiled function traced inside keeps the branches
    it took (dynamo guards on the setting: outside, it traces again)."""
    global _STAND_INS
    if device_type not in STAND_IN_TYPES:
        raise ValueError(f"device_type: {device_type!r} cannot stand in for CUDA; expected one of {STAND_IN_TYPES}")
    before = _STAND_INS
    _STAND_INS = before | {device_type}
    try:
        yield
    finally:
        _STAND_INS = before
