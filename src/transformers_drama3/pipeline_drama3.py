"""Drama 3 in transformers' text-to-speech / text-to-audio pipeline, unchanged.

`TextToAudioPipeline` (transformers 5.24) calls three things, and Drama 3 provides each:

1. preprocess: `processor(texts, return_tensors="pt")`, or for a chat
   `processor.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True)`
   -> `Drama3Processor` returns input_ids / audio_codes / attention_mask (left-padded rows);
2. forward: `model.generate(**inputs, return_dict_in_generate=True, max_new_tokens=...)`
   -> `Drama3ForSpeechGeneration.generate` returns a `Drama3GenerationOutput` whose `sequences`
   are rows `[batch, prompt_rows + steps, 1 + num_codebooks]` (`[main_id, c0..c9]`: the prompt, then
   the drawn frames, eos and padding);
3. postprocess: an output without "audio" is decoded with `processor.decode(sequences)`, which
   reads each item's voice turn out of its rows (`Drama3Processor.spoken_frames`: the take, as
   `generate()` returns it) and runs the codec -> `{"audio": ndarray [samples], "sampling_rate":
   config.sampling_rate (44100)}`.

Loading: with a path or repo id, `pipeline("text-to-speech", model=path)` finds the model through
`AutoModelForTextToWaveform` and the processor through `AutoProcessor` (both registered on import
of `transformers_drama3`, by `register_auto_classes`). With a model
instance, transformers cannot guess a tokenizer: pass `tokenizer=` and `processor=`, or use
`text_to_speech_pipeline(model)`, which loads them from where the model came from.

Generation parameters go in `generate_kwargs` (e.g. `{"seed": 0, "preset": "paper-eval"}`). The
pipeline adds `max_new_tokens=256` (frames, ~12 s) unless the model's generation config sets it;
each take is also held to its own budget (2.5x the expected duration of its text).
The pipeline speaks each text as one prompt (the model's `generate`), so it has no `scene` mode: to
speak a scene one speaker turn at a time, use `long_form.generate_long_form(..., scene="turns")`.
"""

from __future__ import annotations

from transformers import pipeline

from .processing_drama3 import Drama3Processor

TASKS = ("text-to-speech", "text-to-audio")


def text_to_speech_pipeline(model, processor: Drama3Processor | None = None, task: str = "text-to-speech", **kwargs):
    """`pipeline(task, ...)` for a Drama 3 model given as a path, a repo id or an instance.

    For an instance without `processor`, the processor is loaded from `model.name_or_path`.
    Other keyword arguments go to `transformers.pipeline` (device, dtype, ...)."""
    if task not in TASKS:
        raise ValueError(f"task={task!r}; Drama 3 speaks through {TASKS}")
    if isinstance(model, str):
        return pipeline(task, model=model, processor=processor, **kwargs)
    if processor is None:
        source = getattr(model, "name_or_path", "")
        if not source:
            raise ValueError("processor: this model was not loaded from a folder; pass its Drama3Processor")
        processor = Drama3Processor.from_pretrained(source)
    return pipeline(task, model=model, tokenizer=processor.tokenizer, processor=processor, **kwargs)

