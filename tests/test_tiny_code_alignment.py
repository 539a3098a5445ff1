"""The alignment of a phonetic codec's frames to the phoneme tokens they speak
(`recipes.drama3_tiny.code_alignment`) and the guide that pulls attention heads onto it."""

import numpy as np
import pytest
import torch

from recipes.drama3_tiny.code_alignment import PhonemeRows, align_codes_to_text, frame_targets
from recipes.drama3_tiny.guided_attention import (
    ALIGNED_KEY, SPAN_KEY, GuidedAttention, SpeakSpanCollator, aligned_attention_loss, attention_accuracy,
)

# rows: a stress mark, "h", "ə", a word boundary, "l", "oʊ", "." ; codes 1..4 speak the phonemes
ROWS = [None, {1}, {2}, None, {3}, {4}, None]


def test_sub_frames_follow_their_phonemes_and_silence_sits_between_words():
    labels = [0, 0, 1, 1, 2, 2, 2, 0, 3, 4, 4, 4, 0, 0]
    assert align_codes_to_text(labels, ROWS).tolist() == [0, 0, 1, 1, 2, 2, 2, 3, 4, 5, 5, 5, 6, 6]


def test_a_wrong_label_costs_less_than_leaving_the_path_and_rows_never_go_back():
    labels = [1, 1, 9, 2, 2, 3, 3, 4]  # 9 speaks no row: the recogniser's error
    path = align_codes_to_text(labels, ROWS)
    assert path.tolist() == [1, 1, 2, 2, 2, 4, 4, 5]
    repeated = [1, 2, 3, 4, 1, 2]  # a phoneme said again later cannot pull the path back
    assert bool(np.all(np.diff(align_codes_to_text(repeated, ROWS)) >= 0))


def test_a_phoneme_too_short_for_any_frame_is_skipped():
    path = align_codes_to_text([1, 1, 1, 3, 3, 4, 4], ROWS)
    assert path[0] == 1 and path[3] == 4 and path[-1] == 5


def phoneme_setup(tmp_path):
    from transformers_drama3.processing_drama3 import Drama3Processor
    from transformers_drama3.prompting.phonemes import phoneme_symbol
    from recipes.drama3_tiny.lm_recipe import build_tiny_tokenizer

    texts = ["Put the keys on the table.", "Please close the door.", "Hello there, how are you?"]
    tokenizer = build_tiny_tokenizer(texts, 64, tmp_path / "tokenizer", text_frontend="phonemes")
    symbols = sorted({s for token in tokenizer.get_vocab() if (s := phoneme_symbol(token)) not in (None, " ")})
    phonemes = ["_", *[s for s in symbols if s not in "ˈˌ" and s not in ".,;:!?¡¿…"]]
    processor = Drama3Processor(tokenizer, codebook_size=64, num_codebooks=5, frame_rate=21.5)
    return tokenizer, processor, phonemes


def spoken_codes(token_ids, tokenizer, phonemes, seed=0):
    """Codes a phonetic codec would write for the text rows `token_ids`: each phoneme row 1-6
    spectrogram frames, 2 frames of silence at each word boundary; and the true row of every
    spectrogram frame (-1 for silence)."""
    from transformers_drama3.prompting.phonemes import phoneme_symbol

    rng = np.random.default_rng(seed)
    labels, truth = [0, 0], [-1, -1]
    for row, token in enumerate(tokenizer.convert_ids_to_tokens(token_ids)):
        symbol = phoneme_symbol(token)
        if symbol in phonemes:
            count = int(rng.integers(1, 7))
            labels += [phonemes.index(symbol)] * count
            truth += [row] * count
        elif symbol == " ":
            labels, truth = labels + [0, 0], truth + [-1, -1]
    pad = -len(labels) % 4
    labels, truth = np.array(labels + [0] * pad).reshape(-1, 4), np.array(truth + [-1] * pad).reshape(-1, 4)
    codes = np.zeros((len(labels), 5), dtype=np.int64)
    codes[:, 0], codes[:, 2:] = labels[:, 0], labels[:, 1:]
    codes[:, 1] = 3  # the voice
    return codes, truth


def speak_span_ids(processor, text):
    """The text rows the processor writes for `text` as the turn to speak (phoneme tokens)."""
    from transformers_drama3.prompting import Script

    rows = processor.rows(Script(lines=text, target=torch.zeros(5, 2, dtype=torch.long)))
    start, stop = rows.speak_span
    return rows.input_ids[start:stop].tolist()


def test_frame_targets_recover_the_true_rows_of_spoken_codes(tmp_path):
    tokenizer, processor, phonemes = phoneme_setup(tmp_path)
    ids = speak_span_ids(processor, "Put the keys on the table.")
    rows = PhonemeRows(tokenizer, phonemes)
    phoneme_rows = [row for row, codes in enumerate(rows.row_codes(ids)) if codes is not None]
    assert len(phoneme_rows) >= 12
    for seed in range(3):
        codes, truth = spoken_codes(ids, tokenizer, phonemes, seed)
        current, following = frame_targets(codes, ids, rows)
        spoken = truth[:, -1] >= 0
        assert current[spoken].tolist() == truth[spoken, -1].tolist()
        assert bool(np.all(np.diff(current) >= 0))
        for row, after in zip(current[spoken], following[spoken]):
            later = [r for r in phoneme_rows if r > row]
            assert after == (later[0] if later else phoneme_rows[-1])


