"""Device routers for the Gated DeltaNet and causal-conv functions of the backbone.

transformers binds `torch_chunk_gated_delta_rule` & co. at import time to flash-linear-attention (and
`causal_conv1d`) whenever those packages import, and then calls the Triton kernels even for CPU
tensors, which fails on a machine without a GPU. A router built here sends CUDA tensors to the
kernel transformers picked and everything else to the plain PyTorch reference the kernel wraps.
This module only builds routers from the functions it is given; putting them in place of
transformers' module globals (and taking them out again) is `transformers_drama3.integrations`'s job.

Packed documents. When the backbone runs on packed rows it passes the document boundaries as
`cu_seqlens` (the chunked delta rule) and `cu_seq_lens_q` (the causal convolution): offsets into
the batch flattened to one sequence, `[0, ..., batch * rows]`, with every row start among them
(see `Drama3ForSpeechGeneration.forward(document_ids=...)`). The PyTorch references ignore them,
so the routers honour them here: the delta rule runs on each document alone, from an empty state
(fla's varlen kernel on CUDA, the reference once per document otherwise), and the causal
convolution drops every tap that reaches back into an earlier document, on every device
(transformers' convolution kernels take no document boundaries).

Decode rows. On a CUDA decode row (one row per item, no packed documents) the two per-row functions
of a Gated DeltaNet layer run the package's own kernels, each one custom op that a compiled decode
step holds without a graph break: `causal_conv1d_update` -> `short_conv.short_conv_update` (transformers
would run its PyTorch reference, several kernels, unless the `causal_conv1d` package is installed)
and `torch_recurrent_gated_delta_rule` -> `recurrent_decode.gated_delta_rule_decode` (transformers
would run fla's fused recurrent kernel, through its autograd function, or the reference). Every other
call keeps the route above.

Compiled regions. What a CUDA branch calls inside `torch.compile(fullgraph=True)` must trace: fla's
chunked kernel is `torch.compiler.disable`d, so there (without gradients) the chunked rule calls it
through one custom op (`chunk_delta_rule`); fla's fused recurrent kernel does not trace, so there the
recurrent rule's calls that are not a decode row run the reference. Which tensors take a CUDA branch
is `cuda_paths.takes_cuda_path`'s answer, so that a CPU can trace these branches on a stand-in
device (`cuda_paths.cuda_stand_in`): such a tensor calls the package kernel transformers bound
(`_stand_in_kernel`), which transformers' own wrapper would not hand a meta tensor.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from . import chunk_delta_rule, recurrent_decode, short_conv
from .cuda_paths import takes_cuda_path

# The names of the module-level functions of transformers' Qwen3.5-MoE modeling that get a router.
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


def _stand_in_kernel(kernel, implementation):
    """What a tensor on a device standing in for CUDA (`cuda_paths.cuda_stand_in`) calls: what
    `kernel` (transformers' wrapper) calls for a CUDA tensor, `implementation` (the package kernel;
    the wrapper itself would see the stand-in device and take its reference instead), given the
    keyword arguments it takes, as the wrapper passes them. `kernel` where there is no package kernel."""
    if implementation is None:
        return kernel
    accepted = _accepted_kwargs(implementation)

    @functools.wraps(implementation)
    def call(*args, **kwargs):
        if accepted is not None:
            kwargs = {name: value for name, value in kwargs.items() if name in accepted}
        return implementation(*args, **kwargs)

    return call


def _cuda_callee(tensor: torch.Tensor, kernel, stand_in):
    """`kernel` for a CUDA tensor, `stand_in` (`_stand_in_kernel`) for one on a stand-in device."""
    return kernel if tensor.is_cuda else stand_in


def route_by_device(kernel, reference, implementation=None):
    """A function that calls `kernel` for CUDA tensors and `reference` otherwise. implementation:
    the package kernel `kernel` calls for CUDA tensors (None: none, `kernel` runs the reference),
    which tensors on a stand-in device call (`_stand_in_kernel`)."""
    accepted = _accepted_kwargs(reference)
    stand_in = _stand_in_kernel(kernel, implementation)

    @functools.wraps(reference)
    def routed(*args, **kwargs):
        tensor = _first_tensor(args, kwargs)
        if tensor is not None and takes_cuda_path(tensor):
            return _cuda_callee(tensor, kernel, stand_in)(*args, **kwargs)
        if accepted is not None:
            kwargs = {name: value for name, value in kwargs.items() if name in accepted}
        return reference(*args, **kwargs)

    routed.drama3_kernel = kernel
    routed.drama3_reference = reference
    return routed


# ----------------------------------------------------------------------------- packed documents


def document_index(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Which document each position of the flattened batch belongs to: long [total].

    cu_seqlens: [documents + 1] offsets, `cu_seqlens[0] == 0` and `cu_seqlens[-1] == total`.
    """
    if int(cu_seqlens[-1]) != total:
        raise ValueError(
            f"cu_seqlens must end at batch * rows = {total} (offsets into the flattened batch); "
            f"got {int(cu_seqlens[-1])}"
        )
    starts = torch.zeros(total, dtype=torch.long, device=cu_seqlens.device)
    starts[cu_seqlens[1:-1].long()] = 1
    return starts.cumsum(0)


