"""What a quantised weight holds in memory, by option, and what a loaded model actually holds.

    from transformers_drama3.checkpoint.quantization.weights import quantized_bytes, held_bytes
    quantized_bytes((512, 2048), "int4", device="cuda")   # one expert's gate_proj, packed int4
    held_bytes(model)                                      # storage bytes of every weight, by name

`quantized_bytes(shape, option, device, dtype, group_size)` is a pure function of a weight's shape
`[out, in]` (or `[experts, out, in]`: that many matrices) giving the bytes the weight takes once
quantised under `option`, scales and zero points included, in the layout the quantiser really
stores on `device` (read off torchao 0.18 and bitsandbytes 0.50):

    option    quantiser                                  bytes of one [out, in] matrix
    int8      torchao Int8WeightOnlyConfig               out*in (int8) + out*(4 + 1): a float32 scale
                                                         and an int8 zero point per row
    int4      torchao Int4WeightOnlyConfig (cuda,        out*in/2 + out*(in/g)*4: a bfloat16 scale
              tile_packed_to_4d)                         and zero point per group of g inputs
              torchao IntxWeightOnlyConfig(int4) (cpu)   out*in (int4 values unpacked into int8) +
                                                         out*(in/g)*(dtype bytes + 1)
    nf4       bitsandbytes Linear4bit, nf4               ceil(out*in/2) + 4*ceil(out*in/64): a float32
                                                         absmax per block of 64 (no double quant);
                                                         on the CPU its kernel turns the absmax into
                                                         bfloat16 at the first inference call: 2 bytes;
                                                         + 64: each weight's own NF4 code table
    bnb-int8  bitsandbytes Linear8bitLt                  out*in + 4*out: a float32 scale per row
    fp8       block FP8, the published experts           out*in + 4*ceil(out/128)*ceil(in/128)

On the CPU torchao 0.18 has no packed int4 layout: its int4 weight-only values sit one per int8, so
"int4" saves memory over "int8" only on CUDA; "nf4" packs two weights a byte everywhere.

`held_bytes(model)` sums what the model holds: every parameter and buffer's storage, looking inside
torchao's tensor subclasses (their `qdata`, `scale`, `zero_point`, ...) and bitsandbytes'
quantisation states (absmax, code tables), each storage counted once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn

from .schemes import BYTE_COUNTED

OPTIONS = BYTE_COUNTED
"""The options `quantized_bytes` knows (`quantized_loading.WEIGHT_OPTIONS` are those loaded on the fly)."""
DEFAULT_INT4_GROUP = 128
NF4_BLOCK = 64  # bitsandbytes' 4-bit blocksize (BitsAndBytesConfig's default on CPU and CUDA)
NF4_CODE_BYTES = 16 * 4  # the 16 NF4 levels in float32, one table per quantised weight
FP8_BLOCK = (128, 128)


def quantized_bytes(
    shape: tuple[int, ...] | torch.Size,
    option: str,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    group_size: int = DEFAULT_INT4_GROUP,
) -> int:
    """Bytes a weight of `shape` (`[out, in]` or `[matrices, out, in]`) holds quantised under
    `option` on `device` ("cuda" or "cpu"), for a model computing in `dtype`; `group_size` is
    int4's group of inputs. See the module docstring for each layout."""
    if len(shape) < 2:
        raise ValueError(f"shape must be [out, in] or [matrices, out, in]; got {tuple(shape)}")
    *leading, out, inp = (int(size) for size in shape)
    matrices = math.prod(leading)
    device_type = torch.device(device).type
    elements = out * inp
    if option == "int8":
        per_matrix = elements + out * (4 + 1)
    elif option == "int4":
        groups = out * math.ceil(inp / group_size)
        if device_type == "cuda":
            per_matrix = math.ceil(elements / 2) + groups * 2 * 2
        else:
            per_matrix = elements + groups * (torch.empty((), dtype=dtype).element_size() + 1)
    elif option == "nf4":
        absmax_bytes = 2 if device_type == "cpu" else 4
        per_matrix = math.ceil(elements / 2) + absmax_bytes * math.ceil(elements / NF4_BLOCK) + NF4_CODE_BYTES
    elif option == "bnb-int8":
        per_matrix = elements + 4 * out
    elif option == "fp8":
        per_matrix = elements + 4 * math.ceil(out / FP8_BLOCK[0]) * math.ceil(inp / FP8_BLOCK[1])
    else:
        raise ValueError(f"option={option!r}; expected one of {', '.join(OPTIONS)}")
    return matrices * per_matrix


def _storages(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors whose storage `tensor` holds: itself, or the inner tensors of a torchao
    tensor subclass (recursively), plus a bitsandbytes weight's quantisation state."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is not None and type(tensor) not in (torch.Tensor, nn.Parameter):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):
                yield from _storages(inner)
    else:
        yield tensor
    state = getattr(tensor, "quant_state", None)  # bitsandbytes Params4bit
    if state is not None:
        yield from _quant_state_tensors(state)
    for name in ("SCB",):  # bitsandbytes Int8Params: the per-row scales beside the int8 weight
        extra = getattr(tensor, name, None)
        if isinstance(extra, torch.Tensor):
            yield extra


def _quant_state_tensors(state) -> Iterator[torch.Tensor]:
    for name in ("absmax", "code", "offset"):
        value = getattr(state, name, None)
        if isinstance(value, torch.Tensor):
            yield value
    nested = getattr(state, "state2", None)
    if nested is not None:
        yield from _quant_state_tensors(nested)


def held_bytes(model: nn.Module) -> dict[str, int]:
    """Storage bytes each parameter and buffer of `model` holds, by name (a storage shared by
    several names, or by several tensors, is counted once, under the first). A bitsandbytes 8-bit
    linear moves its row scales from the weight to the module's matmul state at its first call:
    they are counted under the weight's name either way."""
    seen: set[tuple[int, int]] = set()
    held: dict[str, int] = {}

    def add(name: str, tensors) -> None:
        total = held.get(name, 0)
        for plain in tensors:
            if plain.device.type == "meta":
                continue
            storage = plain.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
        held[name] = total

    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            add(prefix + name, _storages(tensor))
        state = getattr(module, "state", None)  # bitsandbytes MatmulLtState
        extra = [getattr(state, name, None) for name in ("SCB", "CB")] if state is not None else []
        extra = [tensor for tensor in extra if isinstance(tensor, torch.Tensor)]
        if extra and "weight" in module._parameters:
            add(prefix + "weight", extra)
    return held


__all__ = ["DEFAULT_INT4_GROUP", "FP8_BLOCK", "NF4_BLOCK", "OPTIONS", "held_bytes", "quantized_bytes"]
