"""Train drama3-tiny with `Trainer` on the espeak corpus: resumable, time-boxed, with a loss log.

    python -m recipes.drama3_tiny.lm_training --corpus CORPUS --codec CODEC --out RUN \
        [--minutes 60] [--resume] [--threads 2]

CORPUS is a folder built by `python -m recipes.drama3_tiny.corpus build`; CODEC a codec
folder (`Drama3MelCodecModel` or `Drama3CodecModel`). The run:

1. encodes the corpus's train split once with the codec (`training.prepare_dataset`: cached under
   RUN/codes, resumable, skipped records reported in RUN/preparation.json);
2. builds the tokenizer (byte-level BPE on the corpus text + every Drama 3 special token) and the
   tiny config (`lm_recipe.tiny_model_config`), or reads them back from RUN;
3. trains `Drama3ForSpeechGeneration` with `Drama3Trainer` on voice-cloning rows in the published
   layout (`CloningCollator`: the reference is another utterance of the same voice, never the
   target), AdamW, constant learning rate after a warm-up, checkpoints every `--save-steps`;
4. stops after `--minutes` of training (a later `--resume` continues from the last checkpoint with
   the same data order) and writes the model, tokenizer and codec to RUN/model in the layout
   `Drama3ForSpeechGeneration.from_pretrained` / `Drama3Processor.from_pretrained` read.

Losses go to RUN/losses.jsonl (one line per logging step).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

CLONING_SPLIT = "train"
CURRICULUM_START = 0.3
"""The share of the corpus (its shortest utterances) a curriculum starts with."""
CURRICULUM_WINDOW = 4
"""A curriculum batch is drawn from CURRICULUM_WINDOW x batch-size neighbours in length order
(batches of like lengths pad little, as `group_by_length` does)."""


class CurriculumSampler:
    """Dataset indices, batch after batch, from short to long utterances.

    Batch b draws `batch_size` indices from a window of neighbours in length order, the window
    placed at random in the shortest `allowed(b)` share of the data: CURRICULUM_START at b = 0,
    growing linearly to all of it at b = `steps`. Every batch is a pure function of (seed, b), so a
    resumed run (which skips the batches it has done) sees the same batches as one not stopped.
    """

    def __init__(self, lengths, batch_size: int, steps: int, total_batches: int, seed: int = 0):
        import torch

        self.order = torch.argsort(torch.as_tensor(lengths), stable=True)
        self.batch_size, self.steps, self.total_batches, self.seed = batch_size, steps, total_batches, seed

    def allowed(self, batch: int) -> int:
        """How many of the shortest utterances batch `batch` draws from."""
        share = CURRICULUM_START + (1 - CURRICULUM_START) * min(1.0, batch / max(1, self.steps))
        return max(self.batch_size * CURRICULUM_WINDOW, int(round(share * len(self.order))))

    def batch(self, batch: int) -> list[int]:
        import torch

        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + batch)
        allowed = min(len(self.order), self.allowed(batch))
        window = min(allowed, self.batch_size * CURRICULUM_WINDOW)
        start = int(torch.randint(0, allowed - window + 1, (1,), generator=generator))
        picks = torch.randperm(window, generator=generator)[: self.batch_size] + start
        return self.order[picks].tolist()

    def __iter__(self):
        for batch in range(self.total_batches):
            yield from self.batch(batch)

    def __len__(self) -> int:
        return self.total_batches * self.batch_size


def reference_pool(dataset, min_frames: int = 0, max_frames: int | None = None):
    """A `ReferencePool` of `dataset` that draws only utterances of `min_frames` to `max_frames` frames."""
    from transformers_drama3.training import ReferencePool

    pool = ReferencePool(dataset)
    if min_frames > 0 or max_frames is not None:
        frames = dataset["frames"]
        top = max_frames if max_frames is not None else max(frames)
        for speaker, indices in pool.by_speaker.items():
            pool.by_speaker[speaker] = [index for index in indices if min_frames <= frames[index] <= top]
    return pool


def last_complete_checkpoint(out: Path) -> Path | None:
    """The newest checkpoint folder whose trainer state was written (`Trainer` writes it last, so
    a run killed while saving resumes from the checkpoint before)."""
    complete = [path for path in out.glob("checkpoint-*") if (path / "trainer_state.json").is_file()]
    return max(complete, key=lambda path: int(path.name.split("-")[1]), default=None)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m recipes.drama3_tiny.lm_training", description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True, help="corpus folder (manifest.jsonl + wavs/)")
    parser.add_argument("--codec", required=True, help="codec folder")
    parser.add_argument("--out", required=True, help="run folder")
    parser.add_argument("--minutes", type=float, default=60.0, help="training time of this call")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--voices", default=None,
                        help="train on these voices of the corpus only (comma-separated names; default all). The "
                        "phoneme front end reads en-us: a voice whose accent speaks other phonemes (D's RP, F's en-029) "
                        "gives codes its text does not spell")
    parser.add_argument("--text-frontend", default="text", choices=["text", "phonemes"],
                        help="how the model reads spoken text (a new run only; a resumed run keeps its tokenizer)")
    parser.add_argument("--curriculum-steps", type=int, default=0,
                        help="short-to-long curriculum: the shortest CURRICULUM_START of the utterances at first, "
                        "all of them after this many steps (0: no curriculum, batches grouped by length)")
    parser.add_argument("--min-seconds", type=float, default=0.25,
                        help="shorter utterances are skipped (grammar 2's one-word utterances last 0.3-0.8 s)")
    parser.add_argument("--min-reference-frames", type=int, default=0,
                        help="cloning references are utterances of at least this many frames (40 = 1.9 s: a "
                        "one-word utterance shows little of a voice, and inference clones from sentences)")
    parser.add_argument("--codebook-fusion", type=int, default=1,
                        help="codebooks 1..K added to an audio row's backbone input (partial codebook fusion; the "
                        "published K is 1). A phonetic codec's sub-frame phonemes are codebooks 2-4: K = 4 lets the "
                        "backbone see every phoneme spoken so far, not one sub-frame in four")
    parser.add_argument("--backbone-layers", type=int, default=4, help="backbone layers (alternating DeltaNet / attention)")
    parser.add_argument("--hidden-size", type=int, default=256, help="width of the backbone and the tower")
    parser.add_argument("--tower-intermediate-size", type=int, default=None,
                        help="feed-forward width of each tower layer (default 2 x --hidden-size)")
    parser.add_argument("--max-reference-frames", type=int, default=None,
                        help="cloning references are whole utterances of at most this many frames (each tower "
                        "layer runs over every row, so reference length is step time)")
    parser.add_argument("--semantic-loss-weight", type=float, default=0.5,
                        help="weight of the semantic-token loss (the paper's 0.5); it is what aligns text and speech")
    parser.add_argument("--codebook-loss-weight", type=float, default=0.5,
                        help="weight of the tower's codebook loss (the paper's 0.5)")
    parser.add_argument("--seed-phoneme-codes", action="store_true",
                        help="phonetic codec: start each semantic token's embedding as its phoneme's text token "
                        "(lm_recipe.seed_phoneme_codes)")
    parser.add_argument("--guided-attention", type=float, default=0.0,
                        help="weight of a guided-attention loss on the backbone's attention layers (target frames "
                        "to the text they speak along the diagonal; recipes.drama3_tiny.guided_attention); 0: none")
    parser.add_argument("--guided-attention-target", default="diagonal", choices=["diagonal", "aligned"],
                        help="diagonal: the straight line from the first text row to the last; aligned (a phonetic "
                        "codec): heads 0 and 1 of each attention layer to the phoneme each frame speaks and the "
                        "next one, read off the target's codes (recipes.drama3_tiny.code_alignment)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument(
        "--schedule", default="constant_with_warmup", choices=["constant_with_warmup", "linear", "cosine"],
        help="learning-rate schedule; linear and cosine decay to zero at --max-steps, also on --resume "
        "(a run can go on at a constant rate and end with a decay)",
    )
    parser.add_argument("--max-steps", type=int, default=100_000, help="an upper bound; --minutes stops earlier")
    parser.add_argument("--stop-at", type=int, default=None,
                        help="end this call after this step (with a checkpoint); --resume goes on from there, on the "
                        "schedule of its own --max-steps")
    parser.add_argument("--save-steps", type=int, default=200)
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--encode-from-end", action="store_true",
                        help="only encode the far half of the corpus into the run's codes cache, from its last "
                        "utterance back, and exit: a second process beside the training run's own encoding")
    return parser.parse_args(argv)


def corpus_records(corpus: Path, split: str = CLONING_SPLIT, voices=None) -> list[dict]:
    """The corpus's `split` as `prepare_dataset` records: audio path, directed text, voice; only
    the utterances of `voices` (names) when given."""
    from .corpus import read_manifest

    return [
        {"audio": str(corpus / record.wav), "text": record.directed_text, "speaker": record.voice}
        for record in read_manifest(corpus / "manifest.jsonl")
        if record.split == split and (voices is None or record.voice in voices)
    ]


def far_half(records: list[dict]) -> list[dict]:
    """The records a second encoding process takes, last first: a little over half, so the two
    processes meet before either stops (the cache makes the overlap free for the one that reads it)."""
    return records[::-1][: len(records) // 2 + 1]


def load_codec(path: str | os.PathLike):
    """A codec folder of either codec class (chosen by its config's model_type)."""
    from transformers import AutoConfig, AutoModel

    from transformers_drama3 import codec as _codec_classes  # noqa: F401  (registers both codec types)

    config = AutoConfig.from_pretrained(path)
    return AutoModel.from_pretrained(path, config=config).eval()


class TimeBudget:
    """A `TrainerCallback` that ends training (with a checkpoint) after `minutes`, or once step
    `stop_at` is done, and appends the logged losses to a JSON-lines file."""

    def __new__(cls, minutes: float, log_path: Path, stop_at: int | None = None):
        from transformers import TrainerCallback

        class _TimeBudget(TrainerCallback):
            def __init__(self):
                self.deadline = time.monotonic() + minutes * 60

            def on_step_end(self, args, state, control, **kwargs):
                if time.monotonic() > self.deadline or stop_at is not None and state.global_step >= stop_at:
                    control.should_training_stop = True
                    control.should_save = True
                return control

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs:
                    with open(log_path, "a", encoding="utf-8") as handle:
                        handle.write(json.dumps({"step": state.global_step, "time": time.time(), **logs}) + "\n")

        return _TimeBudget()


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer, TrainingArguments

    from transformers_drama3.modeling_drama3 import Drama3ForSpeechGeneration
    from transformers_drama3.processing_drama3 import Drama3Processor
    from transformers_drama3.training import CloningCollator, prepare_dataset
    from .code_alignment import PhonemeRows
    from .guided_attention import GuidedAttention, SpeakSpanCollator, guided_trainer_class
    from .lm_recipe import build_tiny_tokenizer, seed_phoneme_codes, tiny_model_config

    corpus, out = Path(args.corpus), Path(args.out)
    records = corpus_records(corpus, voices=args.voices.split(",") if args.voices else None)
    if not records:
        raise SystemExit(f"no {CLONING_SPLIT} utterances of voices {args.voices} in {corpus}")
    out.mkdir(parents=True, exist_ok=True)
    codec = load_codec(args.codec)
    if args.encode_from_end:
        _, report = prepare_dataset(far_half(records), codec, out / "codes", min_seconds=args.min_seconds)
        print(f"encoded from the end: {report.summary()}")
        return
    dataset, report = prepare_dataset(records, codec, out / "codes", report_path=out / "preparation.json",
                                      min_seconds=args.min_seconds)
    print(report.summary())
    dataset = dataset.map(lambda _, index: {"index": index}, with_indices=True)

    tokenizer_dir = out / "tokenizer"
    if tokenizer_dir.exists():
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    else:
        tokenizer = build_tiny_tokenizer((r["text"] for r in records), codec.config.codebook_size, tokenizer_dir,
                                         text_frontend=args.text_frontend)
    config = tiny_model_config(
        tokenizer, codec.num_codebooks, codec.config.codebook_size,
        sampling_rate=codec.sampling_rate, frame_size=codec.hop_length,
        codebook_fusion=args.codebook_fusion, backbone_layers=args.backbone_layers, hidden_size=args.hidden_size,
        tower_intermediate_size=args.tower_intermediate_size,
    )
    config.semantic_loss_weight = args.semantic_loss_weight
    config.codebook_loss_weight = args.codebook_loss_weight
    checkpoint = last_complete_checkpoint(out) if args.resume else None
    resume = checkpoint is not None
    torch.manual_seed(args.seed)
    model = Drama3ForSpeechGeneration(config)
    if args.seed_phoneme_codes:
        if not hasattr(codec.config, "phonemes"):
            raise SystemExit("--seed-phoneme-codes needs a phonetic codec (its config lists the phonemes its codes are)")
        seeded = seed_phoneme_codes(model, tokenizer, codec.config.phonemes,
                                    codebooks=range(2, codec.num_codebooks))
        print(f"seeded {seeded} of {len(codec.config.phonemes)} phoneme codes from their text tokens")
    print(f"drama3-tiny: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")

    processor = Drama3Processor(
        tokenizer, codebook_size=codec.config.codebook_size, num_codebooks=codec.num_codebooks,
        frame_rate=codec.frame_rate,
    )
    pool = reference_pool(dataset, args.min_reference_frames, args.max_reference_frames)
    guide = None
    if args.guided_attention > 0:
        model.set_attn_implementation("eager")  # the guide reads the attention weights
        guide = GuidedAttention(model, weight=args.guided_attention)
    if guide is None:
        collator = CloningCollator(processor, pool, max_references=1, seed=args.seed)
    else:
        phoneme_rows = None
        if args.guided_attention_target == "aligned":
            if not hasattr(codec.config, "phonemes") or args.text_frontend != "phonemes" and not resume:
                raise SystemExit("--guided-attention-target aligned needs a phonetic codec and --text-frontend phonemes")
            phoneme_rows = PhonemeRows(tokenizer, codec.config.phonemes)
        collator = SpeakSpanCollator(processor, pool, max_references=1, seed=args.seed, phoneme_rows=phoneme_rows)
    training_args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        lr_scheduler_type=args.schedule,
        warmup_steps=args.warmup_steps,
        weight_decay=0.01,
        max_grad_norm=1.0,
        max_steps=args.max_steps,
        logging_steps=args.logging_steps,
        save_steps=args.save_steps,
        save_total_limit=2,
        train_sampling_strategy="group_by_length",
        length_column_name="frames",
        remove_unused_columns=False,
        dataloader_num_workers=0,
        report_to=[],
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=False,
    )
    sampler = None
    if args.curriculum_steps > 0:
        sampler = CurriculumSampler(dataset["frames"], args.batch_size, args.curriculum_steps, args.max_steps, args.seed)
    trainer = guided_trainer_class(curriculum_trainer_class())(
        model=model, args=training_args, train_dataset=dataset, data_collator=collator,
        callbacks=[TimeBudget(args.minutes, out / "losses.jsonl", args.stop_at)], curriculum=sampler, guide=guide,
    )
    trainer.train(resume_from_checkpoint=str(checkpoint) if resume else None)

    final = out / "model"
    plot_losses(out / "losses.jsonl", out / "losses.png")
    assemble_model_folder(trainer.model, tokenizer, codec, final, tokens_per_second=corpus_speaking_rate(processor, records))
    shutil.copy(out / "preparation.json", final / "preparation.json")
    print(f"step {trainer.state.global_step}: model, tokenizer and codec saved to {final}")


