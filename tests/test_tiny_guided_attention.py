"""The guided-attention lever of drama3-tiny's recipe (`recipes.drama3_tiny.guided_attention`)."""

import pytest
import torch

from recipes.drama3_tiny.guided_attention import (
    SPAN_KEY, GuidedAttention, SpeakSpanCollator, diagonal_penalty, guided_attention_loss,
)
from tiny_recipe_helpers import held_out_setup


def one_hot_attention(frames: int, rows: int, start: int, columns) -> torch.Tensor:
    weights = torch.zeros(1, 1, rows, rows)
    for t, column in enumerate(columns):
        weights[0, 0, rows - frames + t, start + column] = 1.0
    return weights


def test_the_penalty_is_zero_on_the_diagonal_and_near_one_far_from_it():
    penalty = diagonal_penalty(20, 10)
    assert penalty.shape == (20, 10)
    assert penalty[0, 0] < 0.01 and penalty[19, 9] < 0.01 and penalty[10, 5] < 0.01
    assert penalty[0, 9] > 0.99 and penalty[19, 0] > 0.99
    assert bool((penalty >= 0).all() and (penalty <= 1).all())


def test_diagonal_attention_scores_low_reversed_high_and_only_the_text_counts():
    frames, text, start, rows = 20, 10, 3, 40
    frame_rows = torch.zeros(1, rows, dtype=torch.bool)
    frame_rows[0, rows - frames:] = True
    spans = torch.tensor([[start, start + text]])
    diagonal = [t * text // frames for t in range(frames)]
    along = guided_attention_loss(one_hot_attention(frames, rows, start, diagonal), frame_rows, spans)
    against = guided_attention_loss(one_hot_attention(frames, rows, start, diagonal[::-1]), frame_rows, spans)
    uniform = torch.zeros(1, 1, rows, rows)
    uniform[0, 0, :, start : start + text] = 1.0 / text
    spread = guided_attention_loss(uniform, frame_rows, spans)
    assert along < 0.05 < spread < against and against > 0.6
    # attention outside the text (the reference, the prompt) is renormalised away
    elsewhere = one_hot_attention(frames, rows, start, diagonal) * 0.3
    elsewhere[0, 0, rows - frames:, 0] = 0.7
    assert guided_attention_loss(elsewhere, frame_rows, spans) == pytest.approx(along.item(), abs=1e-6)
    # an item without text or frames adds nothing
    assert guided_attention_loss(uniform, frame_rows, torch.tensor([[5, 5]])) == 0.0


def test_the_guide_reads_both_attention_layers_and_pulls_them_to_the_diagonal(tmp_path):
    from transformers_drama3.training.collators import ReferencePool

    dataset, model, processor, _ = held_out_setup(tmp_path, heldout_sentences=3)
    with pytest.raises(ValueError, match="eager"):
        GuidedAttention(model)
    model.set_attn_implementation("eager")
    model.train()
    guide = GuidedAttention(model, weight=1.0)
    collator = SpeakSpanCollator(processor, ReferencePool(dataset, 70), max_references=1, seed=0)
    examples = [{**dataset[i], "index": i} for i in range(4)]
    batch = collator(examples)
    assert batch[SPAN_KEY].tolist() == [list(collator.example_rows(e, p)[0].speak_span) for p, e in enumerate(examples)]
    inputs = {k: v for k, v in batch.items() if k != SPAN_KEY}
    optimiser = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(15):
        model(**inputs)
        assert len(guide.captured) == 2 and guide.captured[0].shape[-1] == batch["input_ids"].shape[1]
        loss = guide.loss(batch, model.is_semantic)
        assert not guide.captured  # the next forward starts afresh
        optimiser.zero_grad()
        loss.backward()
        losses.append(loss.item())
        assert model.backbone.layers[1].self_attn.q_proj.weight.grad.abs().sum() > 0
        optimiser.step()
    assert losses[-1] < 0.8 * losses[0]
    guide.remove()
    model(**inputs)
    assert not guide.captured
