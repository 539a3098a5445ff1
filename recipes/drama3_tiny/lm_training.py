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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m recipes.drama3_tiny.lm_training", description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True, help="corpus folder (manifest.jsonl + wavs/)")
    parser.add_argument("--codec", required=True, help="codec folder")
    parser.add_argument("--out", required=True, help="run folder")
    parser.add_argument("--minutes", type=float, default=60.0, help="training time of this call")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument(
        "--schedule", default="constant_with_warmup", choices=["constant_with_warmup", "linear", "cosine"],
        help="learning-rate schedule; linear and cosine decay to zero at --max-steps, also on --resume "
        "(a run can go on at a constant rate and end with a decay)",
    )
    parser.add_argument("--max-steps", type=int, default=100_000, help="an upper bound; --minutes stops earlier")
    parser.add_argument("--save-steps", type=int, default=200)
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def corpus_records(corpus: Path, split: str = CLONING_SPLIT) -> list[dict]:
    """The corpus's `split` as `prepare_dataset` records: audio path, directed text, voice."""
    from .corpus import read_manifest

    return [
        {"audio": str(corpus / record.wav), "text": record.directed_text, "speaker": record.voice}
        for record in read_manifest(corpus / "manifest.jsonl")
        if record.split == split
    ]


def load_codec(path: str | os.PathLike):
    """A codec folder of either codec class (chosen by its config's model_type)."""
    from transformers import AutoConfig, AutoModel

    from transformers_drama3 import codec as _codec_classes  # noqa: F401  (registers both codec types)

    config = AutoConfig.from_pretrained(path)
    return AutoModel.from_pretrained(path, config=config).eval()


class TimeBudget:
    """A `TrainerCallback` that ends training (with a checkpoint) after `minutes`, and appends the
    logged losses to a JSON-lines file."""

    def __new__(cls, minutes: float, log_path: Path):
        from transformers import TrainerCallback

        class _TimeBudget(TrainerCallback):
            def __init__(self):
                self.deadline = time.monotonic() + minutes * 60

            def on_step_end(self, args, state, control, **kwargs):
                if time.monotonic() > self.deadline:
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
    from transformers_drama3.training import CloningCollator, Drama3Trainer, ReferencePool, prepare_dataset
    from .lm_recipe import build_tiny_tokenizer, tiny_model_config

    corpus, out = Path(args.corpus), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    codec = load_codec(args.codec)

    records = corpus_records(corpus)
    dataset, report = prepare_dataset(records, codec, out / "codes", report_path=out / "preparation.json")
    print(report.summary())
    dataset = dataset.map(lambda _, index: {"index": index}, with_indices=True)

    tokenizer_dir = out / "tokenizer"
    if tokenizer_dir.exists():
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    else:
        tokenizer = build_tiny_tokenizer((r["text"] for r in records), codec.config.codebook_size, tokenizer_dir)
    config = tiny_model_config(
        tokenizer, codec.num_codebooks, codec.config.codebook_size,
        sampling_rate=codec.sampling_rate, frame_size=codec.hop_length,
    )
    checkpoints = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    resume = bool(args.resume and checkpoints)
    torch.manual_seed(args.seed)
    model = Drama3ForSpeechGeneration(config)
    print(f"drama3-tiny: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")

    processor = Drama3Processor(
        tokenizer, codebook_size=codec.config.codebook_size, num_codebooks=codec.num_codebooks,
        frame_rate=codec.frame_rate,
    )
    collator = CloningCollator(processor, ReferencePool(dataset), max_references=1, seed=args.seed)
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
    trainer = Drama3Trainer(
        model=model, args=training_args, train_dataset=dataset, data_collator=collator,
        callbacks=[TimeBudget(args.minutes, out / "losses.jsonl")],
    )
    trainer.train(resume_from_checkpoint=str(checkpoints[-1]) if resume else None)

    final = out / "model"
    plot_losses(out / "losses.jsonl", out / "losses.png")
    assemble_model_folder(trainer.model, tokenizer, codec, final)
    shutil.copy(out / "preparation.json", final / "preparation.json")
    print(f"step {trainer.state.global_step}: model, tokenizer and codec saved to {final}")


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


def assemble_model_folder(model, tokenizer, codec, destination: str | Path) -> None:
    """Write what `from_pretrained` of the model and of `Drama3Processor` read: the model (a
    model, or a checkpoint folder), the processor (tokenizer files, processor and feature-extractor
    configs) and the codec under codec/."""
    from transformers_drama3.modeling_drama3 import Drama3ForSpeechGeneration
    from transformers_drama3.processing_drama3 import Drama3Processor
    from transformers_drama3.tokenizer_build import save_drama3_tokenizer
    from .lm_recipe import TINY_TEMPERATURE

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
    model.save_pretrained(destination)
    processor = Drama3Processor(
        tokenizer, codec=codec, codebook_size=codec.config.codebook_size, num_codebooks=codec.num_codebooks
    )
    processor.save_pretrained(destination)
    save_drama3_tokenizer(tokenizer, destination)


if __name__ == "__main__":
    main()
