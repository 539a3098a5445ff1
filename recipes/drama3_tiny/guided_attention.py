"""A guided-attention loss for drama3-tiny: one lever for a small model that does not read its text.

The text-use probe (`text_use`) shows tiny runs whose outputs ignore the text for thousands of
steps: the backbone predicts speech from the speech so far. A guided-attention term (Tachibana
et al., DC-TTS) asks the backbone's attention layers to look, from each target frame, at the
part of the text that frame speaks as a straight diagonal would place it, so the alignment
exists early and the semantic loss can use it. Each head's attention over the text of the turn
to speak (the rows' `speak_span`, renormalised within it) is weighed by

    W[t, n] = 1 - exp(-(n / N - t / T) ** 2 / (2 g ** 2))

(`t` of `T` target frames, `n` of `N` text rows, `g` the width of the band), and the loss is the
mean of attention x W over the target frames: 0 for attention on the diagonal band, up to ~1 far
from it. It is a training loss only: the model and its layout stay the published ones (the
attention layers need `attn_implementation="eager"` while training with it, the forward hooks
read their weights).

    model.set_attn_implementation("eager")
    trainer = guided_trainer_class(Drama3Trainer)(model=model, data_collator=SpeakSpanCollator(...), ...,
                                                  guide=GuidedAttention(model, weight=1.0))

(`python -m recipes.drama3_tiny.lm_training ... --guided-attention 1.0`)

The second guide, for a phonetic codec (`--guided-attention-target aligned`), replaces the
straight diagonal by the true alignment read off the target's codes (`code_alignment`): in each
attention layer head 0 is asked to look at the phoneme the frame is speaking and head 1 at the
phoneme after it (cross entropy of the head's attention at that row); the other heads are free.
"""

from __future__ import annotations

import torch

from transformers_drama3.training import CloningCollator

SPAN_KEY = "speak_spans"
ALIGNED_KEY = "aligned_rows"


def diagonal_penalty(frames: int, text: int, width: float = 0.2) -> torch.Tensor:
    """W [frames, text]: 0 on the diagonal from the first text row (first frame) to the last (last
    frame), rising to 1 away from it with `width` (a fraction of the text and of the frames)."""
    t = (torch.arange(frames, dtype=torch.float32) + 0.5) / frames
    n = (torch.arange(text, dtype=torch.float32) + 0.5) / text
    return 1.0 - torch.exp(-((n[None, :] - t[:, None]) ** 2) / (2 * width**2))


def guided_attention_loss(weights: torch.Tensor, frames: torch.Tensor, spans: torch.Tensor, width: float = 0.2) -> torch.Tensor:
    """The mean over the batch of each item's mean attention x `diagonal_penalty`.

    weights: [batch, heads, rows, rows] attention of one layer; frames: [batch, rows] bool, the
    target's frames (the rows whose attention is guided); spans: [batch, 2] (start, stop) of the
    text those frames speak. Items without frames or text add nothing."""
    losses = []
    for item in range(weights.shape[0]):
        start, stop = (int(v) for v in spans[item])
        rows = frames[item].nonzero().flatten()
        if stop <= start or rows.numel() == 0:
            continue
        attention = weights[item][:, rows, start:stop]  # [heads, frames, text]
        attention = attention / attention.sum(-1, keepdim=True).clamp_min(1e-9)
        penalty = diagonal_penalty(rows.numel(), stop - start, width).to(attention)
        losses.append((attention * penalty).sum(-1).mean())
    if not losses:
        return weights.sum() * 0.0
    return torch.stack(losses).mean()


