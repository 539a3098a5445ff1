"""Does drama3-tiny read its text yet? A teacher-forced probe for training checkpoints.

    python -m recipes.drama3_tiny.text_use --corpus corpus --run run [--every 100] [--json text_use.jsonl] [--plot text_use.png]
    python -m recipes.drama3_tiny.text_use --corpus corpus --model MODEL

Each held-out utterance of the corpus is scored twice under teacher forcing, in the cloning rows
the model trains on (one reference of the same voice, from the held-out split): once with its own
text and once with the text of the utterance next to it in length (same voice, similar duration,
other words). The difference of the semantic-token losses, in nats a frame, is how much the text
tells the model about the audio it must predict:

- about 0: the model predicts speech from the audio so far and the reference alone; outputs say
  corpus-like words whatever they are asked (a model at this stage fails Whisper WER however
  long it trains on the same schedule, unless the gap starts to grow);
- growing: the model attends to the text; WER follows once the gap is a sizeable part of the
  semantic loss.

With it, `diagonality`: how diagonal the most diagonal backbone attention head is, from the
target's frames to the text they speak (1.0: every frame reads further into the text than the
one before, the picture of an aligned TTS model).

It costs a forward pass per batch (a few seconds a checkpoint on one thread), where a Whisper
evaluation of generated speech takes minutes, so it can follow a run checkpoint by checkpoint.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path
from typing import Sequence

import torch
from tqdm.auto import tqdm

HELDOUT_SPLIT = "heldout"
REFERENCE_FRAMES = 70  # the longest reference the recipe trains with


def mismatched_partners(frames: Sequence[int], speakers: Sequence[str]) -> list[int]:
    """For each item, another item of the same speaker next to it in length (a derangement within
    each speaker: no item keeps its own text). A speaker with a single item keeps it (gap 0 there)."""
    partners = list(range(len(frames)))
    by_speaker: dict[str, list[int]] = {}
    for index, speaker in enumerate(speakers):
        by_speaker.setdefault(str(speaker), []).append(index)
    for members in by_speaker.values():
        ordered = sorted(members, key=lambda index: (frames[index], index))
        for position, index in enumerate(ordered):
            partners[index] = ordered[(position + 1) % len(ordered)]
    return partners


def round_robin(speakers: Sequence[str], count: int) -> list[int]:
    """`count` indices taking each speaker's items in turn (in their order), so a sample of a
    corpus ordered voice by voice holds every voice."""
    queues: dict[str, list[int]] = {}
    for index, speaker in enumerate(speakers):
        queues.setdefault(str(speaker), []).append(index)
    chosen, depth = [], 0
    while len(chosen) < count and any(depth < len(queue) for queue in queues.values()):
        chosen.extend(queue[depth] for queue in queues.values() if depth < len(queue))
        depth += 1
    return sorted(chosen[:count])


def held_out_dataset(corpus: Path, codec, cache_dir: Path, voices=None):
    """The corpus's held-out utterances (of `voices` only, when given) encoded with `codec`, with
    `index` for the collator."""
    from transformers_drama3.training import prepare_dataset
    from .lm_training import corpus_records

    dataset, _ = prepare_dataset(corpus_records(corpus, HELDOUT_SPLIT, voices), codec, cache_dir, progress=False)
    return dataset.map(lambda _, index: {"index": index}, with_indices=True)


def text_use(model, processor, dataset, batch_size: int = 8, limit: int | None = None, seed: int = 0) -> dict:
    """Mean semantic and codebook losses with the true texts and with mismatched ones; `gap` =
    semantic(other) - semantic(true). Same references, same batches, same audio for both."""
    from transformers_drama3.training import CloningCollator
    from transformers_drama3.training.collators import ReferencePool

    chosen = round_robin(dataset["speaker"], len(dataset) if limit is None else limit)
    items = [dataset[index] for index in chosen]
    count = len(items)
    partners = mismatched_partners([item["frames"] for item in items], [item["speaker"] for item in items])
    collator = CloningCollator(processor, ReferencePool(dataset, REFERENCE_FRAMES), max_references=1, seed=seed)
    totals = {"true": [0.0, 0.0], "other": [0.0, 0.0]}
    batches = 0
    model.eval()
    for start in range(0, count, batch_size):
        positions = range(start, min(count, start + batch_size))
        for name, texts in (("true", [items[i]["text"] for i in positions]),
                            ("other", [items[partners[i]]["text"] for i in positions])):
            batch = collator([dict(items[i], text=text) for i, text in zip(positions, texts)])
            with torch.no_grad():
                output = model(**batch)
            totals[name][0] += output.semantic_loss.item()
            # nan for a backbone-only checkpoint (codebook loss weight 0: the tower is not run)
            totals[name][1] += float("nan") if output.codebook_loss is None else output.codebook_loss.item()
        batches += 1
    mean = {name: [value / batches for value in pair] for name, pair in totals.items()}
    return {
        "utterances": count,
        "semantic_true": mean["true"][0],
        "semantic_other": mean["other"][0],
        "gap": mean["other"][0] - mean["true"][0],
        "codebook_true": mean["true"][1],
        "codebook_other": mean["other"][1],
    }


def monotonic_correlation(weights: torch.Tensor) -> float:
    """How diagonal one head's attention from speech frames to text is: the Pearson correlation
    between a frame's index and the text position it attends to most. weights: [frames, text].
    1.0 = each frame reads further into the text than the one before; 0 when the argmax never moves."""
    positions = weights.argmax(dim=-1).double()
    frames = torch.arange(positions.shape[0], dtype=torch.float64)
    if positions.shape[0] < 2 or positions.std() == 0:
        return 0.0
    return float(torch.corrcoef(torch.stack([frames, positions]))[0, 1])


def diagonality(model, processor, dataset, limit: int = 12, seed: int = 0) -> float:
    """The mean over `limit` held-out utterances of the most diagonal backbone attention head
    (`monotonic_correlation` of the target's frames over the text of the turn they speak). An
    aligned model has a head near 1; needs a model loaded with `attn_implementation="eager"`."""
    from transformers_drama3.training import CloningCollator
    from transformers_drama3.training.collators import ReferencePool

    collator = CloningCollator(processor, ReferencePool(dataset, REFERENCE_FRAMES), max_references=1, seed=seed)
    scores = []
    for index in round_robin(dataset["speaker"], limit):
        rows, _ = collator.example_rows(dataset[index])
        start, stop = rows.speak_span
        frames = (processor.token_ids.is_semantic(rows.input_ids) & rows.supervised).nonzero().flatten()
        ids, codes = rows.input_ids[None], rows.audio_codes[None]
        with torch.no_grad():
            outputs = model.backbone(inputs_embeds=model.embed_rows(ids, codes), attention_mask=torch.ones_like(ids),
                                     use_cache=False, output_attentions=True)
        layers = [weights for weights in outputs.attentions or () if weights is not None]
        if not layers:
            raise ValueError("diagonality: the backbone returned no attention weights; load the model with attn_implementation='eager'")
        scores.append(max(monotonic_correlation(head[frames][:, start:stop]) for weights in layers for head in weights[0]))
    return sum(scores) / len(scores)


def run_checkpoints(run: Path, every: int = 1) -> list[tuple[int, Path]]:
    """The complete checkpoints of a training run whose step is a multiple of `every`, oldest first."""
    found = []
    for folder in run.glob("checkpoint-*"):
        match = re.fullmatch(r"checkpoint-(\d+)", folder.name)
        if match and (folder / "trainer_state.json").exists() and int(match.group(1)) % every == 0:
            found.append((int(match.group(1)), folder))
    return sorted(found)


def plot(rows: Sequence[dict], image_path: Path) -> bool:
    """Gap and semantic losses over training steps; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = sorted((row for row in rows if "step" in row), key=lambda row: row["step"])
    if not rows:
        return False
    steps = [row["step"] for row in rows]
    figure, (losses, gaps, diagonal) = plt.subplots(1, 3, figsize=(13, 3.4))
    losses.plot(steps, [row["semantic_true"] for row in rows], marker="o", label="own text")
    losses.plot(steps, [row["semantic_other"] for row in rows], marker="o", label="another utterance's text")
    losses.set_xlabel("training step")
    losses.set_ylabel("held-out semantic loss (nats/frame)")
    losses.legend()
    gaps.plot(steps, [row["gap"] for row in rows], marker="o", color="C2")
    gaps.axhline(0.0, color="grey", linewidth=0.8)
    gaps.set_xlabel("training step")
    gaps.set_ylabel("text-use gap (nats/frame)")
    marked = [row for row in rows if "diagonality" in row]
    diagonal.plot([row["step"] for row in marked], [row["diagonality"] for row in marked], marker="o", color="C3")
    diagonal.set_ylim(-0.1, 1.0)
    diagonal.set_xlabel("training step")
    diagonal.set_ylabel("most diagonal head (correlation)")
    figure.suptitle("drama3-tiny: does the model read its text?")
    figure.tight_layout()
    figure.savefig(image_path, dpi=110)
    plt.close(figure)
    return True


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.drama3_tiny.text_use", description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", required=True, type=Path)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="a model folder (model, processor and codec/)")
    source.add_argument("--run", type=Path, help="a lm_training run folder: score its checkpoints")
    parser.add_argument("--every", type=int, default=1, help="run: only checkpoints whose step is a multiple of this")
    parser.add_argument("--utterances", type=int, default=48, help="held-out utterances scored")
    parser.add_argument("--json", type=Path, help="append one JSON line per model (run: checkpoints already in it are skipped)")
    parser.add_argument("--plot", type=Path, help="run: plot every line of --json")
    parser.add_argument("--cache", type=Path, help="where the held-out audio's codes are cached (default: RUN/text_use_codes, "
                        "or a temporary folder for --model)")
    parser.add_argument("--voices", default=None, help="score the held-out utterances of these voices only "
                        "(comma-separated; a run trained on some voices: lm_training --voices)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from transformers_drama3.modeling_drama3 import Drama3ForSpeechGeneration
    from transformers_drama3.processing_drama3 import Drama3Processor
    from .lm_training import load_codec

    if args.model is not None:
        processor = Drama3Processor.from_pretrained(args.model)
        codec, models = processor.codec, [(None, args.model)]
        cache = args.cache or Path(tempfile.mkdtemp(prefix="text_use_codes-"))  # never inside the model folder
    else:
        codec = load_codec(args.run / "model" / "codec") if (args.run / "model" / "codec").exists() else None
        if codec is None:
            raise SystemExit(f"--run {args.run}: no model/codec folder to encode the held-out audio with")
        processor = Drama3Processor(AutoTokenizer.from_pretrained(args.run / "tokenizer"),
                                    codebook_size=codec.config.codebook_size, num_codebooks=codec.num_codebooks)
        cache, models = args.cache or args.run / "text_use_codes", run_checkpoints(args.run, args.every)
    done = set()
    if args.json is not None and args.json.exists():
        done = {json.loads(line).get("step") for line in args.json.read_text().splitlines() if line.strip()}
    dataset = held_out_dataset(args.corpus, codec, cache, args.voices.split(",") if args.voices else None)
    for step, folder in tqdm([(s, f) for s, f in models if s is None or s not in done], desc="text use"):
        try:
            model = Drama3ForSpeechGeneration.from_pretrained(folder, attn_implementation="eager")
        except OSError:
            if folder.exists():
                raise
            # a run in training rotates its checkpoints (save_total_limit): this one went meanwhile
            print(f"{folder}: removed by the training run before it could be scored; skipped", flush=True)
            continue
        row = {"step": step, "model": str(folder), **text_use(model, processor, dataset, limit=args.utterances),
               "diagonality": diagonality(model, processor, dataset)}
        print(json.dumps(row))
        if args.json is not None:
            with open(args.json, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(row) + "\n")
    if args.plot is not None and args.json is not None and args.json.exists():
        plot([json.loads(line) for line in args.json.read_text().splitlines() if line.strip()], args.plot)


if __name__ == "__main__":
    main()
