"""The text-use probe of drama3-tiny checkpoints (`recipes.drama3_tiny.text_use`)."""

import json
import math

import pytest
import torch

from recipes.drama3_tiny.text_use import mismatched_partners, round_robin, run_checkpoints
from tiny_recipe_helpers import held_out_setup


def test_each_item_gets_another_text_of_its_own_speaker_next_in_length():
    frames = [10, 50, 20, 30, 40, 60]
    speakers = ["A", "A", "A", "B", "B", "C"]
    partners = mismatched_partners(frames, speakers)
    assert partners == [2, 0, 1, 4, 3, 5]  # A by length: 0 (10) -> 2 (20) -> 1 (50) -> back to 0
    assert all(speakers[p] == speakers[i] for i, p in enumerate(partners))
    assert all(p != i for i, p in enumerate(partners) if speakers.count(speakers[i]) > 1)


def test_a_sample_takes_every_speaker_in_turn():
    speakers = ["A"] * 5 + ["B"] * 5 + ["C"] * 2
    assert round_robin(speakers, 6) == [0, 1, 5, 6, 10, 11]
    assert round_robin(speakers, 100) == list(range(12))


def test_run_checkpoints_lists_complete_ones_by_step(tmp_path):
    for step, complete in ((100, True), (150, True), (200, False), (1000, True)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        if complete:
            (folder / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-x").mkdir()
    assert [step for step, _ in run_checkpoints(tmp_path)] == [100, 150, 1000]
    assert [step for step, _ in run_checkpoints(tmp_path, every=100)] == [100, 1000]


@pytest.mark.slow
def test_the_probe_scores_own_and_mismatched_texts_on_the_same_audio(tmp_path):
    from recipes.drama3_tiny.text_use import text_use
    from transformers_drama3.training import CloningCollator
    from transformers_drama3.training.collators import ReferencePool

    dataset, model, processor, _ = held_out_setup(tmp_path, heldout_sentences=4)
    assert sorted(set(dataset["speaker"])) == ["A", "B"] and len(dataset) == 8

    result = text_use(model, processor, dataset, batch_size=len(dataset))
    assert result["utterances"] == 8
    assert result["gap"] == pytest.approx(result["semantic_other"] - result["semantic_true"])
    # the own-text loss is the model's loss on the cloning rows of the true texts (one batch)
    collator = CloningCollator(processor, ReferencePool(dataset, 70), max_references=1, seed=0)
    items = [dataset[i] for i in round_robin(dataset["speaker"], 8)]
    with torch.no_grad():
        own = model(**collator(items))
    assert result["semantic_true"] == pytest.approx(own.semantic_loss.item(), rel=1e-5)
    # another utterance's text changes the rows and so the loss; the audio stays the same
    assert result["semantic_other"] != pytest.approx(result["semantic_true"], rel=1e-6)
    assert result["codebook_true"] == pytest.approx(own.codebook_loss.item(), rel=1e-5)
    # a backbone-only checkpoint (codebook loss weight 0) is probed without its tower
    model.config.codebook_loss_weight = 0.0
    backbone_only = text_use(model, processor, dataset, batch_size=len(dataset))
    model.config.codebook_loss_weight = 0.5
    assert math.isnan(backbone_only["codebook_true"])
    assert backbone_only["semantic_true"] == pytest.approx(result["semantic_true"], rel=1e-5)
    # attention weights need the eager implementation, and the refusal says so
    from recipes.drama3_tiny.text_use import diagonality

    model.set_attn_implementation("sdpa")  # returns no attention weights
    with pytest.raises(ValueError, match="eager"):
        diagonality(model, processor, dataset, limit=2)
    model.set_attn_implementation("eager")
    score = diagonality(model, processor, dataset, limit=4)
    assert -1.0 <= score <= 1.0
    json.dumps(result)  # a jsonl line


def test_a_diagonal_attention_map_scores_one_and_a_still_one_zero():
    from recipes.drama3_tiny.text_use import monotonic_correlation

    assert monotonic_correlation(torch.eye(6)) == pytest.approx(1.0)
    assert monotonic_correlation(torch.eye(6).flip(0)) == pytest.approx(-1.0)
    still = torch.zeros(5, 4)
    still[:, 2] = 1.0
    assert monotonic_correlation(still) == 0.0
    two_frames_a_symbol = torch.eye(4).repeat_interleave(2, dim=0)  # [8 frames, 4 symbols]
    assert monotonic_correlation(two_frames_a_symbol) > 0.95


def test_following_a_run_skips_a_checkpoint_the_run_rotated_away(tmp_path, monkeypatch, capsys):
    """A run in training keeps its last checkpoints only: one listed and then removed before the
    probe reached it is skipped with a note, the others are scored."""
    from recipes.drama3_tiny import text_use

    _, model, processor, codec = held_out_setup(tmp_path, heldout_sentences=2)
    run = tmp_path / "run"
    processor.tokenizer.save_pretrained(run / "tokenizer")
    codec.save_pretrained(run / "model" / "codec")
    model.save_pretrained(run / "checkpoint-2")
    (run / "checkpoint-2" / "trainer_state.json").write_text("{}")
    listed = [(1, run / "checkpoint-1"), (2, run / "checkpoint-2")]  # checkpoint-1: gone since it was listed
    monkeypatch.setattr(text_use, "run_checkpoints", lambda folder, every: listed)
    text_use.main(["--corpus", str(tmp_path / "corpus"), "--run", str(run), "--json", str(tmp_path / "use.jsonl")])
    rows = [json.loads(line) for line in (tmp_path / "use.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [2]
    assert "checkpoint-1: removed by the training run" in capsys.readouterr().out
