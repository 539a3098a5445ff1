"""Route the Gated DeltaNet and causal-conv functions of the backbone by device.

transformers binds `torch_chunk_gated_delta_rule` & co. at import time to flash-linear-attention (and
`causal_conv1d`) whenever those packages import, and then calls the Triton kernels even for CPU
tensors, which fails on a machine without a GPU. Here each of those module-level functions is
replaced by a router: CUDA tensors go to the kernel transformers picked, everything else to the
plain PyTorch reference the kernel wraps. The router is installed once, on `import
transformers_drama3`; it changes nothing when no kernel package is installed.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch

# fla warns at import that Triton has no GPU here; the routing below never sends it CPU tensors.
warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen  # noqa: E402

ROUTED_FUNCTIONS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def _accepted_kwargs(function) -> set[str] | None:
    """Keyword names `function` takes, or None when it takes **kwargs."""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters}


def route_by_device(kernel, reference):
    """A function that calls `kernel` for CUDA tensors and `reference` otherwise."""
    accepted = _accepted_kwargs(reference)

    @functools.wraps(reference)
    def routed(*args, **kwargs):
        tensor = _first_tensor(args, kwargs)
        if tensor is not None and tensor.is_cuda:
            return kernel(*args, **kwargs)
        if accepted is not None:
            kwargs = {name: value for name, value in kwargs.items() if name in accepted}
        return reference(*args, **kwargs)

    routed.drama3_kernel = kernel
    routed.drama3_reference = reference
    return routed


def install_device_dispatch() -> None:
    """Replace each routed backbone function by its device router (idempotent)."""
    for name in ROUTED_FUNCTIONS:
        current = getattr(qwen, name)
        if hasattr(current, "drama3_reference"):
            continue
        reference = inspect.unwrap(current)
        setattr(qwen, name, route_by_device(current, reference))


def kernel_report() -> dict[str, str]:
    """Which implementation each routed function uses for CUDA tensors (the CPU always uses PyTorch)."""
    report = {}
    for name in ROUTED_FUNCTIONS:
        routed = getattr(qwen, name)
        kernel = getattr(routed, "drama3_kernel", routed)
        closure = inspect.getclosurevars(kernel).nonlocals if hasattr(kernel, "__code__") else {}
        implementation = closure.get("implementation", kernel)
        report[name] = f"{getattr(implementation, '__module__', '?')}.{getattr(implementation, '__name__', '?')}"
    return report
