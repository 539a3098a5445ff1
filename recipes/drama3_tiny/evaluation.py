"""Evaluate drama3-tiny on held-out sentences: content, voice, codec and behaviour.

    python -m recipes.drama3_tiny.evaluation [--model PATH] [--corpus CORPUS] [--sentences 40] [--voices A,B] [--json out.json]

The held-out set is the corpus's `heldout` split (sentences that no train utterance contains,
each rendered by espeak-ng in every voice); without `--corpus` the default corpus plan (seed 0)
is rendered to a temporary folder first (held-out sentences and the references only). Output i
speaks held-out sentence i in voice `voices[i % len(voices)]`, cloning that voice from the
record's reference: a different (train) utterance of the same voice.

Reported (numbers next to the bars of the drama3-tiny issue):
- content: Whisper tiny.en WER (`transformers_drama3.evaluation.asr`) on the espeak originals, their
  codec resyntheses and the model's outputs; the DTW identification rate (MFCC + DTW: is the output closer to the espeak rendering
  of its own sentence, same voice, than to 9 other held-out sentences'?) of resyntheses and outputs;
- voice: resemblyzer similarity of each output to its reference voice's enrolment centroid and to
  the other voices', and the share of outputs whose nearest centroid is the reference voice;
- codec: resemblyzer similarity of each resynthesis to its original;
- behaviour: the share of takes that end with `<|im_end|>` (not the frame budget) and the
  duration ratio to the espeak original (share within 0.6x-1.6x);
- text reliance: the teacher-forced semantic loss of each original's codes given its own text and
  given another held-out sentence's text (same reference): how much the model reads the text;
- directions (`--direction-sentences`, default 8): each held-out sentence is spoken in pairs that
  differ only in one direction (same reference, same seed): (slow) vs (fast) -> duration, (high)
  vs (low) -> median F0, plain vs <whisper> -> share of voiced frames, a mid-sentence [pause] vs
  none -> longest inner pause. Reported: the share of pairs that move the way the direction says
  (by a margin, `DIRECTION_MARGINS`), for the model, for espeak itself on the same texts and for
  the codec's resyntheses of espeak's renderings (what the codec lets through: the model's
  ceiling), and the median size of each effect.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from transformers_drama3.output_files import check_output_path, write_text_atomic
from transformers_drama3.runtime.loading import EXIT_USAGE, CommandError, load_model_and_processor
from transformers_drama3.tiny import shipped

ENROLMENT_UTTERANCES = 6
"""Train utterances per voice averaged into the voice's centroid (none is a reference used here)."""
DURATION_BOUNDS = (0.6, 1.6)
DIRECTION_MARGINS = {"rate": 1.1, "pitch": 1.0, "whisper": 0.2, "pause": 0.2}
"""A pair follows its direction when slow/fast duration > 1.1x, high over low F0 > 1 semitone,
plain minus whisper voiced share > 0.2, pause minus no-pause longest pause > 0.2 s."""
DIRECTION_UNITS = {"rate": "x duration", "pitch": "semitones", "whisper": "voiced share", "pause": "s"}


