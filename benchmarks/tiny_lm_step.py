"""Training step time of drama3-tiny designs on one CPU thread: which design the budget can train.

    PYTHONPATH=src:. python benchmarks/tiny_lm_step.py --corpus CORPUS --codec CODEC10 --old-codec CODEC4 \
        [--items 96] [--steps 6] [--batch-size 8]

Every design trains `--steps` AdamW steps on the same batches of `--items` corpus utterances (a
random sample, and the shortest `CURRICULUM_START` of it, where a curriculum starts) as
`lm_training` builds them (cloning rows, one reference of at least 40 frames). Designs: the first release's (BPE text,
the 4-codebook codec, backbone 4 layers, width 256) and phoneme designs with the 10-codebook
codec at several widths, tower feed-forward sizes and reference lengths (every tower layer is a
causal block over every row, so rows and tower layers are the step's cost). Prints seconds per step, rows per batch and
the ratio to the first release's step, measured in this run; asserts nothing.
"""

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

# name -> (text front end, codec, backbone layers, width, tower feed-forward, reference frames)
DESIGNS = {
    "first release: text, 4 codebooks, width 256": ("text", "old", 4, 256, 512, (0, None)),
    "phonemes, 10 codebooks, width 256": ("phonemes", "new", 4, 256, 512, (40, None)),
    "phonemes, 10 codebooks, width 256, tower ffn 256, refs <= 70": ("phonemes", "new", 4, 256, 256, (40, 70)),
    "phonemes, 10 codebooks, width 192, tower ffn 256, refs <= 70": ("phonemes", "new", 4, 192, 256, (40, 70)),
    "phonemes, 10 codebooks, width 192, 6 layers, tower ffn 256, refs <= 70": ("phonemes", "new", 6, 192, 256, (40, 70)),
}


def batches(dataset, collator, items: list[int], batch_size: int) -> list[dict]:
    return [collator([dataset[i] for i in items[start : start + batch_size]])
            for start in range(0, len(items) - batch_size + 1, batch_size)]


def time_design(frontend: str, codec, backbone: int, width: int, tower_ffn: int, references: tuple, records, items_sets,
                args, work: Path) -> dict:
    from recipes.drama3_tiny.lm_recipe import build_tiny_tokenizer, tiny_model_config
    from transformers_drama3.modeling_drama3 import Drama3ForSpeechGeneration
    from transformers_drama3.processing_drama3 import Drama3Processor
    from recipes.drama3_tiny.lm_training import reference_pool
    from transformers_drama3.training import CloningCollator, prepare_dataset
    from transformers_drama3.training.trainer import drama3_loss

    dataset, _ = prepare_dataset(records, codec, work / f"codes-{codec.num_codebooks}", progress=False, min_seconds=0.25)
    dataset = dataset.map(lambda _, index: {"index": index}, with_indices=True)
    tokenizer = build_tiny_tokenizer([r["text"] for r in records], codec.config.codebook_size, text_frontend=frontend)
    config = tiny_model_config(tokenizer, codec.num_codebooks, codec.config.codebook_size,
                               backbone_layers=backbone, hidden_size=width, tower_intermediate_size=tower_ffn)
    torch.manual_seed(0)
    model = Drama3ForSpeechGeneration(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    processor = Drama3Processor(tokenizer, codebook_size=codec.config.codebook_size,
                                num_codebooks=codec.num_codebooks, frame_rate=codec.frame_rate)
    collator = CloningCollator(processor, reference_pool(dataset, *references), max_references=1, seed=0)
    result = {"parameters_M": sum(p.numel() for p in model.parameters()) / 1e6}
    for name, items in items_sets.items():
        items = [i for i in items if i < len(dataset)]
        prepared = batches(dataset, collator, items, args.batch_size)[: args.steps + 1]
        seconds = []
        for index, batch in enumerate(prepared):
            started = time.perf_counter()
            loss, _ = drama3_loss(model, batch, pad_id=tokenizer.pad_token_id)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if index:  # the first step warms up allocations
                seconds.append(time.perf_counter() - started)
        result[name] = sum(seconds) / len(seconds)
        result[f"{name} rows"] = sum(int(b["attention_mask"].sum()) for b in prepared) / len(prepared)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--codec", required=True, help="the 10-codebook codec")
    parser.add_argument("--old-codec", required=True, help="the first release's 4-codebook codec")
    parser.add_argument("--items", type=int, default=96)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from recipes.drama3_tiny.lm_training import CURRICULUM_START, corpus_records, load_codec

    records = corpus_records(Path(args.corpus))
    sample = random.Random(0).sample(range(len(records)), args.items)
    records = [records[i] for i in sorted(sample)]
    order = sorted(range(len(records)), key=lambda i: (len(records[i]["text"]), i))
    shortest = order[: max(args.batch_size * 2, int(CURRICULUM_START * len(order)))]
    items_sets = {"random batches": random.Random(1).sample(range(len(records)), len(records)),
                  "shortest batches": random.Random(2).sample(shortest, len(shortest))}
    codecs = {"old": load_codec(args.old_codec), "new": load_codec(args.codec)}
    rows = {}
    with tempfile.TemporaryDirectory() as work:
        for name, (frontend, codec, *sizes) in DESIGNS.items():
            rows[name] = time_design(frontend, codecs[codec], *sizes, records, items_sets, args, Path(work))
            print(name, {k: round(v, 3) for k, v in rows[name].items()}, flush=True)
    base = rows[next(iter(DESIGNS))]["random batches"]
    print("| design | parameters | s/step random | rows | s/step shortest | rows | x first release |")
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['parameters_M']:.2f} M | {row['random batches']:.2f} | {row['random batches rows']:.0f} | "
              f"{row['shortest batches']:.2f} | {row['shortest batches rows']:.0f} | {row['random batches'] / base:.2f} |")


if __name__ == "__main__":
    main()
