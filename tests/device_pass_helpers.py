"""The GPU path on a machine without a GPU: runs built on a stand-in device, and a fake CUDA copy.

Everything is built by the package's own code on `meta` with `cuda_stand_in("meta")` (so each
tensor is where that code puts it: a tensor it leaves on the CPU stays there), the prompt prefilled
by the compiled prefill (an eager prefill reads the mask on the host, which meta tensors cannot
answer). `fake_cuda` then gives a copy whose meta tensors are FakeTensors on "cuda" (only where torch
is a CUDA build: a CPU-only build has no CUDA device guard, so indexing a fake CUDA tensor fails
there; see `FAKE_CUDA_REASON`), tensors elsewhere left as they are.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from transformers import CompileConfig

from generation_helpers import prompt, tiny_model
from transformers_drama3.decoding.loop import DecodeRun
from transformers_drama3.decoding.request import RequestOptions, make_sampler, resolve_request
from transformers_drama3.decoding.sampler import SamplingSettings
from transformers_drama3.kernels.cuda_paths import cuda_stand_in

META = torch.device("meta")
EAGER_GRAPHS = CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None)

FAKE_CUDA_REASON = (
    "FakeTensors on 'cuda' need torch's CUDA device guard, which only a CUDA build of torch registers "
    "(FakeTensorMode swaps it for a no-op one when no GPU is there); on a CPU-only build every "
    "Tensor.__getitem__/__setitem__/.to('cuda') of a fake CUDA tensor raises 'PyTorch is not linked "
    "with support for cuda devices'"
)


def fake_cuda_available() -> bool:
    return torch.backends.cuda.is_built()


def meta_model(seed: int = 0):
    return tiny_model(seed=seed).to(META)


@torch.no_grad()
def meta_run(model, prompt_seed: int = 1, compile_config=EAGER_GRAPHS, settings=None, seed=3) -> DecodeRun:
    """A compiled decode run of one prompt on meta, prefilled by the compiled prefill, every CUDA
    path taken (`cuda_stand_in`)."""
    ids, codes = prompt(prompt_seed)
    ids, codes, mask = ids[None], codes[None], torch.ones(1, ids.shape[0], dtype=torch.long)
    options = RequestOptions(settings or SamplingSettings(top_k=8), seed, max_new_tokens=12, expected_seconds=1.0)
    request = resolve_request(model, ids.to(META), mask.to(META), options)
    with cuda_stand_in("meta"):
        sampler = make_sampler(model, request)
        return DecodeRun.prefilled(model, ids.to(META), codes.to(META), mask.to(META), sampler, request.budgets,
                                   compile_config=compile_config, prefill_graphs=True)


@contextlib.contextmanager
def stand_in(kind: str):
    """The context a trace of `kind` ("meta": the stand-in; "fake-cuda": nothing, CUDA is CUDA) runs in."""
    if kind == "meta":
        with cuda_stand_in("meta"):
            yield
    else:
        yield


class FakeCuda:
    """Copies of objects with every meta tensor replaced by a FakeTensor on "cuda" of the same
    shape, strides and dtype (one per meta tensor: a tensor met twice is copied once); static
    address marks are kept, tensors on other devices are left as they are."""

    def __init__(self):
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.memo: dict[int, object] = {}
        self.kept: list = []

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "meta":
            return tensor
        if id(tensor) not in self.memo:
            with self.mode:
                fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cuda")
            static = getattr(tensor, "_dynamo_static_input_type", None)
            if static is not None:
                fake._dynamo_static_input_type = static
            self.memo[id(tensor)] = fake
            self.kept.append(tensor)  # alive while the memo is: its id is not reused
        return self.memo[id(tensor)]

    def module(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` itself, its parameters and buffers replaced (in place)."""
        for module in model.modules():
            for name, parameter in list(module._parameters.items()):
                if parameter is not None:
                    module._parameters[name] = torch.nn.Parameter(self.tensor(parameter), requires_grad=False)
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[name] = self.tensor(buffer)
        return model

    def copy(self, value, depth: int = 0):
        """A copy of `value` (tensors, containers, dataclasses and plain objects, 6 levels deep)."""
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        if depth > 6 or isinstance(value, (str, bytes, int, float, bool, type(None), torch.nn.Module, torch.device, torch.dtype)):
            return value
        if id(value) in self.memo:
            return self.memo[id(value)]
        self.kept.append(value)
        if isinstance(value, (list, tuple)):
            copied = type(value)(self.copy(item, depth + 1) for item in value)
        elif isinstance(value, dict):
            copied = {key: self.copy(item, depth + 1) for key, item in value.items()}
        elif dataclasses.is_dataclass(value):
            copied = dataclasses.replace(value, **{field.name: self.copy(getattr(value, field.name), depth + 1)
                                                   for field in dataclasses.fields(value) if field.init})
        elif hasattr(value, "__dict__"):
            copied = object.__new__(type(value))
            self.memo[id(value)] = copied
            copied.__dict__.update({key: self.copy(item, depth + 1) for key, item in vars(value).items()})
            return copied
        else:
            return value
        self.memo[id(value)] = copied
        return copied
