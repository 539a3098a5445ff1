"""GenerationMixin's outputs of a decode run, gathered around the decode step without changing it.

- `RowCollector`: the rows a run drew, one per step (`sequences` = the prompt rows, then these);
- `RecordingSampler`: the sampler, keeping the logits each draw was given (`scores`, `logits`,
  `codebook_scores`, `codebook_logits`). It keeps them where the sampler keeps its RAS window: set
  inside the draw (eagerly, or inside a compiled step's graph) and copied out after it, so a compiled
  run records what an eager one does;
- `backbone_states`: the backbone's hidden states of every call (the prefill, then one per step),
  through transformers' own `output_hidden_states` capture (eager runs only).
"""

from __future__ import annotations

import contextlib
import threading

import torch

from ..decoding.loop import FrameStep
from ..decoding.sampler import MIN_TEMPERATURE, Drama3Sampler, SamplingSettings, distribution


class RowCollector:
    """The row each item drew at each step: `[main_id, c0..c9]` of a frame, `[<|audio_separator|>
    or eos, zeros]`, and `[pad_id, zeros]` once the item has ended (set in `finish`: a step costs
    one copy on the host)."""

    def __init__(self, batch: int, pad_id: int):
        self.batch, self.pad_id = batch, pad_id
        self.rows: list[torch.Tensor] = []
        self.ended: list[torch.Tensor] = []

    def add(self, step: FrameStep) -> None:
        self.rows.append(torch.cat((step.main_ids[:, None], step.frames), dim=1))  # [batch, 1 + num_codebooks]
        self.ended.append(step.ended)

    def finish(self, num_codebooks: int) -> torch.Tensor:
        """[batch, steps, 1 + num_codebooks] (host)."""
        if not self.rows:
            return torch.zeros(self.batch, 0, 1 + num_codebooks, dtype=torch.long)
        rows = torch.stack(self.rows, dim=1)
        ended = torch.stack(self.ended, dim=1).long()
        after_end = (ended.cumsum(dim=1) - ended) > 0  # [batch, steps]: the item ended at an earlier step
        rows[after_end] = 0
        rows[..., 0][after_end] = self.pad_id
        return rows


class RecordingSampler(Drama3Sampler):
    """`Drama3Sampler` that keeps, per step, the restricted main logits it drew from
    (`main_logits`: [batch, candidates]) and each tower head's logits (`head_logits`:
    [batch, num_codebooks - 1, codebook_size]), float32, in draw order (steps made past the end of
    a run included: the caller keeps the first `steps`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.main_logits: list[torch.Tensor] = []
        self.head_logits: list[torch.Tensor] = []
        self._main = self._step_logits = None
        self._heads: tuple[torch.Tensor, ...] = ()

    def main_token(self, logits: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
        self._main, self._heads = logits[:, -1].float(), ()
        return super().main_token(logits, active)

    def codebook(self, logits: torch.Tensor, codebook_index: int) -> torch.Tensor:
        self._heads = self._heads + (logits[:, -1].float(),)  # a new tuple: a compiled step's input stays unmutated
        return super().codebook(logits, codebook_index)

    def advance(self) -> None:
        """The step's draws are done (the last call of a draw): its logits are kept; a compiled
        draw's are copied out of the graph's memory by `owned`, which the run calls after it."""
        super().advance()
        self._step_logits = (self._main, torch.stack(self._heads, dim=1))
        if not torch.compiler.is_compiling():
            self._keep()

    def owned(self) -> None:
        super().owned()
        self._keep()

    def _keep(self) -> None:
        main, heads = self._step_logits
        self.main_logits.append(main.clone())
        self.head_logits.append(heads.clone())


def warped(logits: torch.Tensor, settings: SamplingSettings, top_k: int | None, keep_crossing: bool) -> torch.Tensor:
    """Logits [..., V] -> the scores a draw samples from: divided by the temperature, -inf where
    the settings' filters drop a candidate (`decoding.sampler.distribution`, the sampler's own
    distribution); the logits as they are for greedy draws (argmax reads them so)."""
    if not settings.do_sample:
        return logits
    kept = distribution(logits, settings, top_k, keep_crossing) > 0
    scaled = logits / max(settings.temperature, MIN_TEMPERATURE)
    return scaled.masked_fill(~kept, float("-inf"))


def in_vocabulary(values: torch.Tensor, candidate_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """values [steps, batch, candidates] -> [steps, batch, vocab_size], -inf at every other id."""
    full = values.new_full((*values.shape[:-1], vocab_size), float("-inf"))
    return full.scatter(-1, candidate_ids.to(values.device).expand_as(values), values)


@contextlib.contextmanager
def backbone_states(backbone: torch.nn.Module, enabled: bool):
    """Inside: every call of `backbone` (a transformers text model) from this thread asks it for its
    hidden states (`output_hidden_states=True`, which transformers captures as that model defines
    them) and the yielded list receives them, one tuple per call. Other threads' calls are left
    as they are."""
    calls: list[tuple[torch.Tensor, ...]] = []
    if not enabled:
        yield calls
        return
    thread = threading.get_ident()

    def ask(module, args, kwargs):
        if threading.get_ident() == thread:
            return args, {**kwargs, "output_hidden_states": True}
        return None

    def keep(module, args, output):
        if threading.get_ident() == thread:
            calls.append(tuple(output.hidden_states))

    handles = [backbone.register_forward_pre_hook(ask, with_kwargs=True), backbone.register_forward_hook(keep)]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()
