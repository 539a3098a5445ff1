"""Where does drama3-tiny lose its words? Whisper WER of the held-out audio at each stage it passes.

    python -m recipes.drama3_tiny.bottleneck --corpus corpus --model MODEL [--utterances 12] [--json bottleneck.json]

A model that says the wrong words can be failing in three places, and a Whisper score of its
outputs alone does not say which. On held-out corpus utterances (their espeak-ng audio, encoded
with the model's codec), three tables:

1. **The codec, level by level**: the espeak original, its log-mel through the vocoder alone (no
   quantiser), then the codes with only their first k codebooks summed (k = 1 .. all). A codec
   whose first codebook carries the words reads well from k = 1; a residual quantiser whose levels
   share the words evenly needs every level right.
2. **Each codebook under teacher forcing**: the model's cross entropy (nats a frame; codebook 0
   over the whole vocabulary, as it is trained) and argmax accuracy for every level of the true
   next frame, given the true past (and, in the tower, the true lower levels of the frame), with
   the level's share of the codec's centroid energy.
3. **The decomposition**: the true codes decoded; codebook 0 as the backbone predicts it (argmax)
   with the true other levels; the true codebook 0 with the tower's argmax of the others; both
   predicted. Teacher forcing makes each an optimistic bound: a stage whose bound is already far
   above the true codes' WER is where the words are lost, whatever sampling does afterwards.

About 20 s an utterance on one thread (one forward pass; 16 Griffin-Lim decodings and Whisper tiny.en readings).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import soundfile as sf
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from transformers_drama3.evaluation import asr

from .corpus import plain_transcript
from .text_use import REFERENCE_FRAMES, held_out_dataset, round_robin

VARIANTS = ("true codes", "backbone codebook 0", "tower codebooks 1+", "both predicted")


def level_energy(codec, codes: torch.Tensor) -> torch.Tensor:
    """Summed squared norm of the chosen centroid of each codebook: [num_codebooks]."""
    return torch.stack([codec.codebooks[k][codes[:, k]].square().sum() for k in range(codec.num_codebooks)])


def teacher_forced(model, processor, rows) -> dict:
    """One utterance's cloning `rows` (a `PromptRows`) under teacher forcing.

    Returns "true" codes [frames, num_codebooks] of the target, "backbone" (argmax of codebook 0
    over the semantic band) [frames], "tower" (argmax of codebooks 1..) [frames, num_codebooks - 1],
    and per level "cross_entropy" and "correct" summed over the frames ([num_codebooks] each)."""
    token_ids = processor.token_ids
    ids, codes = rows.input_ids, rows.audio_codes
    targets = (token_ids.is_semantic(ids) & rows.supervised).nonzero().flatten()
    if len(targets) == 0 or int(targets[0]) == 0:
        raise ValueError("teacher_forced: the rows have no target frame after a prompt row")
    before = targets - 1  # row t predicts row t + 1
    with torch.no_grad():
        output = model(input_ids=ids[None], audio_codes=codes[None], attention_mask=torch.ones_like(ids)[None])
    true = codes[targets]
    size = token_ids.codebook_size
    semantic_logits = output.logits[0, before].float()
    band = semantic_logits[:, token_ids.semantic_start : token_ids.semantic_start + size]
    backbone = band.argmax(-1)
    tower_logits = output.codebook_logits[0, before, :, :size].float()  # heads may be wider than the codec
    tower = tower_logits.argmax(-1)
    cross_entropy = [F.cross_entropy(semantic_logits, ids[targets], reduction="sum")]
    cross_entropy += [F.cross_entropy(tower_logits[:, k], true[:, k + 1], reduction="sum") for k in range(tower.shape[1])]
    correct = torch.cat([(backbone == true[:, 0]).sum()[None], (tower == true[:, 1:]).sum(0)])
    return {"true": true, "backbone": backbone, "tower": tower,
            "cross_entropy": torch.stack(cross_entropy), "correct": correct}


def variants(forced: dict) -> dict[str, torch.Tensor]:
    """The four codes [frames, num_codebooks] of `VARIANTS` from a `teacher_forced` result."""
    true, backbone, tower = forced["true"], forced["backbone"][:, None], forced["tower"]
    return {
        "true codes": true,
        "backbone codebook 0": torch.cat([backbone, true[:, 1:]], dim=1),
        "tower codebooks 1+": torch.cat([true[:, :1], tower], dim=1),
        "both predicted": torch.cat([backbone, tower], dim=1),
    }


def measure(model, processor, dataset, utterances: int = 12, seed: int = 0,
            transcribe: Callable = asr.transcribe, progress: bool = True) -> dict:
    """The three tables of the module docstring over `utterances` items of `dataset` (a
    `held_out_dataset`: its `source` is each item's audio file), every voice in turn."""
    from transformers_drama3.training import CloningCollator
    from transformers_drama3.training.collators import ReferencePool

    codec = processor.codec
    collator = CloningCollator(processor, ReferencePool(dataset, REFERENCE_FRAMES), max_references=1, seed=seed)
    levels = list(range(1, codec.num_codebooks + 1))
    heard = {"espeak original": [], "vocoder alone": [], **{f"first {k}": [] for k in levels}, **{v: [] for v in VARIANTS}}
    cross_entropy = torch.zeros(codec.num_codebooks, dtype=torch.float64)
    correct = torch.zeros(codec.num_codebooks, dtype=torch.float64)
    energy = torch.zeros(codec.num_codebooks, dtype=torch.float64)
    frames = 0
    model.eval()
    chosen = round_robin(dataset["speaker"], utterances)
    for index in tqdm(chosen, desc="bottleneck", unit="utterance", disable=not progress):
        example = dataset[index]
        text = plain_transcript(example["text"])  # what Whisper should hear: no styles, tags or pauses
        audio, rate = sf.read(example["source"], dtype="float32", always_2d=False)
        heard["espeak original"].append((transcribe(audio, rate), text))
        padded = F.pad(torch.from_numpy(audio), (0, -len(audio) % codec.hop_length))  # whole frames, as encoded
        codes = torch.as_tensor(example["codes"])[None]  # [1, num_codebooks, frames]: what the model trains on
        with torch.no_grad():
            log_mel = codec.log_mel(padded[None])
            heard["vocoder alone"].append((transcribe(codec.synthesize(log_mel)[0].clamp(-1, 1).numpy(), rate), text))
            for k in levels:
                sound = codec.synthesize(codec.dequantize(codes, levels=k))[0].clamp(-1, 1).numpy()
                heard[f"first {k}"].append((transcribe(sound, rate), text))
        rows, _ = collator.example_rows(example)
        forced = teacher_forced(model, processor, rows)
        cross_entropy += forced["cross_entropy"].double()
        correct += forced["correct"].double()
        energy += level_energy(codec, forced["true"][None].transpose(1, 2)).double()
        frames += len(forced["true"])
        for name, variant in variants(forced).items():
            sound = codec.decode(variant.T[None]).audio_values[0].numpy()
            heard[name].append((transcribe(sound, codec.sampling_rate), text))
    wer = {name: asr.corpus_wer(pairs) for name, pairs in heard.items()}
    return {
        "utterances": len(chosen),
        "frames": frames,
        "codec_wer": {name: wer[name] for name in ("espeak original", "vocoder alone", *(f"first {k}" for k in levels))},
        "levels": [{"codebook": k, "cross_entropy": float(cross_entropy[k] / frames), "accuracy": float(correct[k] / frames),
                    "energy_share": float(energy[k] / energy.sum())} for k in range(codec.num_codebooks)],
        "decomposition_wer": {name: wer[name] for name in VARIANTS},
        "heard": {name: [hypothesis for hypothesis, _ in pairs] for name, pairs in heard.items()},
        "texts": [text for _, text in heard["espeak original"]],
    }


def tables(result: dict) -> str:
    """The three tables as markdown."""
    lines = [f"held-out utterances: {result['utterances']} ({result['frames']} frames)", "",
             "| audio | WER |", "|---|---|"]
    lines += [f"| {name} | {wer:.1%} |" for name, wer in result["codec_wer"].items()]
    lines += ["", "| codebook | cross entropy (nats) | argmax accuracy | energy share |", "|---|---|---|---|"]
    lines += [f"| {row['codebook']} | {row['cross_entropy']:.2f} | {row['accuracy']:.1%} | {row['energy_share']:.1%} |"
              for row in result["levels"]]
    lines += ["", "| teacher-forced codes | WER |", "|---|---|"]
    lines += [f"| {name} | {wer:.1%} |" for name, wer in result["decomposition_wer"].items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.drama3_tiny.bottleneck", description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", required=True, type=Path)
    parser.add_argument("--model", required=True, type=Path, help="a model folder (model, processor and codec/)")
    parser.add_argument("--utterances", type=int, default=12)
    parser.add_argument("--cache", type=Path, help="where the held-out audio's codes are cached (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="write the result (with every transcript) here")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.utterances < 1:
        parser.error(f"--utterances must be at least 1; got {args.utterances}")
    torch.set_num_threads(args.threads)

    import tempfile

    from transformers_drama3.runtime.loading import load_model_and_processor

    model, processor = load_model_and_processor(str(args.model), "cpu", "float32", progress=False)
    if not hasattr(processor.codec, "codebooks"):
        raise SystemExit(f"--model {args.model}: its codec has no residual codebooks to take apart (the tiny mel codec has)")
    cache = args.cache or Path(tempfile.mkdtemp(prefix="bottleneck_codes-"))
    dataset = held_out_dataset(args.corpus, processor.codec, cache)
    result = measure(model, processor, dataset, utterances=args.utterances)
    print(tables(result))
    if args.json is not None:
        partial = args.json.with_name(args.json.name + ".partial")
        partial.write_text(json.dumps(result, indent=1), encoding="utf-8")
        partial.replace(args.json)


if __name__ == "__main__":
    main()