def aligned_attention_loss(weights: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy of attention heads at their target rows.

    weights: [batch, heads, rows, rows] attention of one layer; targets: [batch, guided heads,
    rows] the row each guided head (heads 0, 1, ...) of each query row should look at, -1 for a
    query row that is not guided. The mean of -log(weight at the target) over the guided query
    rows of every guided head."""
    heads = targets.shape[1]
    guided = targets >= 0
    if not guided.any():
        return weights.sum() * 0.0
    picked = weights[:, :heads].gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)  # [batch, heads, rows]
    return -torch.log(picked[guided].clamp_min(1e-6)).mean()


def attention_accuracy(weights: torch.Tensor, targets: torch.Tensor) -> float:
    """The share of guided query rows whose head puts its largest weight on the target row."""
    heads = targets.shape[1]
    guided = targets >= 0
    if not guided.any():
        return float("nan")
    return float((weights[:, :heads].argmax(-1) == targets)[guided].float().mean())


class GuidedAttention:
    """Forward hooks on the backbone's attention layers that keep their attention weights of the
    last forward, and the loss over them (`loss(batch)`).

    Args:
        model: a `Drama3ForSpeechGeneration` loaded or built with `attn_implementation="eager"`.
        weight: the weight of the term in the training loss.
        width: the band's width `g` (a fraction of the text and of the target).
    """

    def __init__(self, model, weight: float = 1.0, width: float = 0.2):
        self.weight, self.width = weight, width
        self.last_accuracy = float("nan")
        self.captured: list[torch.Tensor] = []
        layers = [layer.self_attn for layer in model.backbone.layers if hasattr(layer, "self_attn")]
        if not layers:
            raise ValueError("GuidedAttention: the backbone has no attention layers")
        if model.backbone.config._attn_implementation != "eager":
            raise ValueError("GuidedAttention needs the attention weights: build the model with attn_implementation='eager'")
        self.handles = [layer.register_forward_hook(self._keep) for layer in layers]

    def _keep(self, module, inputs, output):
        if isinstance(output, tuple) and len(output) > 1 and output[1] is not None:
            self.captured.append(output[1])

    def loss(self, inputs: dict, is_semantic) -> torch.Tensor:
        """The weighted loss of the attention captured by the forward of `inputs` (its labels mark
        the target's frames, its `speak_spans` the text), then forget the captured weights."""
        captured, self.captured = self.captured, []
        if not captured:
            raise ValueError("GuidedAttention: no attention weights were captured by the forward")
        aligned = inputs.get(ALIGNED_KEY)
        if aligned is not None:
            self.last_accuracy = sum(attention_accuracy(w.detach(), aligned) for w in captured) / len(captured)
            return self.weight * torch.stack([aligned_attention_loss(w, aligned) for w in captured]).mean()
        frames = is_semantic(inputs["input_ids"]) & (inputs["labels"] != -100)
        spans = inputs[SPAN_KEY]
        return self.weight * torch.stack([guided_attention_loss(w, frames, spans, self.width) for w in captured]).mean()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class SpeakSpanCollator(CloningCollator):
    """`CloningCollator` whose batches also carry `speak_spans` [batch, 2]: the rows of the text of
    the turn each item speaks (what `GuidedAttention` guides the target's frames to).

    With `phoneme_rows` (a `code_alignment.PhonemeRows`: a phonetic codec's labels and a phoneme
    tokenizer) they also carry `aligned_rows` [batch, 2, rows]: for each of the target's frame
    rows the row of the phoneme it speaks and of the phoneme after it (`code_alignment.
    frame_targets`), -1 elsewhere."""

    def __init__(self, *args, phoneme_rows=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.phoneme_rows = phoneme_rows

    def __call__(self, examples):
        self._spans, self._aligned = [], []
        batch = super().__call__(examples)
        batch[SPAN_KEY] = torch.tensor(self._spans, dtype=torch.long)
        if self.phoneme_rows is not None:
            aligned = torch.full((len(self._aligned), 2, batch["input_ids"].shape[1]), -1, dtype=torch.long)
            for item, targets in enumerate(self._aligned):
                aligned[item, :, : targets.shape[1]] = targets
            batch[ALIGNED_KEY] = aligned
        return batch

    def example_rows(self, example, position=0):
        rows, weights = super().example_rows(example, position)
        self._spans.append(rows.speak_span)
        if self.phoneme_rows is not None:
            self._aligned.append(self.aligned_rows(rows))
        return rows, weights

    def aligned_rows(self, rows) -> torch.Tensor:
        """[2, rows]: the current and next phoneme rows of each target frame row, -1 elsewhere."""
        from .code_alignment import frame_targets

        ids = self.processor.token_ids
        semantic = (rows.input_ids >= ids.semantic_start) & (rows.input_ids < ids.semantic_start + ids.codebook_size)
        frames = (semantic & rows.supervised).nonzero().flatten()
        targets = torch.full((2, len(rows)), -1, dtype=torch.long)
        start, stop = rows.speak_span
        if frames.numel() == 0 or stop <= start:
            return targets
        current, following = frame_targets(rows.audio_codes[frames].numpy(), rows.input_ids[start:stop].tolist(),
                                           self.phoneme_rows)
        targets[0, frames] = torch.from_numpy(current) + start
        targets[1, frames] = torch.from_numpy(following) + start
        return targets


def guided_trainer_class(base):
    """`base` (a `Drama3Trainer` class) whose training loss adds `guide.loss` when a `guide` is given."""
    from transformers_drama3.training.trainer import drama3_loss

    class _Guided(base):
        def __init__(self, *args, guide: GuidedAttention | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            self.guide = guide

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs = dict(inputs)
            spans = inputs.pop(SPAN_KEY, None)
            aligned = inputs.pop(ALIGNED_KEY, None)
            loss, output = drama3_loss(model, inputs, self.pad_id)
            if self.guide is not None and model.training:
                unwrapped = self.accelerator.unwrap_model(model)
                guided = {**inputs, SPAN_KEY: spans} if aligned is None else {**inputs, SPAN_KEY: spans, ALIGNED_KEY: aligned}
                guide_loss = self.guide.loss(guided, unwrapped.is_semantic)
                self._guide_log = (float(guide_loss), self.guide.last_accuracy)
                loss = loss + guide_loss
            elif self.guide is not None:
                self.guide.captured = []
            return (loss, output) if return_outputs else loss

        def log(self, logs, *args, **kwargs):
            last = getattr(self, "_guide_log", None)
            if last is not None and "loss" in logs:  # the last step's guide term, and how often heads hit their row
                logs = {**logs, "guide_loss": round(last[0], 4), "guide_accuracy": round(last[1], 4)}
            return super().log(logs, *args, **kwargs)

    return _Guided
