"""Train the drama3-tiny codec on the espeak corpus (CPU, resumable, stopped by time).

    python -m transformers_drama3.tiny.codec_training --corpus CORPUS_DIR --out RUN_DIR \\
        [--resume] [--minutes 180] [--seed 0] [--threads 1]

RUN_DIR receives `checkpoint.pt` (model, optimizer, RNG and usage state: `--resume` continues
exactly where it stopped), `codec/` (the model in Hugging Face layout, loadable with
`Drama3CodecModel.from_pretrained`), `metrics.jsonl` (training averages, held-out evaluations)
and `train.log`. The recipe is in `codec_recipe.py`; docs/tiny_codec.md has the measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..codec import Drama3CodecConfig, Drama3CodecModel
from .codec_recipe import (
    CodebookUsage,
    MultiResolutionMelLoss,
    RecipeConfig,
    all_vector_quantizers,
    bypass_share,
    codebook_perplexity,
    commitment_ramp,
    draw_codebooks_per_item,
    initialise_for_training,
    learning_rate,
    reconstruct_for_training,
    restart_dead_codes,
    tiny_codec_config,
)

CHECKPOINT = "checkpoint.pt"


class CodecTraining:
    """One codec training run: model, optimizer, one seeded generator for every random choice
    (crops, quantiser dropout, warm-up bypass, restarts), and the codebook usage statistics.

    `train_audio` is a list of 1-D float tensors at the codec's rate. Everything a step depends on
    is in `state_dict()`, so a run saved after step n and loaded continues with the same step n + 1.
    """

    def __init__(self, config: Drama3CodecConfig, recipe: RecipeConfig, train_audio: Sequence[torch.Tensor], seed: int):
        config.validate_codec_sizes()
        if not train_audio:
            raise ValueError("train_audio is empty; expected at least one utterance")
        self.config, self.recipe, self.train_audio = config, recipe, list(train_audio)
        self.generator = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.model = Drama3CodecModel(config)
        initialise_for_training(self.model, self.generator)
        self.model.train()
        self.mel_loss = MultiResolutionMelLoss(config.sampling_rate, recipe.mel_fft_sizes, recipe.mel_bins)
        codebooks = [q.codebook.weight for q in all_vector_quantizers(self.model)]
        chosen = {id(p) for p in codebooks}
        self.optimizer = torch.optim.AdamW(
            [
                {"params": [p for p in self.model.parameters() if id(p) not in chosen], "lr_scale": 1.0},
                {"params": codebooks, "lr_scale": recipe.codebook_lr_scale},
            ],
            lr=recipe.learning_rate, betas=recipe.betas, weight_decay=recipe.weight_decay,
        )
        self.usage = CodebookUsage.empty(self.model, recipe.recent_vectors)
        self.step_count = 0

    # -- one step --------------------------------------------------------------------------

    def sample_batch(self) -> torch.Tensor:
        """Random crops `[batch_size, segment_frames * hop_length]` of random train utterances."""
        length = self.recipe.segment_frames * self.config.hop_length
        picks = torch.randint(0, len(self.train_audio), (self.recipe.batch_size,), generator=self.generator)
        crops = []
        for pick in picks.tolist():
            audio = self.train_audio[pick]
            start = int(torch.randint(0, max(1, len(audio) - length + 1), (), generator=self.generator))
            crop = audio[start : start + length]
            crops.append(F.pad(crop, (0, length - len(crop))))
        return torch.stack(crops)

    def losses(self, audio: torch.Tensor) -> dict[str, torch.Tensor]:
        """Forward pass on `audio` `[batch, samples]` with this step's dropout and bypass draws."""
        batch = audio.shape[0]
        kept = draw_codebooks_per_item(batch, self.config.num_codebooks, self.recipe.quantizer_dropout, self.generator)
        bypass = torch.rand(batch, generator=self.generator) < bypass_share(self.step_count, self.recipe)
        dither = self.recipe.input_dither * torch.randn(audio.shape, generator=self.generator)
        output, quantized = reconstruct_for_training(self.model, audio + dither, kept, bypass)
        recipe = self.recipe
        losses = {
            "mel": self.mel_loss(output, audio),
            "waveform": F.l1_loss(output, audio),
            "codebook": quantized["codebook_loss"],
            "commitment": quantized["commitment_loss"],
        }
        losses["total"] = (
            recipe.mel_weight * losses["mel"] + recipe.waveform_weight * losses["waveform"]
            + recipe.codebook_weight * losses["codebook"]
            + recipe.commitment_weight * commitment_ramp(self.step_count, recipe) * losses["commitment"]
        )
        losses["_codes"], losses["_projected"] = quantized["codes"], quantized["projected"]
        return losses

    def train_step(self, audio: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer step on `audio` `[batch, samples]` (default: a fresh random batch); returns
        the losses (floats), learning rate, bypass share and gradient norm."""
        lr = learning_rate(self.step_count, self.recipe)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]
        losses = self.losses(self.sample_batch() if audio is None else audio)
        self.optimizer.zero_grad(set_to_none=True)
        losses["total"].backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.recipe.grad_clip)
        self.optimizer.step()
        self.usage.update(losses["_codes"], losses["_projected"], self.recipe.usage_decay, self.generator)
        self.step_count += 1
        report = {k: float(v.detach()) for k, v in losses.items() if not k.startswith("_")}
        report.update(lr=lr, bypass=bypass_share(self.step_count - 1, self.recipe), grad_norm=float(grad_norm))
        if self.step_count % self.recipe.restart_every == 0 and self.step_count >= self.recipe.bypass_steps // 2:
            report["restarted"] = sum(
                restart_dead_codes(self.model, self.usage, self.recipe.restart_usage, self.generator, self.optimizer)
            )
        return report

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "step": self.step_count,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "usage": self.usage.state_dict(),
            "recipe": self.recipe.to_dict(),
            "config": self.config.to_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        self.usage.load_state_dict(state["usage"])
        self.step_count = state["step"]

    def save(self, out_dir: str | Path) -> None:
        """checkpoint.pt (written to a temporary name, then renamed) and codec/ (HF layout)."""
        out_dir = Path(out_dir)
        temporary = out_dir / (CHECKPOINT + ".tmp")
        torch.save(self.state_dict(), temporary)
        os.replace(temporary, out_dir / CHECKPOINT)
        self.model.save_pretrained(out_dir / "codec")

    @classmethod
    def resume(cls, out_dir: str | Path, train_audio: Sequence[torch.Tensor], seed: int) -> CodecTraining:
        """The run saved in `out_dir`, with its config and recipe, ready for the next step."""
        state = torch.load(Path(out_dir) / CHECKPOINT, weights_only=False)
        config = Drama3CodecConfig.from_dict(state["config"])
        recipe = state["recipe"]
        recipe = RecipeConfig(**{**recipe, "betas": tuple(recipe["betas"]), "mel_fft_sizes": tuple(recipe["mel_fft_sizes"]),
                                 "mel_bins": tuple(recipe["mel_bins"])})
        run = cls(config, recipe, train_audio, seed)
        run.load_state_dict(state)
        return run


# ---- held-out evaluation --------------------------------------------------------------------------


def resynthesize(model: Drama3CodecModel, audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inference round trip of one utterance `[samples]` -> (resynthesis `[samples]`, codes `[codebooks, frames]`)."""
    was_training = model.training
    model.eval()
    encoded = model.encode(audio[None], sampling_rate=model.sampling_rate)
    decoded = model.decode(encoded.audio_codes, encoded.lengths)
    model.train(was_training)
    return decoded.audio_values[0, : len(audio)], encoded.audio_codes[0]


def evaluate_reconstruction(run: CodecTraining, heldout: Sequence[torch.Tensor]) -> dict:
    """Held-out mel L1 (the training loss's measure) and per-codebook perplexity of the codes."""
    mel, codes = [], []
    with torch.no_grad():
        for audio in heldout:
            output, code = resynthesize(run.model, audio)
            mel.append(float(run.mel_loss(output[None], audio[None])))
            codes.append(code)
    sizes = [q.codebook_size for q in all_vector_quantizers(run.model)]
    perplexity = codebook_perplexity(torch.cat(codes, dim=-1)[None], sizes)
    return {"heldout_mel_l1": float(np.mean(mel)), "heldout_perplexity": [round(p, 1) for p in perplexity]}


class InstrumentPanel:
    """The issue's codec bar on a fixed held-out sample: per voice, `sentences` utterances;
    resemblyzer similarity of each resynthesis to its original, and MFCC-DTW identification of
    each resynthesis among the originals of the same voice (the other sentences as distractors)."""

    def __init__(self, by_voice: dict[str, list[torch.Tensor]], sampling_rate: int):
        from . import instruments

        self.instruments, self.sampling_rate, self.by_voice = instruments, sampling_rate, by_voice
        self.embeddings = {v: [instruments.speaker_embedding(a.numpy(), sampling_rate) for a in xs] for v, xs in by_voice.items()}
        self.mfccs = {v: [instruments.mfcc(a.numpy(), sampling_rate) for a in xs] for v, xs in by_voice.items()}

    def measure(self, model: Drama3CodecModel) -> dict:
        ins = self.instruments
        similarity, identified, per_voice = [], [], {}
        with torch.no_grad():
            for voice, originals in self.by_voice.items():
                outputs = [resynthesize(model, audio)[0].numpy() for audio in originals]
                sims = []
                for output, reference in zip(outputs, self.embeddings[voice]):
                    try:
                        sims.append(ins.speaker_similarity(ins.speaker_embedding(output, self.sampling_rate), reference))
                    except ValueError:  # nothing voiced left after resemblyzer's trimming
                        sims.append(0.0)
                rate = ins.dtw_identification_rate(
                    [ins.mfcc(o, self.sampling_rate) for o in outputs], self.mfccs[voice],
                    distractors=len(originals) - 1,
                )
                similarity += sims
                identified.append(rate)
                per_voice[voice] = {"similarity": round(float(np.mean(sims)), 3), "dtw_id": round(rate, 3)}
        return {
            "similarity": round(float(np.mean(similarity)), 4),
            "dtw_id": round(float(np.mean(identified)), 4),
            "per_voice": per_voice,
        }


# ---- corpus ---------------------------------------------------------------------------------------


def load_corpus(corpus_dir: str | Path, sampling_rate: int) -> tuple[list[torch.Tensor], list]:
    """Train waveforms (float tensors) and held-out records of a corpus built by `tiny.corpus`."""
    from .corpus import read_manifest, read_wav

    corpus_dir = Path(corpus_dir)
    manifest = corpus_dir / "manifest.jsonl"
    if not manifest.is_file():
        raise FileNotFoundError(f"{manifest} not found; build the corpus with `python -m transformers_drama3.tiny.corpus build`")
    records = read_manifest(manifest)
    train = []
    for record in records:
        if record.split != "train":
            continue
        samples, rate = read_wav(corpus_dir / record.wav)
        if rate != sampling_rate:
            raise ValueError(f"{record.wav} is at {rate} Hz; the codec trains at {sampling_rate} Hz")
        train.append(torch.from_numpy(samples.copy()))
    return train, [r for r in records if r.split == "heldout"]


def heldout_audio(corpus_dir: str | Path, records, per_voice: int) -> dict[str, list[torch.Tensor]]:
    """The first `per_voice` held-out sentences of each voice: voice -> waveforms."""
    from .corpus import read_wav

    out: dict[str, list[torch.Tensor]] = {}
    for record in sorted(records, key=lambda r: (r.voice, r.sentence_id)):
        bucket = out.setdefault(record.voice, [])
        if len(bucket) < per_voice:
            bucket.append(torch.from_numpy(read_wav(Path(corpus_dir) / record.wav)[0].copy()))
    return out


# ---- the command ----------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m transformers_drama3.tiny.codec_training", description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", required=True, help="corpus directory (manifest.jsonl + wavs/)")
    parser.add_argument("--out", required=True, help="run directory (checkpoint, codec/, metrics)")
    parser.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    parser.add_argument("--minutes", type=float, default=180.0, help="stop (and save) after this much wall time")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the machine is shared)")
    parser.add_argument("--checkpoint-minutes", type=float, default=5.0)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--eval-every", type=int, default=250, help="held-out mel L1 and perplexity")
    parser.add_argument("--instruments-every", type=int, default=1000, help="resemblyzer + MFCC-DTW on held-out")
    parser.add_argument("--eval-sentences", type=int, default=10, help="held-out sentences per voice for the instruments")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--segment-frames", type=int, default=None)
    parser.add_argument("--learning-rate", type=float, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_codec_config()
    train_audio, heldout_records = load_corpus(args.corpus, config.sampling_rate)
    if args.resume:
        if not (out / CHECKPOINT).is_file():
            parser.error(f"--resume: no {CHECKPOINT} in {out}")
        run = CodecTraining.resume(out, train_audio, args.seed)
    else:
        overrides = {k: v for k, v in (("batch_size", args.batch_size), ("segment_frames", args.segment_frames),
                                       ("learning_rate", args.learning_rate)) if v is not None}
        run = CodecTraining(config, RecipeConfig(**overrides), train_audio, args.seed)
    panel_audio = heldout_audio(args.corpus, heldout_records, args.eval_sentences)
    mel_sample = [xs[i] for xs in panel_audio.values() for i in range(min(3, len(xs)))]
    panel = InstrumentPanel(panel_audio, config.sampling_rate) if args.instruments_every > 0 else None

    metrics = open(out / "metrics.jsonl", "a", encoding="utf-8")

    def record(entry: dict) -> None:
        entry = {"step": run.step_count, "time": round(time.time(), 1), **entry}
        metrics.write(json.dumps(entry) + "\n")
        metrics.flush()

    parameters = sum(p.numel() for p in run.model.parameters())
    record({"event": "start", "resume": args.resume, "parameters": parameters, "train_utterances": len(train_audio),
            "frame_rate": config.frame_rate, "codebooks": config.num_codebooks, "recipe": run.recipe.to_dict()})
    started = last_save = time.time()
    totals: dict[str, float] = {}
    progress = tqdm(initial=run.step_count, total=args.max_steps, unit="step", dynamic_ncols=True, mininterval=10)
    while True:
        report = run.train_step()
        progress.update(1)
        for key, value in report.items():
            totals[key] = totals.get(key, 0.0) + value
        if run.step_count % args.log_every == 0:
            averaged = {k: round(v / args.log_every, 5) for k, v in totals.items() if k != "restarted"}
            averaged["restarted"] = int(totals.get("restarted", 0))
            averaged["perplexity_ema"] = [round(p, 1) for p in run.usage.perplexities()]
            averaged["seconds_per_step"] = round((time.time() - started) / max(1, run.step_count - progress.initial), 3)
            record({"event": "train", **averaged})
            progress.set_postfix(mel=averaged["mel"], ppl0=averaged["perplexity_ema"][0], bypass=round(averaged["bypass"], 2))
            totals = {}
        if args.eval_every and run.step_count % args.eval_every == 0:
            record({"event": "eval", **evaluate_reconstruction(run, mel_sample)})
        if panel is not None and run.step_count % args.instruments_every == 0:
            record({"event": "instruments", **panel.measure(run.model)})
        finished = (time.time() - started) / 60 >= args.minutes or (args.max_steps and run.step_count >= args.max_steps)
        if finished or (time.time() - last_save) / 60 >= args.checkpoint_minutes:
            run.save(out)
            last_save = time.time()
            record({"event": "checkpoint"})
        if finished:
            break
    progress.close()
    record({"event": "eval", **evaluate_reconstruction(run, mel_sample)})
    if panel is not None:
        record({"event": "instruments", **panel.measure(run.model)})
    metrics.close()


if __name__ == "__main__":
    main()
