"""The frame loop: one decode run over the one step, yielding a `FrameStep` per step.

    run = DecodeRun.prefilled(model, input_ids, audio_codes, attention_mask, sampler, budgets)
    for step in run.steps():      # FrameStep: main ids, frames, who spoke, who ended
        ...

A run sets its `DecodeCache` up once, the prefill writes the prompt into it, and every step is
`step.draw` then `step.feed`. `steps()` feeds the next row only once the host has read that some
item still speaks, so the run leaves its cache holding what was drawn, the open row last, and can
be continued. `steps_ahead()` makes each step by one call of `step.step` (draw and feed: one graph)
and, on a GPU, queues the next step before the host reads the last: the device makes a step while
the host reads the one before; it feeds rows past the end of the run, which cannot be continued
(for runs dropped at their end: `generate()`, `stream()`, GRPO rollouts). Either way the host reads
each step once, in one copy (`PendingStep`). `compile_config` (a transformers
`CompileConfig`) only decides whether the two are wrapped by `torch.compile`: eager and compiled
runs execute the same functions, on the same cache, with the same random numbers. The text stream
continues a run turn by turn (`extend`, `feed_last_frame`, `next_turn`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from transformers import CompileConfig

from ..integrations import experts_on_batched_mm
from ..kernels.cuda_paths import takes_cuda_path
from ..kernels.torch_compat import keep_recording_new_static_inputs, with_cpu_codegen_fixes
from . import step as decode_step
from .steady_guards import SteadyGuards, checked_call
from .state import DecodeCache, DecodeState, compiled_capacity, empty_state

CACHE_IMPLEMENTATIONS = ("dynamic", "static")
"""The `cache_implementation` values a call may name: both decode on the one `DecodeCache`;
"static" means one fixed capacity and, by default on CUDA, a compiled step."""


def check_cache_implementation(name: str | None) -> None:
    if name is not None and name not in CACHE_IMPLEMENTATIONS:
        raise ValueError(
            f"cache_implementation={name!r}; Drama 3 decodes with one of {list(CACHE_IMPLEMENTATIONS)} "
            f"(None: dynamic)"
        )


@dataclass
class FrameStep:
    """What one decode step produced for the batch.

    main_ids: [batch] the drawn main token (a `<|semantic:c0|>`, eos, or `<|audio_separator|>`);
    frames: [batch, num_codebooks] (zeros where no frame was made);
    produced: [batch] the item was still speaking and this is one of its frames;
    ended: [batch] the item ended at this step (eos, or its budget is used up);
    eos: [batch] the item ended with eos;
    boundary: [batch] the item drew `<|audio_separator|>`: its current line ended and the next
    begins (no frame).
    """

    step: int
    main_ids: torch.Tensor
    frames: torch.Tensor
    produced: torch.Tensor
    ended: torch.Tensor
    eos: torch.Tensor
    boundary: torch.Tensor | None = None


@dataclass
class LineSeparators:
    """Where the backbone may draw `<|audio_separator|>` (line-by-line layouts).

    token_id: the id of `<|audio_separator|>`; left: [batch] how many more separators each item
    may draw (the line boundaries its prompt has not spoken yet; 0: the token stays masked).
    """

    token_id: int
    left: torch.Tensor


class TakeCollector:
    """Gathers the frames and line boundaries of every item; `finish()` drops click frames."""

    def __init__(self, batch: int):
        self.frames: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        self.finish_reasons = [""] * batch
        self.line_boundaries: list[list[int]] = [[] for _ in range(batch)]
        self.last_was_frame = [False] * batch

    @property
    def lengths(self) -> list[int]:
        return [len(frames) for frames in self.frames]

    def add(self, step: FrameStep) -> None:
        for item in step.produced.nonzero().flatten().tolist():
            self.frames[item].append(step.frames[item])
            self.last_was_frame[item] = True
        if step.boundary is not None:
            for item in step.boundary.nonzero().flatten().tolist():
                self.line_boundaries[item].append(len(self.frames[item]))
                self.last_was_frame[item] = False
        for item in step.ended.nonzero().flatten().tolist():
            self.finish_reasons[item] = "eos" if bool(step.eos[item]) else "length"

    def takes(self, num_codebooks: int) -> list[torch.Tensor]:
        """Every item's frames as drawn, click frames included: per item [frames, num_codebooks]."""
        return [
            torch.stack(frames) if frames else torch.zeros(0, num_codebooks, dtype=torch.long)
            for frames in self.frames
        ]

    def finish(self, num_codebooks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
        """codes [batch, frames, num_codebooks] (0 after each item's length), lengths [batch], and
        which items lost a `<|semantic:0|>` frame right before eos (not before a line boundary)."""
        clicks = [
            reason == "eos" and last and bool(frames) and int(frames[-1][0]) == 0
            for reason, last, frames in zip(self.finish_reasons, self.last_was_frame, self.frames)
        ]
        kept = [frames[:-1] if click else frames for frames, click in zip(self.frames, clicks)]
        lengths = torch.tensor([len(frames) for frames in kept], dtype=torch.long, device=device)
        codes = torch.zeros(len(kept), max(lengths.tolist(), default=0), num_codebooks, dtype=torch.long, device=device)
        for item, frames in enumerate(kept):
            if frames:
                codes[item, : len(frames)] = torch.stack(frames).to(device)
        return codes, lengths, clicks


class PendingStep:
    """What one `draw` made (`step.StepOutput`) and which items still speak after it (`active`
    [batch]), on their way to the host in one packed copy, started when the step is made: on a GPU
    into pinned memory without waiting, so the host can queue more work (the step's feed) before
    `wait()` waits for the draw. Elsewhere the copy is made at once."""

    def __init__(self, index: int, output, active: torch.Tensor):
        self.index = index
        flags = torch.stack((output.speaking, output.ended, output.eos, output.boundary, active), dim=1)
        packed = torch.cat((output.main_ids[:, None], flags.to(output.main_ids.dtype), output.frames), dim=1)  # [batch, 6 + C]
        self._copied = None
        if packed.device.type == "cuda":
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._host = packed.cpu()

    def wait(self) -> tuple[FrameStep, torch.Tensor]:
        """(the step as a `FrameStep` of host tensors, `active` on the host)."""
        if self._copied is not None:
            self._copied.synchronize()
        host = self._host
        speaking, ended, eos, boundary, active = host[:, 1:6].bool().unbind(dim=1)
        return FrameStep(self.index, host[:, 0], host[:, 6:], speaking, ended, eos, boundary), active


def _open_row(rows: torch.Tensor) -> torch.Tensor:
    """The last row of `rows` [batch, rows, ...] as a contiguous copy: a compiled step's guards
    check strides, and a view (or a clone keeping a view's strides, as at batch 1) would make the
    first step's graph differ from the next ones' (two graphs per batch size instead of one)."""
    return rows[:, -1:].clone(memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------- a decode run


def runs_ahead(device: torch.device) -> bool:
    """Whether work queued on `device` runs while the host goes on (CUDA): only there does queuing
    a step before reading the last gain anything (elsewhere it would make a step past the end of
    every run, and delay every step's reading by one, for nothing)."""
    return device.type == "cuda"


class RunFedAhead(RuntimeError):
    """A run stepped by `DecodeRun.steps_ahead()` was asked to continue."""


class DecodeRun:
    """One decode run: the model, its sampler, its `DecodeCache` and its `DecodeState`.

    separator_id: the id of `<|audio_separator|>` when some item may draw it (the state's
    `separators_left` says how many), else None. compile_config: None runs the step eagerly; a
    `CompileConfig` compiles `draw` and `feed`."""

    def __init__(self, model, sampler, cache: DecodeCache, state: DecodeState, separator_id: int | None = None,
                 compile_config: CompileConfig | None = None):
        self.model, self.sampler, self.cache, self.state = model, sampler, cache, state
        self.separator_id = separator_id
        self.compiled = compile_config is not None
        self._draw, self._feed, self._step = compiled_functions(compile_config)
        self._guards = SteadyGuards() if self.compiled else None
        if self.compiled:
            cache.mark_static()

    @classmethod
    def prefilled(cls, model, input_ids, audio_codes, attention_mask, sampler, budgets, separators: LineSeparators | None = None,
                  alignment=None, compile_config: CompileConfig | None = None, prefill_graphs: bool = False,
                  inputs_embeds: torch.Tensor | None = None) -> DecodeRun:
        """Set a cache up for a prompt (input_ids [batch, rows], audio_codes [batch, rows,
        num_codebooks], attention_mask [batch, rows], left padding) and `budgets` [batch] frames,
        and prefill the prompt into it. The cache holds every row the run may feed: the prompt,
        one per frame and line boundary, and the rows `steps_ahead` feeds past the end (a
        compiled run rounds up to its length class).

        `prefill_graphs` (a compiled run only): the prompt is left-padded to its length bucket
        (`prefill_bucket`) and prefilled by `compile_config`'s compiled prefill, one graph per
        bucket (and batch size and capacity class) instead of one per prompt length.

        `inputs_embeds` [batch, rows, hidden]: the backbone reads these for the prompt instead of
        embedding its rows (the tower and the sampler still read the rows)."""
        if prefill_graphs:
            if inputs_embeds is not None:
                raise ValueError("inputs_embeds cannot be prefilled by the compiled prefill (prefill_graphs=True), which "
                                 "pads the prompt to its length bucket")
            if compile_config is None:
                raise ValueError("prefill_graphs=True needs a compiled run: cache_implementation=\"static\" with a "
                                 "compile_config (the default on CUDA), not disable_compile=True")
            input_ids, audio_codes, attention_mask = left_padded(
                input_ids, audio_codes, attention_mask, prefill_bucket(input_ids.shape[1]))
        batch, rows = input_ids.shape
        device = input_ids.device
        # sized on the host, from the host's numbers (budgets and separators come from the request)
        left = torch.zeros(batch, dtype=torch.long) if separators is None else separators.left.cpu()
        most = rows + int((budgets.cpu() + left.clamp(min=0)).max()) + 2  # room for `steps_ahead`: `_start_loop`
        budgets, left = budgets.to(device), left.to(device).clone()
        capacity = most if compile_config is None else compiled_capacity(most)
        cache = DecodeCache(model, capacity, device, batch)
        state = replace(empty_state(model, batch, capacity, device), budgets=budgets, separators_left=left, alignment=alignment)
        run = cls(model, sampler, cache, state, None if separators is None else separators.token_id, None)
        run._prefill_graph = compiled_prefill(compile_config) if prefill_graphs else None
        run.extend(input_ids, audio_codes, attention_mask, inputs_embeds)
        if compile_config is not None:
            run = cls(model, sampler, run.cache, run.state, run.separator_id, compile_config)
        return run

    def extend(self, input_ids: torch.Tensor, audio_codes: torch.Tensor, attention_mask: torch.Tensor | None = None,
               inputs_embeds: torch.Tensor | None = None) -> None:
        """Write rows input_ids [batch, new] / audio_codes [batch, new, num_codebooks] (mask
        [batch, new], default all real) into the cache: the prefill when the cache is empty, else
        after the open row (the backbone continues from its states, the tower is teacher-forced
        from the open row). The last new row becomes the open row. `inputs_embeds` (the prefill
        only): the backbone's input for the rows, instead of their embeddings."""
        self._check_continuable()
        model, cache, state = self.model, self.cache, self.state
        rows = input_ids.shape[1]
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        backbone, tower = cache.parts
        filled = backbone.filled
        if inputs_embeds is not None and filled:
            raise ValueError("inputs_embeds: only a prefill (an empty cache) reads them")
        self._reserve(rows)
        key_mask = self.state.key_mask.clone()
        key_mask[:, filled : filled + rows] = attention_mask.bool()
        mask = key_mask[:, : filled + rows].long()
        tower_rows = rows - 1 if filled == 0 else rows
        compiled = cache.compiled
        cache.compiled = False  # rows written from the host read only the filled columns
        cache.open_window(backbone, rows)
        cache.open_window(tower, tower_rows)
        if filled == 0:
            hidden = self._prefill(input_ids, audio_codes, mask, inputs_embeds)
        else:
            hidden = model.extend(self.state.hidden, state.ids, state.codes, input_ids, audio_codes, mask, cache)
        cache.compiled = compiled
        for part, written in ((backbone, rows), (tower, tower_rows)):
            part.next_column.add_(written)
            cache.advance(part, written)
        position = (mask.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
        self.state = replace(
            self.state, hidden=_open_row(hidden), ids=_open_row(input_ids), codes=_open_row(audio_codes), key_mask=key_mask,
            position=position,
        )

    _prefill_graph = None

    def _prefill(self, input_ids, audio_codes, mask, inputs_embeds=None) -> torch.Tensor:
        """`model.prefill` into the empty cache; through the compiled prefill when the run has one,
        whose outputs (the hidden states, and the cache's states, which the prefill allocates) are
        then copied out of CUDA-graph memory, which the next replay reuses."""
        if self._prefill_graph is None:
            return self.model.prefill(input_ids, audio_codes, mask, self.cache, inputs_embeds=inputs_embeds)
        self.cache.mark_counters_static()
        torch.compiler.cudagraph_mark_step_begin()
        hidden = checked_call(self._prefill_graph, self.model, input_ids, audio_codes, mask, self.cache).clone()
        self.cache.own_states()
        return hidden

    def copy(self) -> DecodeRun:
        """A run that continues from where this one stands, on its own copy of the cache and state
        (the model and the sampler are shared): the voice-prefix cache hands one to each request."""
        self._check_continuable()
        twin = copy.copy(self)
        twin.cache = copy.deepcopy(self.cache)
        twin.state = replace(self.state, alignment=None if self.state.alignment is None else self.state.alignment.take(
            range(self.state.batch)))
        return twin

    def feed_last_frame(self, step: FrameStep) -> None:
        """A take that used its budget ended without its last frame fed (the loop feeds a row only
        while an item speaks): feed it, so the cache holds the whole take and ends with an open row."""
        self._check_continuable()
        self._reserve(1)
        self.cache.open_window(self.cache.backbone_part, 1)
        device = self.state.ids.device  # a step's tensors are on the host
        self.state = decode_step.feed(self.model, self.cache, self.state, step.main_ids.to(device), step.frames.to(device))
        self.cache.advance(self.cache.backbone_part, 1)

    def next_turn(self, sampler, budgets: torch.Tensor) -> None:
        """Start drawing a new take from the open row, with `sampler` and `budgets` [batch]."""
        self._check_continuable()
        self.sampler = sampler
        device = self.state.key_mask.device
        self.state = replace(
            self.state, active=torch.ones_like(self.state.active), produced=torch.zeros_like(self.state.produced),
            budgets=budgets.to(device), separators_left=torch.zeros_like(self.state.separators_left),
        )

    def steps(self) -> Iterator[FrameStep]:
        """One `FrameStep` (host tensors) per step until every item has ended: `draw`, the step read
        on the host and yielded, then `feed` of its row, only while some item still speaks. The run
        can be continued afterwards (`extend`, `feed_last_frame`, `next_turn`)."""
        self._check_continuable()
        model, cache, sampler = self.model, self.cache, self.sampler
        backbone, tower = cache.parts
        self._start_loop(rows_past_end=1)
        index = 0
        while True:
            cache.open_window(tower, 1)
            self._mark_step()
            output, self.state = self._drawn(self._call(self._draw, model, cache, sampler, self.state, self.separator_id))
            cache.advance(tower, 1)
            step, active = PendingStep(index, output, self.state.active).wait()
            yield step
            if not bool(active.any()):
                if not bool((step.produced | step.boundary).any()):
                    # every item drew eos: no frame follows the open row, so the tower's take of it
                    # is not kept (a run continued by `extend` teacher-forces it with its next row)
                    tower.next_column.sub_(1)
                    tower.filled -= 1
                return
            cache.open_window(backbone, 1)
            self._mark_step()
            self.state = self._owned(self._call(self._feed, model, cache, self.state, output.main_ids, output.frames))
            cache.advance(backbone, 1)
            index += 1

    def steps_ahead(self) -> Iterator[FrameStep]:
        """The steps `steps()` makes, each made whole by one call of `step.step` (its draw and the
        feed of its row: one graph, one CUDA graph when compiled). On a device that runs apart
        from the host (`runs_ahead`: CUDA) the next step is queued before the host reads the last
        one: the device makes a step while the host reads the one before and the caller handles
        it. At each yield the run stands after the step yielded, or (queued ahead) the next one.

        The run's last row is fed (and, queued ahead, one more step is made past its end: every
        item has ended, it makes no frame), so the run cannot be continued (`RunFedAhead`): for
        runs dropped at their end (`generate()`, `stream()`, GRPO rollouts)."""
        self._check_continuable()
        self._start_loop(rows_past_end=2)
        self.fed_ahead = True
        ahead = runs_ahead(self.state.ids.device)
        pending = self._queued(0)
        while True:
            following = self._queued(pending.index + 1) if ahead else None
            step, active = pending.wait()
            yield step
            if not bool(active.any()):
                return
            pending = following if ahead else self._queued(pending.index + 1)

    def _start_loop(self, rows_past_end: int) -> None:
        """Room for the rows a loop may feed: a row per frame and line boundary it may draw, and
        `rows_past_end` more (`steps_ahead` feeds past the end of the run); every guard checked
        again at the loop's first calls."""
        state = self.state
        self._reserve(int((state.budgets - state.produced + state.separators_left.clamp(min=0)).max()) + rows_past_end)
        if self._guards is not None:
            self._guards.reset()  # the model, the sampler or the capacity may differ from the last loop's

    def _queued(self, index: int) -> PendingStep:
        """Queue step `index` (`step.step`) on the run's cache and state: the run moves on to the
        state it leaves; its outputs are on their way to the host."""
        cache = self.cache
        for part in cache.parts:
            cache.open_window(part, 1)
        self._mark_step()
        output, self.state = self._drawn(self._call(self._step, self.model, cache, self.sampler, self.state, self.separator_id))
        for part in cache.parts:
            cache.advance(part, 1)
        return PendingStep(index, output, self.state.active)

    fed_ahead = False
    """Whether the run was stepped by `steps_ahead()`: its cache holds rows past its end."""

    def _check_continuable(self) -> None:
        if self.fed_ahead:
            raise RunFedAhead(
                "this decode run was stepped by steps_ahead(), which feeds rows past the end of the run: "
                "it cannot be continued (extend, feed_last_frame, next_turn, steps, copy); continue a run stepped by steps()"
            )

    def _reserve(self, rows: int) -> None:
        """Room for `rows` more rows; a compiled run grows to its next length class (one graph each)."""
        needed = self.cache.backbone_part.filled + rows
        if self.compiled and needed > self.cache.capacity:
            self.cache.grow(compiled_capacity(needed))
            self.cache.mark_static()
        self.cache.reserve(rows)
        missing = self.cache.capacity - self.state.key_mask.shape[1]
        if missing > 0:
            self.state = replace(self.state, key_mask=torch.nn.functional.pad(self.state.key_mask, (0, missing)))

    def _call(self, function, *args):
        """`function(*args)`; compiled, with dynamo's guards checked in full where the run may
        have changed (`SteadyGuards`: each function's first call of a loop)."""
        return function(*args) if self._guards is None else self._guards(function, *args)

    def _mark_step(self) -> None:
        if self.compiled:
            torch.compiler.cudagraph_mark_step_begin()

    def _owned(self, value):
        """A compiled function's outputs, copied out of CUDA-graph memory (the next replay reuses it)."""
        return owned(value) if self.compiled else value

    def _drawn(self, value):
        """`_owned` of a draw's outputs, together with what else the draw replaced (`own_drawn_state`)."""
        if self.compiled:
            own_drawn_state(self.sampler, self.state.alignment)
        return self._owned(value)


def own_drawn_state(sampler, alignment) -> None:
    """After a compiled draw: what else it replaced, copied out of CUDA-graph memory: the sampler's
    RAS window and counters, the alignment's state (a feed replaces neither)."""
    sampler.owned()
    if alignment is not None:
        alignment.owned()


def owned(value):
    """`value` (a tensor, a tuple, a dataclass of tensors) with every tensor cloned: what a compiled
    step returns lives in CUDA-graph memory the next replay overwrites."""
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(owned(item) for item in value)
    if hasattr(value, "__dataclass_fields__"):
        return replace(value, **{name: owned(getattr(value, name)) for name in value.__dataclass_fields__
                                 if torch.is_tensor(getattr(value, name))})
    return value


# ----------------------------------------------------------------------------- compiling the step

_COMPILED: dict[tuple, StepFunctions] = {}


def compile_options(config: CompileConfig) -> dict:
    """`torch.compile` keyword arguments of a transformers `CompileConfig`."""
    options = {
        "fullgraph": config.fullgraph,
        "dynamic": config.dynamic,
        "backend": config.backend,
        "mode": config.mode,
        "options": config.options,
    }
    if options["mode"] is not None and options["options"] is not None:
        options.pop("mode")  # torch.compile takes one of the two
    return options


def default_compile_config() -> CompileConfig:
    """One graph per function (`fullgraph=True`), CUDA graphs on a GPU, and torch's automatic
    dynamic shapes (`dynamic=None`): the first batch size and length class compile a graph of
    fixed shapes; the first call that differs compiles the step once more with the sizes that
    changed left symbolic, and every later size runs that graph (batch 1 keeps its own: torch
    specialises sizes of 1). CUDA graphs record one graph per size. A process that decodes or
    serves several batch sizes therefore compiles the step two or three times, not once per batch
    size and length class (a compile of the published model takes minutes)."""
    return CompileConfig(fullgraph=True, dynamic=None, backend="inductor", mode="reduce-overhead")


_GROUPED_GEMM_DTYPES = (torch.bfloat16,)
"""The weight dtypes transformers' grouped-GEMM experts run under torch.compile; with any other it
calls its fallback op, which reads the expert offsets on the host (a CUDA graph cannot hold that)."""


def _grouped_gemm_falls_back(experts: list[torch.nn.Module]) -> bool:
    """Whether transformers' grouped GEMM, compiled, would call its host-reading fallback for any of
    `experts` (their weights are not in a `_GROUPED_GEMM_DTYPES` dtype)."""
    return any(_down_dtype(module) not in _GROUPED_GEMM_DTYPES for module in experts)


def _down_dtype(experts: torch.nn.Module) -> torch.dtype:
    weight = experts._parameters.get("down_proj")  # a dict lookup: Module.__getattr__ costs more, twice a step
    return (experts.down_proj if weight is None else weight).dtype


def capturable_experts(model) -> contextlib.AbstractContextManager:
    """Inside: the routed experts compute with transformers' `batched_mm` (gathers each chosen
    expert's weights, batched matmuls: no host read) wherever they would take `grouped_mm` in a
    dtype its compiled form does not take, and go back to `grouped_mm` on leaving. A compiled step
    then holds no host sync; bf16 models, and every eager call, keep their grouped GEMM. The
    switch itself is `integrations.experts_on_batched_mm` (a private attribute of transformers'
    configs); each config's setting is read once per call (~0.1 ms per call read expert by expert
    at 40 layers, twice a step)."""
    return experts_on_batched_mm(model, where=_grouped_gemm_falls_back)


def _with_capturable_experts(compiled, cuda_only: bool = False):
    @functools.wraps(compiled)
    def call(model, *args):
        if cuda_only and not takes_cuda_path(model.device):
            return compiled(model, *args)
        with capturable_experts(model):
            return compiled(model, *args)

    return call


PREFILL_BUCKET_MIN = 16
"""The shortest length bucket of a compiled prefill."""


def prefill_bucket(rows: int) -> int:
    """The rows a compiled prefill of a `rows`-row prompt runs: the next power of two >= `rows`
    (at least `PREFILL_BUCKET_MIN`), so a few graphs serve every prompt length."""
    return max(PREFILL_BUCKET_MIN, 1 << max(0, math.ceil(math.log2(max(rows, 1)))))


def left_padded(input_ids: torch.Tensor, audio_codes: torch.Tensor, attention_mask: torch.Tensor | None, rows: int):
    """A prompt left-padded to `rows` rows (id 0, zero codes, mask 0), as a batch pads its
    shorter prompts: the padding changes no real row's output."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    missing = rows - input_ids.shape[1]
    if missing <= 0:
        return input_ids, audio_codes, attention_mask
    pad = torch.nn.functional.pad
    return pad(input_ids, (missing, 0)), pad(audio_codes, (0, 0, missing, 0)), pad(attention_mask, (missing, 0))


def _prefill_rows(model, input_ids, audio_codes, attention_mask, cache):
    return model.prefill(input_ids, audio_codes, attention_mask, cache)


_COMPILED_PREFILL: dict[tuple, object] = {}


def compiled_prefill(config: CompileConfig):
    """`model.prefill` compiled with `config` (built once per set of options; torch compiles one
    graph per length bucket, batch size and capacity class: where `config` leaves dynamic shapes
    to torch, the prefill's stay fixed). On CUDA its routed experts take
    `capturable_experts`' batched matmuls where the grouped GEMM would read its offsets on the
    host (not on the CPU: there a prefill's gathered expert weights would cost memory, and no
    CUDA graph needs it)."""
    options = compile_options(config)
    if options["dynamic"] is None:
        options["dynamic"] = False  # a bucket is a graph of its own shapes, as the buckets intend
    key = tuple(sorted((name, repr(value)) for name, value in options.items()))
    if key not in _COMPILED_PREFILL:
        keep_recording_new_static_inputs()  # each run's cache is new: its static addresses change
        compiled = torch.compile(_prefill_rows, **with_cpu_codegen_fixes(options))
        _COMPILED_PREFILL[key] = _with_capturable_experts(compiled, cuda_only=True)
    return _COMPILED_PREFILL[key]


class StepFunctions(NamedTuple):
    """The decode step's functions as a run calls them (see `decoding.step`)."""

    draw: Callable
    feed: Callable
    step: Callable
    """`draw` and `feed` in one function."""


def compiled_functions(config: CompileConfig | None) -> StepFunctions:
    """`draw`, `feed` and `step`, compiled with `config` (None: as they are), built once per set of
    options; torch recompiles them for a new model, batch size or capacity class."""
    plain = StepFunctions(decode_step.draw, decode_step.feed, decode_step.step)
    if config is None:
        return plain
    options = compile_options(config)
    key = tuple(sorted((name, repr(value)) for name, value in options.items()))
    if key not in _COMPILED:
        keep_recording_new_static_inputs()  # each run's cache is new: its static addresses change
        _COMPILED[key] = StepFunctions(*(_with_capturable_experts(torch.compile(function, **with_cpu_codegen_fixes(options)))
                                         for function in plain))
    return _COMPILED[key]
