"""Drama3Processor without a codec: which rows are supervised (labels), and how requests batch."""

import torch

from processor_helpers import random_codes, tiny_processor, tiny_tokenizer, token_id
from transformers_drama3.prompting import (
    IGNORE_INDEX,
    Infill,
    LineByLineScript,
    Reference,
    Script,
    StreamingScript,
    Take,
)


def supervised_ids(batch, index=0):
    labels = batch["labels"][index]
    return labels[labels != IGNORE_INDEX].tolist()


def semantic_ids(codes):
    return (codes[0] + token_id("<|semantic:0|>")).tolist()


# ---- labels --------------------------------------------------------------------------------------------


def test_labels_are_aligned_with_the_rows_and_cover_only_the_target_turn():
    processor = tiny_processor()
    ref, take, target = random_codes(3, seed=1), random_codes(4, seed=2), random_codes(5, seed=3)
    batch = processor(
        Script("Again.", references=[Reference("r", ref)], history=[Take("Again.", take)], target=target)
    )
    labels, input_ids = batch["labels"][0], batch["input_ids"][0]
    kept = labels != IGNORE_INDEX
    assert torch.equal(labels[kept], input_ids[kept])  # aligned: the model shifts
    assert supervised_ids(batch) == semantic_ids(target) + [token_id("<|im_end|>")]


def test_references_history_voice_and_padding_are_never_supervised():
    processor = tiny_processor()
    ref, take, target = random_codes(3, seed=1), random_codes(4, seed=2), random_codes(2, seed=3)
    long = Script("A much longer text to force padding on the other item.", target=target)
    short = Script("x", references=[Reference("r", ref)], history=[Take("x", take)], target=target)
    batch = processor([long, short])
    for index in range(2):
        labels = batch["labels"][index]
        assert token_id("<|voice|>") not in labels.tolist()
        assert (labels[batch["attention_mask"][index] == 0] == IGNORE_INDEX).all()
    assert supervised_ids(batch, 1) == semantic_ids(target) + [token_id("<|im_end|>")]


def test_line_by_line_labels_include_the_learned_separators():
    processor = tiny_processor()
    a, b = random_codes(2, seed=1), random_codes(3, seed=2)
    batch = processor(LineByLineScript(["One.", "Two."], target=[a, b]))
    separator, end = token_id("<|audio_separator|>"), token_id("<|im_end|>")
    assert supervised_ids(batch) == semantic_ids(a) + [separator] + semantic_ids(b) + [end]


def test_infill_labels_cover_only_the_middle():
    processor = tiny_processor()
    prefix, suffix, middle = random_codes(2, seed=1), random_codes(3, seed=2), random_codes(4, seed=3)
    batch = processor(Infill("x", prefix=prefix, suffix=suffix, target=middle))
    assert supervised_ids(batch) == semantic_ids(middle) + [token_id("<|im_end|>")]


def test_streaming_labels_cover_every_spoken_turn():
    processor = tiny_processor()
    first, second = random_codes(2, seed=1), random_codes(3, seed=2)
    batch = processor(StreamingScript(["One.", "Two."], spoken=[first, second]))
    end = token_id("<|im_end|>")
    assert supervised_ids(batch) == semantic_ids(first) + [end] + semantic_ids(second) + [end]


def test_prompts_without_targets_have_no_labels_unless_asked():
    processor = tiny_processor()
    assert "labels" not in processor("Hello.")
    labels = processor("Hello.", return_labels=True)["labels"]
    assert (labels == IGNORE_INDEX).all()


# ---- batching --------------------------------------------------------------------------------------------


def test_a_batch_is_left_padded_and_equals_its_items():
    processor = tiny_processor()
    ref = random_codes(4, seed=1)
    items = ["Short.", Script("A rather longer line than the other one.", references=[Reference("r", ref)])]
    batch = processor(items)
    assert batch["input_ids"].dtype == torch.long and batch["audio_codes"].dtype == torch.long
    assert batch["audio_codes"].shape == (*batch["input_ids"].shape, 10)
    for index, item in enumerate(items):
        single = processor(item)
        rows = single["input_ids"].shape[1]
        assert torch.equal(batch["input_ids"][index, -rows:], single["input_ids"][0])
        assert torch.equal(batch["audio_codes"][index, -rows:], single["audio_codes"][0])
        mask = batch["attention_mask"][index]
        assert mask[-rows:].all() and not mask[:-rows].any()
        assert (batch["input_ids"][index, :-rows] == tiny_tokenizer().pad_token_id).all()
        assert not batch["audio_codes"][index, :-rows].any()


def test_right_padding_on_request():
    processor = tiny_processor()
    batch = processor(["Short.", "A rather longer line than the other."], padding_side="right")
    assert batch["attention_mask"][0, 0] == 1 and batch["attention_mask"][0, -1] == 0


def test_references_beside_raw_text_apply_to_every_item():
    processor = tiny_processor()
    ref = random_codes(3, seed=1)
    batch = processor(["One.", "Two."], reference_audio=[ref], reference_text=["r"])
    for index in range(2):
        assert (batch["audio_codes"][index].any(dim=1)).sum() == 3