def test_the_aligned_loss_and_accuracy_score_the_target_rows_only():
    weights = torch.full((1, 4, 6, 6), 1 / 6)
    weights[0, 0, 4] = torch.tensor([0.0, 0.0, 0.9, 0.1, 0.0, 0.0])
    targets = torch.full((1, 2, 6), -1)
    targets[0, 0, 4], targets[0, 1, 4] = 2, 3
    loss = aligned_attention_loss(weights, targets)
    assert loss.item() == pytest.approx(-(np.log(0.9) + np.log(1 / 6)) / 2, rel=1e-6)
    assert attention_accuracy(weights, targets) == 0.5  # head 0 peaks on its row; head 1 is flat
    assert aligned_attention_loss(weights, torch.full((1, 2, 6), -1)).item() == 0.0


def test_the_collator_carries_aligned_rows_and_the_guide_pulls_heads_onto_them(tmp_path):
    from datasets import Dataset

    from recipes.drama3_tiny.lm_recipe import tiny_model_config
    from transformers_drama3.modeling_drama3 import Drama3ForSpeechGeneration
    from transformers_drama3.training.collators import ReferencePool

    tokenizer, processor, phonemes = phoneme_setup(tmp_path)
    texts = ["Put the keys on the table.", "Please close the door.", "Hello there, how are you?", "Please close the door."]
    examples = []
    for index, text in enumerate(texts):
        ids = speak_span_ids(processor, text)
        codes, _ = spoken_codes(ids, tokenizer, phonemes, seed=index)
        examples.append({"text": text, "codes": codes.T.tolist(), "speaker": "A", "index": index})
    dataset = Dataset.from_list(examples)
    collator = SpeakSpanCollator(processor, ReferencePool(dataset, 30), max_references=1, seed=0,
                                 phoneme_rows=PhonemeRows(tokenizer, phonemes))
    batch = collator(examples)
    aligned = batch[ALIGNED_KEY]
    assert aligned.shape == (4, 2, batch["input_ids"].shape[1])
    for item, (start, stop) in enumerate(batch[SPAN_KEY].tolist()):
        guided = aligned[item, 0] >= 0
        frames = (batch["labels"][item] != -100) & (batch["input_ids"][item] >= processor.token_ids.semantic_start)
        assert guided.tolist() == frames.tolist()
        assert bool(((aligned[item][:, guided] >= start) & (aligned[item][:, guided] < stop)).all())

    torch.manual_seed(0)
    config = tiny_model_config(tokenizer, 5, 64, hidden_size=64)
    model = Drama3ForSpeechGeneration(config)
    model.set_attn_implementation("eager")
    model.train()
    guide = GuidedAttention(model, weight=1.0)
    inputs = {k: v[:2] for k, v in batch.items() if k not in (SPAN_KEY, ALIGNED_KEY)}
    aligned = aligned[:2]
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, accuracies = [], []
    for _ in range(12):
        model(**inputs)
        loss = guide.loss({**inputs, ALIGNED_KEY: aligned}, model.is_semantic)
        losses.append(loss.item())
        accuracies.append(guide.last_accuracy)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    assert losses[-1] < 0.5 * losses[0]
    assert accuracies[-1] > accuracies[0] + 0.2
    guide.remove()


def test_learned_pronunciations_find_the_codes_that_speak_a_token_and_drop_stray_ones(tmp_path):
    from recipes.drama3_tiny.code_alignment import alignment_config, learn_pronunciations, quiet_tokens
    from transformers_drama3.decoding.alignment import PhonemeAlignment

    tokenizer, processor, phonemes = phoneme_setup(tmp_path)
    rows = PhonemeRows(tokenizer, phonemes)
    t_code, d_code, k_code = phonemes.index("t"), phonemes.index("d"), phonemes.index("k")
    pairs = []
    for seed, text in enumerate(["Put the keys on the table.", "Please close the door."] * 20):
        ids = speak_span_ids(processor, text)
        codes, truth = spoken_codes(ids, tokenizer, phonemes, seed)
        labels = codes[:, [0, 2, 3, 4]].reshape(-1)
        if seed % 4 == 0:  # every "t" spoken as "d" (a flap), in half the utterances that have a "t"
            labels = np.where(labels == t_code, d_code, labels)
        if seed == 2:  # one stray "k" frame: under the share, not kept
            labels[np.flatnonzero(labels == t_code)[0]] = k_code
        pairs.append((ids, labels.tolist()))
    table = learn_pronunciations(pairs, rows, phonemes, min_frames=10)
    t_token = tokenizer.convert_tokens_to_ids("<|ph:t|>")
    assert table[t_token] == {t_code, d_code}
    assert table[tokenizer.convert_tokens_to_ids("<|ph:k|>")] == {k_code}
    entry = alignment_config(table, 5, rows.silence, quiet_tokens(rows))
    alignment = PhonemeAlignment.from_value(entry, 64, 5)
    assert alignment.codebooks == (0, 2, 3, 4) and alignment.tokens[t_token] == frozenset({t_code, d_code})
    ids = speak_span_ids(processor, "Put the keys on the table.")
    points = alignment.pause_points(ids)  # word boundaries are quiet: the text pauses only at its end
    assert len(points) == len(alignment.rows(ids)) and points[-1] and not any(points[:-1])