@dataclass
class TinyEvaluation:
    """The numbers the evaluation reports (see the module docstring)."""

    outputs: int = 0
    voices: list[str] = field(default_factory=list)
    wer_originals: float = math.nan
    wer_resyntheses: float = math.nan
    wer_outputs: float = math.nan
    dtw_resyntheses: float = math.nan
    dtw_outputs: float = math.nan
    codec_similarity: float = math.nan
    similarity_to_reference_voice: float = math.nan
    similarity_to_other_voices: float = math.nan
    voice_identification: float = math.nan
    stopped_by_itself: float = math.nan
    duration_ratio_median: float = math.nan
    duration_within_bounds: float = math.nan
    semantic_loss_right_text: float = math.nan
    semantic_loss_wrong_text: float = math.nan
    seconds_generated: float = 0.0
    directions: dict = field(default_factory=dict)
    """direction -> {"pairs", "followed", "espeak_followed", "codec_followed", "effect", "espeak_effect",
    "codec_effect"} (medians; codec = the codec's resyntheses of espeak's renderings, the ceiling)."""
    per_output: list[dict] = field(default_factory=list)

    def table(self) -> str:
        """Markdown: each measure, its value, its bar and whether the bar is met. A measure that
        cannot be taken (e.g. telling voices apart with one voice) reads "n/a", never nan."""
        rows = [
            ("outputs (held-out sentences x voices)", f"{self.outputs} ({', '.join(self.voices)})", "", None),
            ("WER espeak originals (Whisper tiny.en)", _shown(self.wer_originals, "{:.1%}"), "reference point", None),
            ("WER codec resyntheses", _shown(self.wer_resyntheses, "{:.1%}"), "<= 15%",
             _bar(self.wer_resyntheses, lambda v: v <= 0.15)),
            ("WER model outputs", _shown(self.wer_outputs, "{:.1%}"), "<= 35%", _bar(self.wer_outputs, lambda v: v <= 0.35)),
            ("DTW identification, resyntheses", _shown(self.dtw_resyntheses, "{:.1%}"), ">= 95%",
             _bar(self.dtw_resyntheses, lambda v: v >= 0.95)),
            ("DTW identification, outputs", _shown(self.dtw_outputs, "{:.1%}"), ">= 80% (chance 10%)",
             _bar(self.dtw_outputs, lambda v: v >= 0.80)),
            ("codec: similarity resynthesis-original", _shown(self.codec_similarity, "{:.3f}"), ">= 0.80",
             _bar(self.codec_similarity, lambda v: v >= 0.80)),
            ("output similarity to reference voice", _shown(self.similarity_to_reference_voice, "{:.3f}"), "", None),
            ("output similarity to other voices", _shown(self.similarity_to_other_voices, "{:.3f}", ONE_VOICE), "", None),
            ("voice identification of outputs", _shown(self.voice_identification, "{:.1%}", ONE_VOICE), ">= 80%",
             _bar(self.voice_identification, lambda v: v >= 0.80)),
            ("takes that stop by themselves", _shown(self.stopped_by_itself, "{:.1%}"), ">= 95%",
             _bar(self.stopped_by_itself, lambda v: v >= 0.95)),
            ("duration ratio to espeak (median)", _shown(self.duration_ratio_median, "{:.2f}"), "", None),
            ("durations within 0.6x-1.6x", _shown(self.duration_within_bounds, "{:.1%}"), "", None),
            ("teacher-forced semantic loss, right text", _shown(self.semantic_loss_right_text, "{:.3f}"),
             "lower than wrong text", _bar(self.semantic_loss_wrong_text - self.semantic_loss_right_text, lambda gap: gap > 0)),
            ("teacher-forced semantic loss, another sentence's text", _shown(self.semantic_loss_wrong_text, "{:.3f}"), "", None),
        ]
        for name, numbers in self.directions.items():
            unit = DIRECTION_UNITS[name]
            rows.append((
                f"direction {name}: pairs that follow it (espeak / codec resynthesis)",
                f"{_shown(numbers['followed'], '{:.0%}')} of {numbers['pairs']} "
                f"({_shown(numbers['espeak_followed'], '{:.0%}')} / {_shown(numbers['codec_followed'], '{:.0%}')})",
                f"median effect {_shown(numbers['effect'], '{:.2f}')} {unit} "
                f"(espeak {_shown(numbers['espeak_effect'], '{:.2f}')} / codec {_shown(numbers['codec_effect'], '{:.2f}')})",
                None,
            ))
        lines = ["| measure | value | bar | met |", "|---|---|---|---|"]
        lines += [f"| {name} | {value} | {bar} | {'' if met is None else met} |" for name, value, bar, met in rows]
        return "\n".join(lines)


ONE_VOICE = "n/a (needs 2 or more voices)"


def _shown(value: float, style: str, missing: str = "n/a") -> str:
    """`value` in `style`, or `missing` when it could not be measured (nan)."""
    return missing if value is None or math.isnan(value) else style.format(value)


def _bar(value: float, meets) -> str:
    """"met" / "not met" for a measured value, "n/a" when it could not be measured."""
    if value is None or math.isnan(value):
        return "n/a"
    return "met" if meets(value) else "not met"