def curriculum_trainer_class():
    """`Drama3Trainer` with an optional `curriculum` sampler (a function: transformers loads lazily)."""
    from transformers_drama3.training import Drama3Trainer

    class _CurriculumTrainer(Drama3Trainer):
        """`Drama3Trainer` whose batches come from a `CurriculumSampler` when one is given."""

        def __init__(self, *args, curriculum=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.curriculum = curriculum

        def _get_train_sampler(self, train_dataset=None):
            return self.curriculum if self.curriculum is not None else super()._get_train_sampler(train_dataset)

    return _CurriculumTrainer


def plot_losses(log_path: str | Path, image_path: str | Path) -> bool:
    """Plot the training loss of a `losses.jsonl` (raw and smoothed) to `image_path`; False when
    matplotlib is not installed (`pip install -e ".[train]"`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [row for row in map(json.loads, open(log_path, encoding="utf-8")) if "loss" in row]
    if not rows:
        return False
    steps = [row["step"] for row in rows]
    losses = [row["loss"] for row in rows]
    smoothed = [sum(losses[max(0, i - 9) : i + 1]) / len(losses[max(0, i - 9) : i + 1]) for i in range(len(losses))]
    figure, axis = plt.subplots(figsize=(7, 3.5))
    axis.plot(steps, losses, alpha=0.35, label="loss (every 10 steps)")
    axis.plot(steps, smoothed, label="mean of the last 10")
    axis.set_xlabel("step (batch of 8 cloning rows)")
    axis.set_ylabel("text + 0.5 semantic + 0.5 codebook loss")
    axis.set_ylim(bottom=0, top=min(max(losses), 8))
    axis.set_title("drama3-tiny training")
    axis.legend()
    figure.tight_layout()
    figure.savefig(image_path, dpi=110)
    plt.close(figure)
    return True


RATE_SAMPLE = 2000
"""Utterances `corpus_speaking_rate` measures (evenly spread over the corpus)."""


def corpus_speaking_rate(processor, records: list[dict], durations: list[float] | None = None) -> float:
    """`lm_recipe.speaking_rate` over up to `RATE_SAMPLE` records spread evenly over `records`
    (`prepare_dataset` records: `audio`, `text`); durations read from the audio headers unless given."""
    import soundfile

    from .lm_recipe import speaking_rate

    stride = max(1, len(records) // RATE_SAMPLE)
    sample = records[::stride]
    seconds = durations[::stride] if durations is not None else [soundfile.info(r["audio"]).duration for r in sample]
    return speaking_rate(processor, [r["text"] for r in sample], seconds)


def assemble_model_folder(model, tokenizer, codec, destination: str | Path, tokens_per_second: float | None = None) -> None:
    """Write what `from_pretrained` of the model and of `Drama3Processor` read: the model (a
    model, or a checkpoint folder), the processor (tokenizer files, processor and feature-extractor
    configs) and the codec under codec/. `tokens_per_second` (the corpus's speaking rate in this
    tokenizer's tokens, `corpus_speaking_rate`) goes in the generation config, where frame budgets
    read it."""
    from transformers_drama3.modeling_drama3 import Drama3ForSpeechGeneration
    from transformers_drama3.processing_drama3 import Drama3Processor
    from transformers_drama3.prompting.tokenizer_build import save_drama3_tokenizer
    from .lm_recipe import TINY_REPETITION_AWARE, TINY_TEMPERATURE

    if isinstance(model, (str, Path)):
        model = Drama3ForSpeechGeneration.from_pretrained(model)
    # A model straight from `Trainer` carries two training leftovers: `Trainer` sets `use_cache` to
    # `TrainingArguments.use_cache` (False) on its config, and the sub-configs of a model built from
    # a config have no dtype. Neither belongs in an inference checkpoint.
    if "use_cache" in vars(model.config):
        del model.config.use_cache
    for sub_config in (model.config.text_config, model.config.audio_decoder_config):
        sub_config.dtype = model.dtype
    model.config.sampling_rate = codec.sampling_rate  # what pipelines report with the audio
    model.config.frame_size = codec.hop_length
    # trained on single-speaker cloning rows only: scenes are spoken turn by turn
    model.generation_config.scene_mode = "turns"
    model.generation_config.temperature = TINY_TEMPERATURE
    model.generation_config.repetition_aware = TINY_REPETITION_AWARE
    if tokens_per_second is not None:
        model.generation_config.text_tokens_per_second = tokens_per_second
    model.save_pretrained(destination)
    processor = Drama3Processor(
        tokenizer, codec=codec, codebook_size=codec.config.codebook_size, num_codebooks=codec.num_codebooks
    )
    processor.save_pretrained(destination)
    save_drama3_tokenizer(tokenizer, destination)


if __name__ == "__main__":
    main()
