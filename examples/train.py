"""Train Drama 3 with `Trainer` on prepared data: TTS or cloning rows, AdamW or Muon, optional packing.

    # one process
    python examples/train.py --model DIR --data PREPARED --output out --optimizer muon
    # several processes (CPU: gloo; GPU: nccl), same global batch = processes x --batch-size
    torchrun --nproc_per_node 2 examples/train.py --model DIR --data PREPARED --output out
    # full fine-tuning sharded with FSDP2 (the model does not fit one GPU): a shipped accelerate config
    accelerate launch --config_file examples/accelerate/fsdp2_single_node_8gpu.yaml examples/train.py \
        --model fishaudio/drama-3 --data PREPARED --output out --optimizer muon
    # or DeepSpeed ZeRO-3 (pip install deepspeed; AdamW only)
    accelerate launch --config_file examples/accelerate/deepspeed_zero3.yaml examples/train.py \
        --model fishaudio/drama-3 --data PREPARED --output out

`--data` is a dataset saved by `prepare_dataset(...)[0].save_to_disk(PREPARED)`, or a raw source
(folder / manifest / Hub name) together with `--codec DIR` to prepare it first (cached under
`--output/codes`). The tokenizer is read from `--tokenizer` (default: the model folder).

`--output/final` is written in the published layout (also from a sharded run: the full state dict
is gathered on the main process); checkpoints every `--save-steps` are accelerate's (sharded under
FSDP) and `--resume` continues from one. See docs/scale_out.md.
"""

from __future__ import annotations

import argparse
import json
import os


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Drama 3 checkpoint folder or Hub id")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: --model)")
    parser.add_argument("--data", required=True, help="prepared dataset folder, or a raw source with --codec")
    parser.add_argument("--codec", default=None, help="codec folder, to prepare raw data")
    parser.add_argument("--output", required=True)
    parser.add_argument("--task", choices=("tts", "cloning"), default="tts")
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--batch-size", type=int, default=4, help="per process")
    parser.add_argument("--gradient-accumulation", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--max-rows", type=int, default=None, help="cut longer examples")
    parser.add_argument("--pack-rows", type=int, default=None, help="pack examples into rows of this length")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--save-steps", type=int, default=0, help="0: save only at the end")
    parser.add_argument("--resume", default=None, help="checkpoint folder to resume from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="weights' dtype (auto: the checkpoint's); under FSDP with mixed precision bf16 the "
                             "weights are float32 masters and the compute bf16")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--loss-log", default=None, help="write the logged losses here (JSON, main process)")
    return parser.parse_args(argv)


def load_data(args, processor):
    import datasets

    if os.path.exists(os.path.join(args.data, "dataset_info.json")):
        return datasets.load_from_disk(args.data)
    if args.codec is None:
        raise SystemExit("--data is not a prepared dataset; give --codec to prepare it")
    from transformers_drama3.codec import Drama3CodecModel
    from transformers_drama3.training import load_speech_records, prepare_dataset

    codec = Drama3CodecModel.from_pretrained(args.codec).eval()
    dataset, report = prepare_dataset(load_speech_records(args.data), codec, os.path.join(args.output, "codes"),
                                      report_path=os.path.join(args.output, "preparation.json"))
    print(report.summary())
    return dataset


def main(argv=None):
    args = parse_args(argv)
    try:
        train(args)
    finally:
        close_process_group()


def check_args(args) -> None:
    """Refuse what cannot run, before any work."""
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if args.optimizer == "muon" and deepspeed:
        raise SystemExit("--optimizer muon cannot run under DeepSpeed ZeRO-3: it partitions each parameter flat, "
                         "so no rank holds a whole matrix to orthogonalise; use --optimizer adamw, or an FSDP config "
                         "(examples/accelerate/fsdp2_*.yaml)")
    if deepspeed and not args.cpu:
        import torch

        if not torch.accelerator.is_available():
            # accelerate would count one process while DeepSpeed counts them all, and DeepSpeed would
            # refuse the batch size after the model has loaded
            raise SystemExit("a DeepSpeed launch on a machine without GPUs needs --cpu (DeepSpeed's CPU accelerator "
                             "on a gloo process group)")


