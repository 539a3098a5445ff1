"""Fine-tune a voice with LoRA: a folder of wav + txt -> a saved adapter -> a merged full checkpoint.

    python examples/finetune_voice_lora.py --model fishaudio/drama-3 --voice my_voice/ --output out/

Steps: read `my_voice/*.wav` with their `*.txt` transcripts, validate and encode them once with the
codec (cached in `out/codes`, skipped files listed in `out/preparation.json`), train the "light"
LoRA preset (or `--preset heavy`) with `Trainer` on cloning rows (references are other clips of the
same voice), save the adapter to `out/adapter` (served as a voice by `drama3 serve --adapter
me=out/adapter`, on the base model, beside other adapters), then merge it and save a full
checkpoint in the published layout to `out/merged` (servable by engines that read that layout,
e.g. SGLang-Omni).
The codec is read from `--codec` (default: the model folder's `codec/`).
"""

from __future__ import annotations

import argparse
import json
import os


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokenizer", default=None, help="default: --model")
    parser.add_argument("--codec", default=None, help="default: <model>/codec")
    parser.add_argument("--voice", required=True, help="folder of wav + txt pairs")
    parser.add_argument("--output", required=True)
    parser.add_argument("--preset", choices=("light", "heavy"), default="light")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--min-seconds", type=float, default=0.5)
    parser.add_argument("--min-speech-fraction", type=float, default=0.2,
                        help="skip recordings shorter than this fraction of their transcript's expected duration")
    parser.add_argument("--max-seconds", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from transformers import AutoModel, AutoTokenizer, TrainingArguments

    from transformers_drama3 import Drama3ForSpeechGeneration
    from transformers_drama3.processing_drama3 import Drama3Processor
    from transformers_drama3.training import (
        CloningCollator,
        Drama3Trainer,
        ReferencePool,
        apply_lora,
        load_speech_records,
        merge_and_save,
        prepare_dataset,
    )

    codec = AutoModel.from_pretrained(args.codec or os.path.join(args.model, "codec")).eval()  # the S2 codec, or drama3-tiny's
    dataset, report = prepare_dataset(
        load_speech_records(args.voice), codec, os.path.join(args.output, "codes"),
        min_seconds=args.min_seconds, max_seconds=args.max_seconds, min_speech_fraction=args.min_speech_fraction,
        report_path=os.path.join(args.output, "preparation.json"),
    )
    print(report.summary())
    if len(dataset) == 0:
        raise SystemExit(f"{args.voice}: no usable recordings (see {args.output}/preparation.json)")
    dataset = dataset.map(lambda _, index: {"index": index}, with_indices=True)

    model = Drama3ForSpeechGeneration.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    processor = Drama3Processor(tokenizer, codebook_size=model.config.codebook_size,
                                num_codebooks=model.config.num_codebooks)
    model = apply_lora(model, args.preset, r=args.rank)
    model.print_trainable_parameters()

    training_args = TrainingArguments(
        output_dir=os.path.join(args.output, "run"),
        per_device_train_batch_size=args.batch_size,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        remove_unused_columns=False,
        report_to=[],
        seed=args.seed,
        use_cpu=args.cpu,
        disable_tqdm=True,
    )
    trainer = Drama3Trainer(
        model=model, args=training_args, train_dataset=dataset,
        data_collator=CloningCollator(processor, ReferencePool(dataset), seed=args.seed),
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    with open(os.path.join(args.output, "losses.json"), "w") as handle:
        json.dump(losses, handle)
    model.save_pretrained(os.path.join(args.output, "adapter"))
    write_base_fingerprint(model.get_base_model().config, os.path.join(args.output, "adapter"))
    merged = merge_and_save(model, os.path.join(args.output, "merged"))
    tokenizer.save_pretrained(os.path.join(args.output, "merged"))
    print(f"adapter: {args.output}/adapter  merged checkpoint: {args.output}/merged  ({type(merged).__name__})")


def write_base_fingerprint(config, adapter_dir: str) -> None:
    """drama3_base.json beside the adapter: the base model's sizes, which `drama3 serve --adapter`
    compares with the served model's before it takes the adapter."""
    from transformers_drama3.serving.adapter_layers import BASE_FILE, base_fingerprint

    with open(os.path.join(adapter_dir, BASE_FILE), "w") as handle:
        json.dump(base_fingerprint(config), handle, indent=2)


if __name__ == "__main__":
    main()
