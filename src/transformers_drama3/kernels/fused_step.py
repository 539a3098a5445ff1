"""Fused pieces of one decode step, each a Triton kernel beside the PyTorch reference it must equal.

A decode step on a GPU is bound by kernel launches, not arithmetic: each op below is a handful of
small launches in PyTorch (gathers, casts, norms, a cat; a softmax, a sort, a cumsum and a scatter)
that one kernel does in a single pass over the row:

- `partial_codebook_fusion`: the backbone input of a row, `(E_text[main] + sum_{k=1..K}
  E_cb[k][c_k]) / sqrt(1 + K)` on audio rows and `E_text[main]` on text rows
  (`Drama3ForSpeechGeneration.embed_rows`); one program per row.
- `tower_injection`: a tower layer's input before `eh_proj`, `[enorm(E[c] * a + extra);
  hnorm(h)]`, the code embedding gathered, masked, normed and put beside the normed hidden
  state (`Drama3TowerLayer`); one program per row.
- `filtered_race`: the codebook heads' draw, temperature -> softmax -> top-p (dropping the token
  that crosses it) -> top-k (at most `MAX_TOP_K`) -> the exponential race `argmax p_i / E_i`
  over the given noise (`filtered_probabilities` + `decoding.sampler.race`); one program per
  row. The noise comes in from the caller (`decoding.counter_noise`), the same numbers the
  reference divides by, so a seeded request draws the same codes on either path.

Each public function takes the kernel for CUDA tensors when Triton imports, and the reference
otherwise (and under `torch.compile`): the references are what the CPU runs. `<name>_triton` launches the kernel on any
device; the tests run it on CPU tensors through Triton's interpreter (`TRITON_INTERPRET=1` set
before this module is imported; the autotuner then has one config).

Each kernel runs one program per row, and a prefill is rows too: the row's offsets (`row * dim`)
are computed in 64 bits, which a 32-bit program id would wrap past 2^31 elements (1,048,576 rows
of the fusion's 2,048, 524,288 of the injection's 2 x 2,048). The tests compile every kernel for
sm_90 on the CPU and read the offsets' types from the compiled IR
(`tests/test_kernels_ahead_of_time.py`).
"""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (on the CPU): `TRITON_INTERPRET=1`, which
    must be set before triton is first imported."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


TRITON_KERNELS_ENV = "DRAMA3_TRITON_KERNELS"


def kernels_wanted() -> bool:
    """Whether the kernel modules import Triton and define their kernels: where a kernel can run
    (CUDA, or Triton's interpreter), or with `DRAMA3_TRITON_KERNELS=1`, which defines them on a
    machine without a GPU so that they can be compiled ahead of time for one
    (`triton.compile(..., target=GPUTarget(...))`). Which tensors a kernel serves is decided
    per call (CUDA tensors: `cuda_paths.takes_cuda_path`), so the knob changes nothing that runs."""
    return torch.cuda.is_available() or interpreting() or os.environ.get(TRITON_KERNELS_ENV, "0").strip() == "1"


triton = None
# Triton is imported only where a kernel can run (importing it costs ~0.5 s): with CUDA, or under
# its interpreter. Without the [gpu] extra the references serve every device.
if kernels_wanted():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        triton = None

MIN_TEMPERATURE = 1e-5
"""Temperatures below this divide by it instead (the published sampler's floor)."""
MAX_TOP_K = 64
"""The most candidates `filtered_race`'s kernel keeps (the codebook heads keep at most 30)."""


def triton_available() -> bool:
    return triton is not None


def use_kernel(tensor: torch.Tensor) -> bool:
    """Whether a kernel serves `tensor`: a CUDA tensor, with Triton installed, in eager code.

    Under `torch.compile` the references run instead: inductor fuses them into its own kernels
    (the compiled decode step, `decoding/step.py`), and a graph holds no opaque launch."""
    return triton is not None and tensor.is_cuda and not torch.compiler.is_compiling()


# ----------------------------------------------------------------------------- references