def train(args) -> None:
    """Train and save; every rank runs all of it (Trainer writes from the main process only)."""
    check_args(args)
    from transformers import AutoTokenizer, TrainingArguments

    from transformers_drama3 import Drama3ForSpeechGeneration
    from transformers_drama3.processing_drama3 import Drama3Processor
    from transformers_drama3.training import (
        CloningCollator,
        Drama3Trainer,
        PackingCollator,
        ReferencePool,
        TTSCollator,
    )
    from transformers_drama3.training.distributed import is_sharded, save_sharded_model, sharding_summary

    training_args = TrainingArguments(
        output_dir=args.output,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        weight_decay=args.weight_decay,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        gradient_checkpointing=args.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if args.gradient_checkpointing else None,
        remove_unused_columns=False,  # the collator reads text / codes / speaker
        report_to=[],
        seed=args.seed,
        data_seed=args.seed,
        use_cpu=args.cpu,
        disable_tqdm=True,
    )
    # The process group starts before the model loads: under FSDP with cpu_ram_efficient_loading
    # only the first process of each machine reads the weights (the others build the model on the
    # meta device and receive their shards), and ZeRO-3's zero3_init_flag partitions the model as
    # it is built.
    training_args.world_size  # noqa: B018 (starts the process group)
    model = Drama3ForSpeechGeneration.from_pretrained(args.model, dtype=args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    processor = Drama3Processor(tokenizer, codebook_size=model.config.codebook_size,
                                num_codebooks=model.config.num_codebooks)
    dataset = load_data(args, processor)
    if "index" not in dataset.column_names:
        dataset = dataset.map(lambda _, index: {"index": index}, with_indices=True)
    if args.task == "cloning":
        collator = CloningCollator(processor, ReferencePool(dataset), max_rows=args.max_rows, seed=args.seed)
    else:
        collator = TTSCollator(processor, max_rows=args.max_rows, seed=args.seed)
    if args.pack_rows:
        collator = PackingCollator(collator, args.pack_rows)

    trainer = Drama3Trainer(
        model=model, args=training_args, train_dataset=dataset, data_collator=collator,
        optimizer=args.optimizer, pad_id=processor.token_ids.pad,
    )
    trainer.train(resume_from_checkpoint=args.resume)
    if is_sharded(trainer) and trainer.is_world_process_zero():
        print(sharding_summary(trainer), flush=True)
    if trainer.is_deepspeed_enabled and trainer.is_world_process_zero():
        print(zero_summary(trainer), flush=True)
    final = os.path.join(args.output, "final")
    if is_sharded(trainer):
        save_sharded_model(trainer, final)
    else:
        trainer.save_model(final)
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(final)
    if trainer.is_world_process_zero() and args.loss_log:
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        with open(args.loss_log, "w") as handle:
            json.dump(losses, handle)
    trainer.accelerator.wait_for_everyone()  # no rank tears the group down while another still uses it


def zero_summary(trainer) -> str:
    """One line: how many of the model's parameter elements this process holds under DeepSpeed
    (ZeRO-3 keeps each parameter's partition in `ds_tensor` and its full size in `ds_numel`)."""
    held = total = 0
    for parameter in trainer.model_wrapped.module.parameters():
        partition = getattr(parameter, "ds_tensor", None)
        total += getattr(parameter, "ds_numel", parameter.numel())
        held += partition.numel() if partition is not None else parameter.numel()
    stage = trainer.accelerator.state.deepspeed_plugin.zero_stage
    return (f"DeepSpeed ZeRO-{stage} ({type(trainer.model_wrapped).__name__}) over "
            f"{trainer.accelerator.num_processes} processes: this process holds {held} of {total} parameter elements")


def close_process_group() -> None:
    """Tear the process group down before the interpreter does: a gloo worker still alive at exit
    aborts its process (SIGABRT) and fails a run whose training had finished. The trainer and its
    DDP wrapper are gone by now (`train` has returned) and are collected first, so the last
    reference to the group is dropped here, not by the DDP reducer's destructor at interpreter
    exit: that one joins gloo's worker threads while holding the GIL, and a worker releasing a
    finished collective's tensors waits for the GIL (a deadlock seen at exit)."""
    import gc
    import time

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gc.collect()
        time.sleep(0.2)  # the GIL released: workers drop the works they have finished
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