def render_heldout_corpus(out_dir: Path, voices: list[str], progress: bool = True) -> Path:
    """Render, from drama3-tiny's corpus plan (`lm_recipe.TINY_CORPUS_PLAN`, a pure function of its
    seed), only what the evaluation needs: the held-out records, their references and a few
    enrolment utterances per voice. Returns `out_dir` (wavs/ + manifest.jsonl)."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm.auto import tqdm

    from .corpus import VOICES_BY_NAME, plan_corpus, render_record, write_manifest
    from .lm_recipe import TINY_CORPUS_PLAN

    plan = dict(TINY_CORPUS_PLAN)
    plan["voices"] = [VOICES_BY_NAME[name] for name in plan["voices"]]
    planned = plan_corpus(**plan)
    heldout = [r for r in planned if r.split == "heldout" and r.voice in voices]
    wanted = {r.reference_id for r in heldout}
    for voice in voices:
        plain = [r for r in planned if r.voice == voice and r.split == "train" and not r.directions
                 and r.language == "en" and r.id not in wanted]
        wanted |= {r.id for r in plain[:ENROLMENT_UTTERANCES]}
    selected = heldout + [r for r in planned if r.id in wanted]
    (out_dir / "wavs").mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=2) as pool:
        rendered = list(tqdm(pool.map(lambda r: render_record(r, out_dir), selected), total=len(selected),
                             desc="espeak-ng (held-out set)", unit="utt", disable=not progress))
    write_manifest(out_dir / "manifest.jsonl", rendered)
    return out_dir


def heldout_set(corpus: Path | None, sentences: int, voices: list[str], work: Path):
    """(records of the outputs, every held-out record by (voice, sentence_id), all records, corpus dir)."""
    from .corpus import read_manifest

    if corpus is None:
        corpus = render_heldout_corpus(work / "corpus", voices)
    records = read_manifest(corpus / "manifest.jsonl")
    heldout = {(r.voice, r.sentence_id): r for r in records if r.split == "heldout" and r.voice in voices}
    sentence_ids = sorted({sentence for _, sentence in heldout})
    if len(sentence_ids) < sentences:
        raise ValueError(f"the corpus has {len(sentence_ids)} held-out sentences; --sentences asks for {sentences}")
    chosen = [heldout[(voices[i % len(voices)], sentence_ids[i])] for i in range(sentences)]
    return chosen, heldout, records, corpus


def text_reliance(model, processor, text: str, other_text: str, reference_text: str, reference_codes, target_codes):
    """Teacher-forced semantic loss of a take given its own text and given another sentence's text
    (same reference, same target audio): a model that reads the text scores the first lower."""
    import torch

    from transformers_drama3.prompting import Reference, Script

    losses = []
    for lines in (text, other_text):
        script = Script(lines=lines, references=[Reference(transcript=reference_text, audio=reference_codes, speaker=0)],
                        target=target_codes)
        batch = processor([script], padding_side="right")
        with torch.no_grad():
            output = model(**{key: value.to(model.device) for key, value in batch.items()})
        losses.append(float(output.semantic_loss))
    return losses[0], losses[1]


def direction_pairs(transcript: str) -> dict[str, tuple[str, str]]:
    """direction -> (directed text that should show more of the measure, text that should show less)."""
    words = transcript.split()
    middle = max(1, len(words) // 2)
    paused = " ".join(words[:middle]) + " [pause] " + " ".join(words[middle:])
    return {
        "rate": (f"(slow) {transcript}", f"(fast) {transcript}"),
        "pitch": (f"(high) {transcript}", f"(low) {transcript}"),
        "whisper": (transcript, f"<whisper>{transcript}</whisper>"),
        "pause": (paused.strip(), transcript),
    }


def direction_effect(direction: str, more, less, sampling_rate: int) -> float:
    """How much more of its measure `more` shows than `less` (both waveforms at `sampling_rate`)."""
    from . import instruments as I

    if direction == "rate":
        return len(more) / max(len(less), 1)
    if direction == "pitch":
        return float(12 * np.log2(I.median_pitch(more, sampling_rate) / I.median_pitch(less, sampling_rate)))
    if direction == "whisper":
        return I.voiced_share(more, sampling_rate) - I.voiced_share(less, sampling_rate)
    return I.longest_pause(more, sampling_rate) - I.longest_pause(less, sampling_rate)


def resynthesize(codec, audio: np.ndarray, rate: int):
    """`audio` through the codec and back: (its encoding, the resynthesised waveform)."""
    encoded = codec.encode(audio, sampling_rate=rate)
    return encoded, codec.decode(encoded.audio_codes, encoded.lengths).audio_values[0].cpu().numpy()


def direction_following(model, processor, chosen, by_id, load, sentences: int, seed: int = 0,
                        progress: bool = True, **sampling) -> dict:
    """The directions part of the evaluation (module docstring) on the first `sentences` records."""
    from tqdm.auto import tqdm

    from .corpus import SAMPLING_RATE, VOICES_BY_NAME, synthesize

    effects = {name: {"model": [], "espeak": [], "codec": []} for name in DIRECTION_MARGINS}
    jobs = [(record, name, texts) for record in chosen[:sentences]
            for name, texts in direction_pairs(record.transcript).items()]
    spoken: dict[tuple[str, str], np.ndarray] = {}
    codec = processor.codec
    for index, (record, name, texts) in enumerate(tqdm(jobs, desc="drama3-tiny directions", disable=not progress)):
        reference = by_id[record.reference_id]
        reference_audio, reference_rate = load(reference)
        takes, renders = [], []
        for text in texts:
            key = (record.id, text)
            if key not in spoken:
                inputs = processor(text, reference_audio=[reference_audio], reference_text=[reference.transcript],
                                   sampling_rate=reference_rate)
                output = model.generate(**inputs, seed=seed + index, codec=codec, return_dict_in_generate=True,
                                        **sampling)
                spoken[key] = output.audio[0].detach().cpu().float().numpy()
            takes.append(spoken[key])
            renders.append(synthesize(text, VOICES_BY_NAME[record.voice]))
        effects[name]["espeak"].append(direction_effect(name, *renders, SAMPLING_RATE))
        resyntheses = [resynthesize(codec, render, SAMPLING_RATE)[1] for render in renders]
        effects[name]["codec"].append(direction_effect(name, *resyntheses, codec.sampling_rate))
        if min(len(take) for take in takes) < codec.hop_length:
            effects[name]["model"].append(math.nan)  # an empty take follows nothing
        else:
            effects[name]["model"].append(direction_effect(name, *takes, codec.sampling_rate))
    summary = {}
    for name, measured in effects.items():
        margin = DIRECTION_MARGINS[name]
        model_effects = np.array(measured["model"], dtype=float)
        espeak_effects = np.array(measured["espeak"], dtype=float)
        codec_effects = np.array(measured["codec"], dtype=float)
        summary[name] = {
            "pairs": len(model_effects),
            "followed": float(np.mean(np.nan_to_num(model_effects, nan=-np.inf) > margin)),
            "espeak_followed": float(np.mean(espeak_effects > margin)),
            "codec_followed": float(np.mean(np.nan_to_num(codec_effects, nan=-np.inf) > margin)),
            "effect": float(np.nanmedian(model_effects)) if np.isfinite(model_effects).any() else math.nan,
            "espeak_effect": float(np.median(espeak_effects)),
            "codec_effect": float(np.nanmedian(codec_effects)) if np.isfinite(codec_effects).any() else math.nan,
        }
    return summary


def evaluate(model, processor, corpus: Path | None = None, sentences: int = 40, voices=("A", "B"),
             seed: int = 0, progress: bool = True, direction_sentences: int = 8, **sampling) -> TinyEvaluation:
    """Run the evaluation (see the module docstring) and return its numbers."""
    import torch
    from tqdm.auto import tqdm

    from . import instruments as I
    from .corpus import read_wav

    voices = list(voices)
    if sentences < 10:
        raise ValueError(f"--sentences {sentences}: need at least 10 (the DTW test draws 9 distractors)")
    with tempfile.TemporaryDirectory() as scratch:
        chosen, heldout, records, corpus = heldout_set(corpus, sentences, voices, Path(scratch))
        by_id = {r.id: r for r in records}
        codec = processor.codec
        result = TinyEvaluation(outputs=len(chosen), voices=voices)

        def load(record):
            samples, rate = read_wav(corpus / record.wav)
            return samples, rate

        # voice centroids from train utterances that are not the references used below
        references_used = {r.reference_id for r in chosen}
        centroids = {}
        for voice in voices:
            pool = [r for r in records if r.voice == voice and r.split == "train" and r.id not in references_used
                    and (corpus / r.wav).is_file()][:ENROLMENT_UTTERANCES]
            if not pool:
                raise ValueError(f"voice {voice}: no enrolment utterance in the corpus")
            centroids[voice] = I.voice_centroid([I.speaker_embedding(*load(r)) for r in pool])

        mfcc_renderings = {key: I.mfcc(*load(r)) for key, r in heldout.items() if key[1] in {c.sentence_id for c in chosen}}
        pairs = {"originals": [], "resyntheses": [], "outputs": []}
        dtw = {"resyntheses": [], "outputs": []}
        codec_similarities, own, other, identified, stopped, ratios = [], [], [], [], [], []
        rng = np.random.default_rng(seed)
        generated_seconds = 0.0
        right_losses, wrong_losses = [], []
        for index, record in enumerate(tqdm(chosen, desc="drama3-tiny eval", disable=not progress)):
            original, rate = load(record)
            reference = by_id[record.reference_id]
            reference_audio, reference_rate = load(reference)
            inputs = processor(
                record.directed_text,
                reference_audio=[reference_audio],
                reference_text=[reference.transcript],
                sampling_rate=reference_rate,
            )
            expected = len(original) / rate
            output = model.generate(
                **inputs, seed=seed + index, return_dict_in_generate=True, codec=codec, expected_seconds=expected,
                **sampling,
            )
            waveform = output.audio[0].detach().cpu().float().numpy()
            generated_seconds += len(waveform) / codec.sampling_rate
            encoded, resynthesis = resynthesize(codec, original, rate)
            other_text = chosen[(index + 1) % len(chosen)].directed_text
            right, wrong = text_reliance(model, processor, record.directed_text, other_text, reference.transcript,
                                         codec.encode(reference_audio, sampling_rate=reference_rate).audio_codes[0],
                                         encoded.audio_codes[0])
            right_losses.append(right)
            wrong_losses.append(wrong)

            pairs["originals"].append((I.transcribe(original, rate), record.transcript))
            pairs["resyntheses"].append((I.transcribe(resynthesis, codec.sampling_rate), record.transcript))
            heard = I.transcribe(waveform, codec.sampling_rate) if len(waveform) else ""
            pairs["outputs"].append((heard, record.transcript))

            same_voice = [key for key in mfcc_renderings if key[0] == record.voice and key[1] != record.sentence_id]
            distractors = [mfcc_renderings[same_voice[k]] for k in rng.choice(len(same_voice), 9, replace=False)]
            correct = mfcc_renderings[(record.voice, record.sentence_id)]
            dtw["resyntheses"].append(I.dtw_identifies(I.mfcc(resynthesis, codec.sampling_rate), correct, distractors))
            output_hit = len(waveform) > 0 and I.dtw_identifies(I.mfcc(waveform, codec.sampling_rate), correct, distractors)
            dtw["outputs"].append(output_hit)

            codec_similarities.append(I.speaker_similarity(I.speaker_embedding(original, rate),
                                                           I.speaker_embedding(resynthesis, codec.sampling_rate)))
            try:
                embedding = I.speaker_embedding(waveform, codec.sampling_rate)
            except ValueError:  # nothing voiced: counts as a miss
                embedding = None
            if embedding is not None:
                own.append(I.speaker_similarity(embedding, centroids[record.voice]))
                other.extend(I.speaker_similarity(embedding, centroids[v]) for v in voices if v != record.voice)
            identified.append(embedding is not None and I.identify_voice(embedding, centroids) == record.voice)
            stopped.append(output.finish_reasons[0] == "eos")
            ratio = (len(waveform) / codec.sampling_rate) / expected
            ratios.append(ratio)
            result.per_output.append({
                "id": record.id, "voice": record.voice, "reference": reference.id, "text": record.transcript,
                "heard": heard, "dtw_identified": bool(output_hit), "voice_identified": bool(identified[-1]),
                "finish": output.finish_reasons[0], "duration_ratio": round(ratio, 3),
            })

        result.wer_originals = I.corpus_wer(pairs["originals"])
        result.wer_resyntheses = I.corpus_wer(pairs["resyntheses"])
        result.wer_outputs = I.corpus_wer(pairs["outputs"])
        result.dtw_resyntheses = float(np.mean(dtw["resyntheses"]))
        result.dtw_outputs = float(np.mean(dtw["outputs"]))
        result.codec_similarity = float(np.mean(codec_similarities))
        result.similarity_to_reference_voice = float(np.mean(own)) if own else math.nan
        result.similarity_to_other_voices = float(np.mean(other)) if other else math.nan
        result.voice_identification = float(np.mean(identified))
        result.stopped_by_itself = float(np.mean(stopped))
        result.duration_ratio_median = float(np.median(ratios))
        low, high = DURATION_BOUNDS
        result.duration_within_bounds = float(np.mean([low <= r <= high for r in ratios]))
        result.seconds_generated = round(generated_seconds, 2)
        result.semantic_loss_right_text = float(np.mean(right_losses))
        result.semantic_loss_wrong_text = float(np.mean(wrong_losses))
        if direction_sentences:
            result.directions = direction_following(model, processor, chosen, by_id, load, direction_sentences,
                                                    seed, progress, **sampling)
        del torch
        return result


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m recipes.drama3_tiny.evaluation",
                                     description="evaluate drama3-tiny (or --model) on held-out espeak sentences")
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the bundled drama3-tiny)")
    parser.add_argument("--corpus", default=None, help="a built corpus folder (default: render the held-out set now)")
    parser.add_argument("--sentences", type=int, default=40)
    parser.add_argument("--voices", default="A,B", help="voices to speak in (the bundled model's: A and B)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--direction-sentences", type=int, default=8,
                        help="held-out sentences spoken in direction pairs (0: skip the directions part)")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the model's)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling (default: the model's)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", default=None, help="also write the numbers (and per-output rows) here")
    return parser.parse_args(argv)


def run_eval(args) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    source = args.model or shipped.TINY_MODEL_PATH
    if args.model is None and not shipped.is_available():
        raise CommandError("this installation carries no drama3-tiny; pass --model")
    if args.corpus and not (Path(args.corpus) / "manifest.jsonl").is_file():
        raise CommandError(f"--corpus {args.corpus}: no manifest.jsonl there; expected a corpus folder built by recipes.drama3_tiny.corpus")
    if args.json:
        try:
            check_output_path(args.json, "--json")
        except ValueError as error:
            raise CommandError(str(error)) from None
    model, processor = load_model_and_processor(source, "cpu", "float32")
    try:
        sampling = {key: value for key, value in (("temperature", args.temperature), ("top_p", args.top_p))
                    if value is not None}
        result = evaluate(model, processor, Path(args.corpus) if args.corpus else None, args.sentences,
                          [v.strip() for v in args.voices.split(",") if v.strip()], args.seed,
                          direction_sentences=args.direction_sentences, **sampling)
    except ValueError as error:
        raise CommandError(str(error)) from None
    print(result.table())
    if args.json:
        write_text_atomic(args.json, json.dumps(asdict(result), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def main(argv=None) -> int:
    """The command line; an error the user can fix is printed as one line (exit status 2)."""
    try:
        return run_eval(parse_args(argv))
    except CommandError as error:
        print(f"drama3-tiny evaluation: {error}", file=sys.stderr)
        return EXIT_USAGE


__all__ = ["TinyEvaluation", "evaluate", "parse_args", "run_eval", "main"]


if __name__ == "__main__":
    sys.exit(main())