def causal_conv1d_per_document(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    """The depthwise causal convolution of the Gated DeltaNet, restarted at every document start.

    hidden_states: [batch, channels, rows]; weight: [channels, width]; cu_seqlens: offsets into the
    flattened batch. Equals the convolution run on each document alone (zero history before its
    first row): a tap that would read an earlier document reads zero instead.
    """
    batch, _, rows = hidden_states.shape
    width = weight.shape[-1]
    document = document_index(cu_seqlens, batch * rows).to(hidden_states.device).view(batch, 1, rows)
    x = hidden_states.to(weight.dtype)
    out = x * weight[:, width - 1 :]
    for shift in range(1, width):
        earlier = F.pad(x, (shift, 0))[..., :rows]
        same_document = F.pad(document, (shift, 0), value=-1)[..., :rows] == document
        out = out + earlier * same_document * weight[:, width - 1 - shift : width - shift]
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(hidden_states.dtype)


def delta_rule_per_document(
    rule,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    output_final_state: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`rule` (a delta-rule reference) run on each document alone, from an empty state.

    query, key: [batch, rows, heads, k_dim]; value: [batch, rows, v_heads, v_dim]; g, beta:
    [batch, rows, v_heads]; cu_seqlens: offsets into the flattened batch. Returns the output
    [batch, rows, v_heads, v_dim] and, if asked, the final state of each document [documents, ...].
    """
    batch, rows = query.shape[:2]
    flat = [t.reshape(1, batch * rows, *t.shape[2:]) for t in (query, key, value, g, beta)]
    bounds = cu_seqlens.tolist()
    outputs, states = [], []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v, g_doc, beta_doc = (t[:, start:end] for t in flat)
        out, state = rule(q, k, v, g=g_doc, beta=beta_doc, output_final_state=output_final_state, **kwargs)
        outputs.append(out)
        states.append(state)
    out = torch.cat(outputs, dim=1).reshape(batch, rows, *outputs[0].shape[2:])
    return out, torch.cat(states) if output_final_state else None


def _no_initial_state(initial_state) -> None:
    if initial_state is not None:
        raise ValueError("packed documents start from an empty state; got an initial_state with cu_seqlens")


def route_chunk_delta_rule(kernel, reference, implementation):
    """Device router for `torch_chunk_gated_delta_rule` that honours `cu_seqlens` everywhere.

    implementation: what `kernel` calls for CUDA tensors; the reference itself when transformers bound
    no package kernel (fla is not installed): `kernel` then takes no `cu_seqlens`. Otherwise, inside a compiled region, CUDA calls
    reach the kernel through one custom op (`chunk_delta_rule`: fla's kernel is
    `torch.compiler.disable`d, which a `fullgraph=True` trace refuses)."""
    kernel_is_reference = implementation is reference
    plain = route_by_device(kernel, reference, None if kernel_is_reference else implementation)
    stand_in = _stand_in_kernel(kernel, None if kernel_is_reference else implementation)
    if not kernel_is_reference:
        chunk_delta_rule.bind(kernel)

    @functools.wraps(reference)
    def routed(query, key, value, g, beta, *, cu_seqlens=None, initial_state=None, **kwargs):
        package_kernel = takes_cuda_path(query) and not kernel_is_reference
        through_op = package_kernel and chunk_delta_rule.serves_compiled(query, kwargs)
        flags = dict(output_final_state=bool(kwargs.get("output_final_state", False)),
                     use_qk_l2norm_in_kernel=bool(kwargs.get("use_qk_l2norm_in_kernel", False)))
        if cu_seqlens is None:
            if through_op:
                return chunk_delta_rule.chunk_gated_delta_rule(query, key, value, g, beta, initial_state, **flags)
            return plain(query, key, value, g=g, beta=beta, initial_state=initial_state, **kwargs)
        _no_initial_state(initial_state)
        if package_kernel:
            # fla's varlen kernels take one flattened sequence (batch 1) and the offsets into it.
            batch, rows = query.shape[:2]
            flat = [t.reshape(1, batch * rows, *t.shape[2:]) for t in (query, key, value, g, beta)]
            if through_op:
                out, state = chunk_delta_rule.chunk_gated_delta_rule(*flat, cu_seqlens=cu_seqlens, **flags)
            else:
                callee = _cuda_callee(query, kernel, stand_in)
                out, state = callee(*flat[:3], g=flat[3], beta=flat[4], cu_seqlens=cu_seqlens, **kwargs)
            return out.reshape(batch, rows, *out.shape[2:]), state
        return delta_rule_per_document(reference, query, key, value, g, beta, cu_seqlens, **kwargs)

    routed.drama3_kernel = kernel
    routed.drama3_reference = reference
    return routed


def route_causal_conv1d(kernel, reference, implementation=None):
    """Device router for `causal_conv1d_fn`; with `cu_seq_lens_q` it restarts at each document."""
    plain = route_by_device(kernel, reference, implementation)

    @functools.wraps(reference)
    def routed(hidden_states, weight, bias=None, activation=None, cu_seq_lens_q=None, **kwargs):
        if cu_seq_lens_q is None:
            return plain(hidden_states, weight, bias, activation=activation, **kwargs)
        return causal_conv1d_per_document(hidden_states, weight, bias, activation, cu_seq_lens_q)

    routed.drama3_kernel = kernel
    routed.drama3_reference = reference
    return routed


def route_short_conv_update(kernel, reference, implementation=None):
    """Device router for `causal_conv1d_update`: a CUDA decode row runs `short_conv.short_conv_update`
    (one op, the conv state updated in place); anything else takes `route_by_device`."""
    plain = route_by_device(kernel, reference, implementation)

    @functools.wraps(reference)
    def routed(hidden_states, conv_state, weight, bias=None, activation=None):
        if short_conv.kernel_serves(hidden_states, activation):
            return short_conv.short_conv_update(hidden_states, conv_state, weight, bias, activation)
        return plain(hidden_states, conv_state, weight, bias, activation=activation)

    routed.drama3_kernel = kernel
    routed.drama3_reference = reference
    routed.drama3_decode_kernel = short_conv.short_conv_update
    return routed


def route_recurrent_delta_rule(kernel, reference, implementation=None):
    """Device router for `torch_recurrent_gated_delta_rule`: a CUDA decode row (one row, no
    `cu_seqlens`) runs `recurrent_decode.gated_delta_rule_decode` (one op); anything else takes
    `route_by_device`."""
    plain = route_by_device(kernel, reference, implementation)

    @functools.wraps(reference)
    def routed(query, key, value, g, beta, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, **kwargs):
        if recurrent_decode.kernel_serves(query, kwargs.get("cu_seqlens")):
            out, state = recurrent_decode.gated_delta_rule_decode(
                query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel
            )
            return out, state if output_final_state else None
        if torch.compiler.is_compiling() and takes_cuda_path(query):
            # fla's fused recurrent kernel does not trace (dynamo stops inside its decorators): a
            # compiled region gets the reference, which inductor compiles
            if kwargs.get("cu_seqlens") is not None:
                raise ValueError("torch_recurrent_gated_delta_rule: packed documents (cu_seqlens) inside a compiled "
                                 "region; call it eagerly (fla's kernel keeps the documents apart)")
            return reference(query, key, value, g=g, beta=beta, initial_state=initial_state,
                             output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return plain(query, key, value, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)

    routed.drama3_kernel = kernel
    routed.drama3_reference = reference
    routed.drama3_decode_kernel = recurrent_decode.gated_delta_rule_decode
    return routed


def router_for(name: str, kernel, reference, implementation):
    """The router that replaces transformers' function `name` (one of ROUTED_FUNCTIONS).

    kernel: the function transformers exposes (its kernel wrapper); reference: the PyTorch function
    it wraps; implementation: what the wrapper calls (a package kernel, or the reference itself)."""
    if name not in ROUTED_FUNCTIONS:
        raise ValueError(f"name: {name!r} is not a routed function; routed: {ROUTED_FUNCTIONS}")
    if name == "torch_chunk_gated_delta_rule":
        return route_chunk_delta_rule(kernel, reference, implementation)
    package_kernel = None if implementation is reference else implementation
    if name == "causal_conv1d_fn":
        return route_causal_conv1d(kernel, reference, package_kernel)
    if name == "causal_conv1d_update":
        return route_short_conv_update(kernel, reference, package_kernel)
    return route_recurrent_delta_rule(kernel, reference, package_kernel)
