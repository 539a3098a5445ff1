"""Fine-tuning on streaming rows with `Trainer`, then speaking text as it arrives with the model it
trained: the loss on those rows falls, and the incremental API on the trained model still equals
the rebuilt-prompt reference path, turn for turn."""

from __future__ import annotations

import datasets
import pytest
import torch
from transformers import Trainer, TrainingArguments

from training_helpers import processor, stack_model, voice_codes
from transformers_drama3.generation.live_text import ChunkSpoken
from transformers_drama3.prompting import IGNORE_INDEX, StreamingScript
from transformers_drama3.training import StreamingCollator

CHUNKS = ["The cat sat on a mat.", "Then it ran far away.", "It came home at last."]
FRAMES = 8


def streaming_example(index: int) -> dict:
    turns = [{"text": text, "codes": voice_codes(0, FRAMES, seed=10 * index + turn)} for turn, text in enumerate(CHUNKS)]
    return {"index": index, "turns": turns}


def test_streaming_rows_supervise_every_take_and_its_im_end():
    proc = processor()
    example = streaming_example(0)
    batch = StreamingCollator(proc)([example])
    labels, ids = batch["labels"][0], batch["input_ids"][0]
    supervised = labels != IGNORE_INDEX
    semantic = proc.token_ids.is_semantic(ids)
    assert int((supervised & semantic).sum()) == len(CHUNKS) * FRAMES  # every take's frames
    assert int((supervised & ~semantic).sum()) == len(CHUNKS)  # and the <|im_end|> closing each
    expected = proc(StreamingScript(CHUNKS, spoken=[torch.tensor(turn["codes"]) for turn in example["turns"]]))
    assert torch.equal(batch["input_ids"][0], expected["input_ids"][0])


@pytest.mark.slow
def test_a_model_trained_on_streaming_rows_speaks_text_as_it_arrives(tmp_path):
    model, proc = stack_model(), processor()
    examples = [streaming_example(index) for index in range(4)]
    collator = StreamingCollator(proc)
    batch = collator(examples)
    model.eval()
    with torch.no_grad():
        before = float(model(**batch).loss)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=40, learning_rate=3e-3,
        report_to=[], remove_unused_columns=False, use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
        lr_scheduler_type="constant", warmup_steps=0,
    )
    Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(examples), data_collator=collator).train()
    model.eval()
    with torch.no_grad():
        after = float(model(**batch).loss)
    assert after < before - 1.0

    text = " ".join(CHUNKS)
    spoken = [
        item for item in model.stream_text([word + " " for word in text.split()], processor=proc, do_sample=False, max_new_tokens=2 * FRAMES, max_bytes=24)
        if isinstance(item, ChunkSpoken)
    ]
    assert [event.text for event in spoken] == [f"<|speaker:0|> {chunk}" for chunk in CHUNKS]
    for turn, event in enumerate(spoken):
        script = StreamingScript(CHUNKS[: turn + 2], spoken=[e.take.T for e in spoken[:turn]])
        out = model.generate(**proc(script, return_labels=False), do_sample=False, max_new_tokens=2 * FRAMES,
                             return_dict_in_generate=True)
        assert torch.equal(event.take, out.audio_codes[0, : int(out.lengths[0])])
    # what it learnt: each chunk's take lasts the trained 8 frames, ends with eos, in voice 0's codes
    assert [(event.finish_reason, event.frames) for event in spoken] == [("eos", FRAMES)] * len(CHUNKS)
    assert all(int(event.take[:, 0].max()) < 8 for event in spoken)