def rms_norm_zero_centred(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's RMSNorm, `x / rms(x) * (1 + weight)` in float32, returned in x's dtype."""
    wide = x.float()
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).type_as(x)


def partial_codebook_fusion_reference(
    text_table: torch.Tensor,
    codebook_table: torch.Tensor,
    input_ids: torch.Tensor,
    codes: torch.Tensor,
    semantic_start: int,
    semantic_end: int,
    codebook_size: int,
) -> torch.Tensor:
    """text_table [vocab, dim]; codebook_table [num_codebooks * codebook_size, dim]; input_ids
    [...]; codes [..., K] codes 1..K of each row -> [..., dim] in text_table's dtype."""
    text = text_table[input_ids]
    fused_count = codes.shape[-1]
    offsets = torch.arange(1, 1 + fused_count, device=codes.device) * codebook_size
    acoustic = codebook_table[codes.clamp(0, codebook_size - 1) + offsets].sum(dim=-2)
    fused = (text + acoustic.to(text.dtype)) * (1 + fused_count) ** -0.5
    is_semantic = (input_ids >= semantic_start) & (input_ids <= semantic_end)
    return torch.where(is_semantic[..., None], fused, text)


def tower_injection_reference(
    table: torch.Tensor,
    codes: torch.Tensor,
    audio_weight: torch.Tensor,
    extra: torch.Tensor | None,
    hidden: torch.Tensor,
    enorm_weight: torch.Tensor,
    hnorm_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """table [codebook_size, dim]; codes [...]; audio_weight [..., 1]; extra, hidden [..., dim]
    -> [..., 2 * dim]: `[enorm(table[clamp(codes)] * audio_weight + extra); hnorm(hidden)]`."""
    e = table[codes.clamp(0, table.shape[0] - 1)] * audio_weight
    if extra is not None:
        e = e + extra
    return torch.cat((rms_norm_zero_centred(e, enorm_weight, eps), rms_norm_zero_centred(hidden, hnorm_weight, eps)), -1)


def filtered_probabilities(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float, keep_crossing: bool
) -> torch.Tensor:
    """The distribution a draw samples from: logits `[..., V]` -> probabilities `[..., V]` (float32).

    Temperature first, then top-p over the full softmax, then top-k; rank 0 is always kept.
    `keep_crossing` keeps the token whose cumulative mass first exceeds top-p (main token);
    otherwise it is dropped (codebook heads).
    """
    scaled = logits.float() / max(temperature, MIN_TEMPERATURE)
    probabilities = torch.softmax(scaled, dim=-1)
    sorted_probabilities, order = probabilities.sort(dim=-1, descending=True, stable=True)
    cumulative = sorted_probabilities.cumsum(dim=-1)
    mass_before = cumulative - sorted_probabilities if keep_crossing else cumulative
    dropped = mass_before > top_p
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    if top_k is not None:
        dropped |= ranks >= top_k
    dropped &= ranks > 0
    kept = sorted_probabilities.masked_fill(dropped, 0.0)
    kept = kept / kept.sum(dim=-1, keepdim=True)
    return torch.zeros_like(kept).scatter(-1, order, kept)


def top_k_filtered_probabilities(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, keep_crossing: bool
) -> torch.Tensor:
    """`filtered_probabilities` for a draw capped at `top_k` candidates, sorting only those: the
    candidates past rank top_k are dropped whatever their mass, so the first top_k of the sorted
    probabilities (`topk`) decide everything. The same numbers as the full sort, up to the order
    of exactly tied probabilities (which `topk` does not keep stable)."""
    scaled = logits.float() / max(temperature, MIN_TEMPERATURE)
    probabilities = torch.softmax(scaled, dim=-1)
    top, order = probabilities.topk(min(top_k, logits.shape[-1]), dim=-1, sorted=True)
    cumulative = top.cumsum(dim=-1)
    mass_before = cumulative - top if keep_crossing else cumulative
    # rank 0 is always kept; a comparison with the ranks, not `dropped[..., 0] = False`: writing a
    # Python scalar traces into a CPU tensor constant, which keeps CUDA graphs from capturing a step
    ranks = torch.arange(top.shape[-1], device=top.device)
    dropped = (mass_before > top_p) & (ranks > 0)
    kept = top.masked_fill(dropped, 0.0)
    kept = kept / kept.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probabilities).scatter(-1, order, kept)


def filtered_race_reference(
    logits: torch.Tensor, noise: torch.Tensor, temperature: float, top_k: int, top_p: float, keep_crossing: bool
) -> torch.Tensor:
    """logits, noise [rows, V] (noise: Exp(1) draws, `inf` where a candidate may not be drawn)
    -> long [rows]: `argmax p_i / noise_i` over the filtered distribution."""
    probabilities = filtered_probabilities(logits, temperature, top_k, top_p, keep_crossing)
    return (probabilities / noise).argmax(dim=-1)


# ----------------------------------------------------------------------------- kernels

if triton is not None:

    def _configs():
        """One config under the interpreter (each config is a full slow run there), a few on GPUs."""
        warps = (4,) if interpreting() else (2, 4, 8)
        return [triton.Config({}, num_warps=w) for w in warps]

    @triton.autotune(configs=_configs(), key=["dim", "fused_count"])
    @triton.jit
    def _partial_codebook_fusion_kernel(
        text_ptr, codebook_ptr, ids_ptr, codes_ptr, out_ptr,
        dim, fused_count, semantic_start, semantic_end, codebook_size, scale,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # row * width in 64 bits: a prefill passes 2^31 elements
        columns = tl.arange(0, BLOCK)
        inside = columns < dim
        token = tl.load(ids_ptr + row)
        text = tl.load(text_ptr + token * dim + columns, mask=inside, other=0.0).to(tl.float32)
        acoustic = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(fused_count):
            code = tl.load(codes_ptr + row * fused_count + k)
            code = tl.minimum(tl.maximum(code, 0), codebook_size - 1)
            table_row = (k + 1) * codebook_size + code
            acoustic += tl.load(codebook_ptr + table_row * dim + columns, mask=inside, other=0.0).to(tl.float32)
        is_semantic = (token >= semantic_start) & (token <= semantic_end)
        out = tl.where(is_semantic, (text + acoustic) * scale, text)
        tl.store(out_ptr + row * dim + columns, out.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _rms_norm_row(x, weight, dim, eps):
        mean_square = tl.sum(x * x, axis=0) / dim
        return x * tl.rsqrt(mean_square + eps) * (1.0 + weight)

    @triton.autotune(configs=_configs(), key=["dim"])
    @triton.jit
    def _tower_injection_kernel(
        table_ptr, codes_ptr, weight_ptr, extra_ptr, hidden_ptr, enorm_ptr, hnorm_ptr, out_ptr,
        dim, codebook_size, eps,
        HAS_EXTRA: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        columns = tl.arange(0, BLOCK)
        inside = columns < dim
        code = tl.load(codes_ptr + row)
        code = tl.minimum(tl.maximum(code, 0), codebook_size - 1)
        e = tl.load(table_ptr + code * dim + columns, mask=inside, other=0.0).to(tl.float32)
        e = e * tl.load(weight_ptr + row).to(tl.float32)
        if HAS_EXTRA:
            e += tl.load(extra_ptr + row * dim + columns, mask=inside, other=0.0).to(tl.float32)
        h = tl.load(hidden_ptr + row * dim + columns, mask=inside, other=0.0).to(tl.float32)
        enorm = tl.load(enorm_ptr + columns, mask=inside, other=0.0).to(tl.float32)
        hnorm = tl.load(hnorm_ptr + columns, mask=inside, other=0.0).to(tl.float32)
        out_row = out_ptr + row * 2 * dim
        element = out_ptr.dtype.element_ty
        tl.store(out_row + columns, _rms_norm_row(e, enorm, dim, eps).to(element), mask=inside)
        tl.store(out_row + dim + columns, _rms_norm_row(h, hnorm, dim, eps).to(element), mask=inside)

    @triton.autotune(configs=_configs(), key=["vocab"])
    @triton.jit
    def _filtered_race_kernel(
        logits_ptr, noise_ptr, out_ptr,
        vocab, inverse_temperature, top_k, top_p,
        KEEP_CROSSING: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        columns = tl.arange(0, BLOCK)
        inside = columns < vocab
        scaled = tl.load(logits_ptr + row * vocab + columns, mask=inside, other=float("-inf")).to(tl.float32)
        scaled = scaled * inverse_temperature
        exponentials = tl.exp(scaled - tl.max(scaled, axis=0))
        exponentials = tl.where(inside, exponentials, 0.0)
        probabilities = exponentials / tl.sum(exponentials, axis=0)
        # Walk the candidates from the most probable down (ties: lower index first, as a stable
        # sort), keeping each while the mass before it (or up to it) is within top_p.
        remaining = tl.where(inside, probabilities, -1.0)
        kept = columns < 0
        cumulative = 0.0
        for rank in range(top_k):
            best = tl.max(remaining, axis=0)
            index = tl.min(tl.where(remaining == best, columns, BLOCK), axis=0)
            cumulative += best
            mass = cumulative - best if KEEP_CROSSING else cumulative
            keep = (rank == 0) | (mass <= top_p)
            kept = kept | ((columns == index) & keep)
            remaining = tl.where(columns == index, -1.0, remaining)
        noise = tl.load(noise_ptr + row * vocab + columns, mask=inside, other=float("inf"))
        # Renormalising the kept mass would scale every score alike: the argmax needs no division.
        # A dropped candidate scores 0, as its zero probability does in the reference.
        scores = tl.where(kept, probabilities / noise, 0.0)
        best_score = tl.max(scores, axis=0)
        choice = tl.min(tl.where(scores == best_score, columns, BLOCK), axis=0)
        tl.store(out_ptr + row, choice.to(tl.int64))


def _rows(tensor: torch.Tensor, width: int) -> torch.Tensor:
    return tensor.reshape(-1, width).contiguous()


def partial_codebook_fusion(
    text_table: torch.Tensor,
    codebook_table: torch.Tensor,
    input_ids: torch.Tensor,
    codes: torch.Tensor,
    semantic_start: int,
    semantic_end: int,
    codebook_size: int,
) -> torch.Tensor:
    """`partial_codebook_fusion_reference`, one kernel per call on CUDA."""
    function = partial_codebook_fusion_triton if use_kernel(text_table) else partial_codebook_fusion_reference
    return function(text_table, codebook_table, input_ids, codes, semantic_start, semantic_end, codebook_size)


def partial_codebook_fusion_triton(text_table, codebook_table, input_ids, codes, semantic_start, semantic_end,
                                   codebook_size) -> torch.Tensor:
    """The kernel of `partial_codebook_fusion` (any device Triton runs on)."""
    dim, fused_count = text_table.shape[1], codes.shape[-1]
    ids = input_ids.reshape(-1).contiguous()
    out = torch.empty(ids.shape[0], dim, dtype=text_table.dtype, device=text_table.device)
    _partial_codebook_fusion_kernel[(ids.shape[0],)](
        text_table.contiguous(), codebook_table.contiguous(), ids, _rows(codes, fused_count), out,
        dim, fused_count, semantic_start, semantic_end, codebook_size, (1 + fused_count) ** -0.5,
        BLOCK=triton.next_power_of_2(dim),
    )
    return out.view(*input_ids.shape, dim)


def tower_injection(
    table: torch.Tensor,
    codes: torch.Tensor,
    audio_weight: torch.Tensor,
    extra: torch.Tensor | None,
    hidden: torch.Tensor,
    enorm_weight: torch.Tensor,
    hnorm_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """`tower_injection_reference`, one kernel per call on CUDA."""
    function = tower_injection_triton if use_kernel(hidden) else tower_injection_reference
    return function(table, codes, audio_weight, extra, hidden, enorm_weight, hnorm_weight, eps)


def tower_injection_triton(table, codes, audio_weight, extra, hidden, enorm_weight, hnorm_weight, eps) -> torch.Tensor:
    """The kernel of `tower_injection` (any device Triton runs on)."""
    dim = hidden.shape[-1]
    flat_hidden = _rows(hidden, dim)
    rows = flat_hidden.shape[0]
    weights = audio_weight.expand(*hidden.shape[:-1], 1).reshape(-1).contiguous()
    flat_extra = None if extra is None else _rows(extra.expand_as(hidden), dim)
    out = torch.empty(rows, 2 * dim, dtype=hidden.dtype, device=hidden.device)
    _tower_injection_kernel[(rows,)](
        table.contiguous(), _rows(codes, 1), weights, flat_hidden if flat_extra is None else flat_extra, flat_hidden,
        enorm_weight.contiguous(), hnorm_weight.contiguous(), out, dim, table.shape[0], eps,
        HAS_EXTRA=extra is not None, BLOCK=triton.next_power_of_2(dim),
    )
    return out.view(*hidden.shape[:-1], 2 * dim)


def filtered_race(
    logits: torch.Tensor, noise: torch.Tensor, temperature: float, top_k: int, top_p: float, keep_crossing: bool
) -> torch.Tensor:
    """`filtered_race_reference`, one kernel per call on CUDA (when top_k is at most `MAX_TOP_K`)."""
    fits = top_k is not None and 0 < top_k <= MAX_TOP_K
    function = filtered_race_triton if use_kernel(logits) and fits else filtered_race_reference
    return function(logits, noise, temperature, top_k, top_p, keep_crossing)


def filtered_race_triton(logits, noise, temperature: float, top_k: int, top_p: float, keep_crossing: bool) -> torch.Tensor:
    """The kernel of `filtered_race` (any device Triton runs on); 0 < top_k <= `MAX_TOP_K`."""
    vocab = logits.shape[-1]
    flat = _rows(logits, vocab)
    out = torch.empty(flat.shape[0], dtype=torch.long, device=logits.device)
    _filtered_race_kernel[(flat.shape[0],)](
        flat, _rows(noise.float(), vocab), out, vocab, 1.0 / max(temperature, MIN_TEMPERATURE), top_k, top_p,
        KEEP_CROSSING=keep_crossing, BLOCK=triton.next_power_of_2(vocab),
    )
    return out.view(logits.shape[:-1])
