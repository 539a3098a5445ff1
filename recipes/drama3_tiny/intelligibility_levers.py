"""Which lever would let drama3-tiny's words through? Whisper WER of codec variants and of the LM.

    python -m recipes.drama3_tiny.intelligibility_levers codec [--voices A,B,D,F] [--sentences 8] [--fit-utterances 150] [--json out.json]
    python -m recipes.drama3_tiny.intelligibility_levers codecs --codecs CODEC[,CODEC...] [--sentences 12] [--json out.json]
    python -m recipes.drama3_tiny.intelligibility_levers lm [--voices A,B,D,F] [--model MODEL] [--json out.json]
    python -m recipes.drama3_tiny.intelligibility_levers recognisers [--voices A,B,D,F] [--sentences 12]

`codec`: the held-out sentences of `drama3 eval` (everyday English, no corpus holds them), spoken
by espeak-ng in each voice, go through variants of the log-mel codec and Whisper tiny.en writes
down what it hears. Variants, each a row:
  - the spectral representation alone (no quantiser: `synthesize(log_mel(audio))`), at the codec's
    settings and with more mel bands, a finer spectrogram hop, a larger FFT, more Griffin-Lim
    iterations; and the exact linear magnitude (no mel at all) through offline Griffin-Lim, the
    ceiling of any Griffin-Lim vocoder;
  - the shipped codec, and its first k codebooks only (k = 1..3);
  - codecs fitted here by k-means on a small freshly rendered corpus (`--fit-utterances` per
    voice) with 4, 8 and 10 codebooks of 256, and 4 of 1024: the trend with more codes on one
    corpus (the shipped codec was fitted on 12,000 utterances).
`codecs`: saved codecs (`mel_codec_fit`) on the same sentences, per voice, next to the originals.
`lm`: drama3-tiny speaks sentences of 1, 3, 6 and 10 or more words, and held-out sentences of its
own corpus grammar; per group the WER of the outputs and the median duration over espeak's, and
the seconds of "Hello." per voice.
`recognisers`: Whisper and pocketsphinx on the same originals and resyntheses, per voice.

Everything runs on one CPU thread; the numbers go into docs/tiny_codec.md and the recipe README.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import tempfile
import time
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from transformers_drama3.codec.mel_codec import Drama3MelCodecConfig, Drama3MelCodecModel, fit_residual_codebooks
from transformers_drama3.evaluation import asr
from transformers_drama3.evaluation.espeak import ESPEAK_RATE, TINY_VOICES, speak
from transformers_drama3.evaluation.intelligibility import HELDOUT_SENTENCES, resynthesize, speak_with_model
from transformers_drama3.output_files import write_text_atomic
from transformers_drama3.decoding.budget import expected_seconds_of_text
from transformers_drama3.tiny import shipped
from .instruments import SCORING_RATE, prepare
from .sentences import LENGTH_PROBES

# ---- codec levers -------------------------------------------------------------------------------

REPRESENTATIONS = {
    "log-mel 80, hop 256, n_fft 1024, GL 32 (shipped settings)": {},
    "log-mel 80, GL 100 iterations": {"griffin_lim_iterations": 100},
    "log-mel 128": {"n_mels": 128},
    "log-mel 80, hop 128": {"mel_hop_length": 128, "crossfade": 128},
    "log-mel 80, n_fft 2048": {"n_fft": 2048, "context_mel_frames": 8},
}
"""Row name -> `Drama3MelCodecConfig` changes of an unquantised variant (frame rate kept: 1024 samples)."""


def padded(audio: np.ndarray, hop: int) -> torch.Tensor:
    """audio [time] zero-padded to whole codec frames: [1, frames * hop]."""
    frames = -(-len(audio) // hop)
    return torch.from_numpy(np.pad(audio, (0, frames * hop - len(audio))))[None]


def unquantised(codec: Drama3MelCodecModel, audio: np.ndarray) -> np.ndarray:
    """`audio` through the codec's spectral representation and Griffin-Lim only (no codes)."""
    samples = padded(audio, codec.hop_length)
    return codec.synthesize(codec.log_mel(samples))[0, : len(audio)].numpy()


def linear_griffin_lim(audio: np.ndarray, n_fft: int = 1024, hop: int = 256, iterations: int = 32) -> np.ndarray:
    """The exact STFT magnitude of `audio`, phases forgotten and rebuilt by offline fast Griffin-Lim
    (momentum 0.99, the codec's): what Griffin-Lim can do with a perfect spectrogram."""
    window = torch.hann_window(n_fft)
    signal = torch.from_numpy(audio)
    magnitude = torch.stft(signal, n_fft, hop, window=window, return_complex=True).abs()
    phase = torch.rand(magnitude.shape, generator=torch.Generator().manual_seed(0)) * 2 * math.pi
    spectrum, previous = torch.polar(magnitude, phase), None
    for _ in range(iterations):
        rebuilt = torch.stft(torch.istft(spectrum, n_fft, hop, window=window, length=len(audio)), n_fft, hop,
                             window=window, return_complex=True)
        accelerated = rebuilt if previous is None else rebuilt + 0.99 * (rebuilt - previous)
        previous = rebuilt
        spectrum = magnitude * torch.exp(1j * torch.angle(accelerated))
    return torch.istft(spectrum, n_fft, hop, window=window, length=len(audio)).numpy()


def first_codebooks(codec: Drama3MelCodecModel, count: int) -> Drama3MelCodecModel:
    """A copy of `codec` that keeps only its first `count` codebooks."""
    config = copy.deepcopy(codec.config)
    config.num_codebooks = count
    smaller = Drama3MelCodecModel(config).eval()
    with torch.no_grad():
        smaller.feature_mean.copy_(codec.feature_mean)
        smaller.feature_scale.copy_(codec.feature_scale)
        smaller.codebooks.copy_(codec.codebooks[:count])
    return smaller


def fitting_features(voices: list[str], utterances: int, work: Path) -> torch.Tensor:
    """Codec frame vectors [frames, 320] of a small corpus rendered from drama3-tiny's corpus plan
    (same grammar, directions and voices; `utterances` per voice, every one used)."""
    from .corpus import VOICES_BY_NAME, build_corpus, read_wav

    records = build_corpus(work / "fit", seed=1, utterances_per_voice=utterances, heldout_sentences=0,
                           voices=[VOICES_BY_NAME[name] for name in voices], spanish_rate=0.05, progress=False)
    reference = Drama3MelCodecModel(Drama3MelCodecConfig()).eval()
    features = []
    with torch.no_grad():
        for record in records:
            samples, _ = read_wav(work / "fit" / record.wav)
            features.append(reference.features(reference.log_mel(padded(samples, reference.hop_length)))[0])
    return torch.cat(features)


def fitted_codec(features: torch.Tensor, num_codebooks: int, codebook_size: int) -> Drama3MelCodecModel:
    """A shipped-settings codec whose `num_codebooks` x `codebook_size` codebooks k-means fits on `features`."""
    codec = Drama3MelCodecModel(Drama3MelCodecConfig(num_codebooks=num_codebooks, codebook_size=codebook_size)).eval()
    mean, scale = features.mean(0), features.std(0).clamp_min(1e-3)
    with torch.no_grad():
        codec.feature_mean.copy_(mean)
        codec.feature_scale.copy_(scale)
        codec.codebooks.copy_(fit_residual_codebooks((features - mean) / scale, num_codebooks, codebook_size,
                                                     iterations=15, seed=0, progress=False))
    return codec


def score(name: str, render, originals: list[tuple[str, str, np.ndarray]], rate: int) -> dict:
    """Whisper WER of `render(original)` over every (voice, sentence, original); one row."""
    started = time.perf_counter()
    heard = [(asr.transcribe(render(audio), rate), text) for _, text, audio in
             tqdm(originals, desc=name[:40], leave=False)]
    return {"variant": name, "wer": asr.corpus_wer(heard), "utterances": len(heard),
            "seconds": round(time.perf_counter() - started, 1), "heard": [h for h, _ in heard]}


def codec_levers(voices: list[str], sentences: int, fit_utterances: int) -> list[dict]:
    originals = [(voice, text, speak(text, TINY_VOICES[voice])) for voice in voices
                 for text in HELDOUT_SENTENCES[:sentences]]
    rows = [score("espeak originals", lambda audio: audio, originals, ESPEAK_RATE)]
    rows.append(score("linear magnitude (no mel), offline GL 32", linear_griffin_lim, originals, ESPEAK_RATE))
    for name, changes in REPRESENTATIONS.items():
        codec = Drama3MelCodecModel(Drama3MelCodecConfig(**changes)).eval()
        rows.append(score(f"unquantised {name}", lambda audio, c=codec: unquantised(c, audio), originals, ESPEAK_RATE))
    shipped_codec = Drama3MelCodecModel.from_pretrained(f"{shipped.TINY_MODEL_PATH}/codec").eval()
    count = shipped_codec.num_codebooks
    for k in range(1, count + 1):
        codec = shipped_codec if k == count else first_codebooks(shipped_codec, k)
        rows.append(score(f"shipped codec, first {k} of {count} codebooks x {codec.config.codebook_size}",
                          lambda audio, c=codec: resynthesize(c, audio, ESPEAK_RATE), originals, ESPEAK_RATE))
    with tempfile.TemporaryDirectory() as work:
        started = time.perf_counter()
        features = fitting_features(voices, fit_utterances, Path(work))
        print(f"fitting corpus: {len(features)} frames ({len(features) / 21.53 / 60:.1f} min) "
              f"in {time.perf_counter() - started:.0f} s")
    for codebooks, size in ((4, 256), (8, 256), (10, 256), (4, 1024)):
        started = time.perf_counter()
        codec = fitted_codec(features, codebooks, size)
        fit_seconds = time.perf_counter() - started
        row = score(f"fitted here: {codebooks} codebooks x {size}",
                    lambda audio, c=codec: resynthesize(c, audio, ESPEAK_RATE), originals, ESPEAK_RATE)
        row["fit_seconds"] = round(fit_seconds, 1)
        rows.append(row)
    return rows


def saved_codecs(paths: list[str], voices: list[str], sentences: int) -> list[dict]:
    """Whisper WER per voice of saved codecs' resyntheses next to the espeak originals, on the
    first `sentences` held-out sentences of `drama3 eval` (its instrument and voices)."""
    originals = {voice: [(text, speak(text, TINY_VOICES[voice])) for text in HELDOUT_SENTENCES[:sentences]]
                 for voice in voices}
    renders = {"espeak originals": lambda audio: audio}
    for path in paths:
        codec = Drama3MelCodecModel.from_pretrained(path).eval()
        name = f"{path}: {codec.num_codebooks} x {codec.config.codebook_size}"
        renders[name] = lambda audio, c=codec: resynthesize(c, audio, ESPEAK_RATE)
    rows = []
    for name, render in renders.items():
        per_voice = {voice: [(asr.transcribe(render(audio), ESPEAK_RATE), text) for text, audio in
                             tqdm(originals[voice], desc=f"{name[-30:]} {voice}", leave=False)] for voice in voices}
        rows.append({"variant": name, "utterances": sum(map(len, per_voice.values())),
                     "wer": asr.corpus_wer([pair for pairs in per_voice.values() for pair in pairs]),
                     **{f"wer_{voice}": asr.corpus_wer(pairs) for voice, pairs in per_voice.items()},
                     "heard": {voice: [h for h, _ in pairs] for voice, pairs in per_voice.items()}})
        print(f"{name}: WER {rows[-1]['wer']:.1%} " + " ".join(f"{v} {rows[-1]['wer_' + v]:.1%}" for v in voices),
              flush=True)
    return rows


def saved_codecs_table(rows: list[dict], voices: list[str]) -> str:
    lines = ["| variant | Whisper WER | " + " / ".join(voices) + " | utterances |", "|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['wer']:.1%} | " + " / ".join(f"{r['wer_' + v]:.0%}" for v in voices)
              + f" | {r['utterances']} |" for r in rows]
    return "\n".join(lines)


# ---- LM levers ----------------------------------------------------------------------------------

LENGTH_GROUPS = {**LENGTH_PROBES, "10+ words": HELDOUT_SENTENCES[:3]}


def corpus_heldout_sentences(count: int) -> list[str]:
    """The first `count` held-out sentences of drama3-tiny's corpus plan (its grammar, never trained on)."""
    from .corpus import VOICES_BY_NAME, plan_corpus
    from .lm_recipe import TINY_CORPUS_PLAN

    plan = {**TINY_CORPUS_PLAN, "voices": [VOICES_BY_NAME[name] for name in TINY_CORPUS_PLAN["voices"]]}
    seen, sentences = set(), []
    for record in plan_corpus(**plan):
        if record.split == "heldout" and not record.directions and record.transcript not in seen:
            seen.add(record.transcript)
            sentences.append(record.transcript)
    return sentences[:count]


def lm_levers(voices: list[str], model_path: str | None = None) -> list[dict]:
    """`model_path` (drama3-tiny's bundled model by default) speaks every group of `LENGTH_GROUPS`
    and held-out sentences of its corpus grammar in each voice (the bundled reference clips)."""
    from transformers_drama3.runtime.loading import load_model_and_processor

    model, processor = load_model_and_processor(model_path or shipped.TINY_MODEL_PATH, "cpu", "float32", progress=False)
    groups = {**LENGTH_GROUPS, "corpus grammar, held out": tuple(corpus_heldout_sentences(3))}
    rows = []
    for group, sentences in groups.items():
        takes = []
        for voice in voices:
            reference = shipped.reference_voice(voice)
            for index, sentence in enumerate(sentences):
                # the budget from the words, not the tokens: a phoneme model spends ~3x the tokens
                output, finish = speak_with_model(model, processor, sentence, reference, seed=index, threads=1,
                                                  expected_seconds=expected_seconds_of_text(sentence))
                espeak_seconds = len(speak(sentence, TINY_VOICES[voice])) / ESPEAK_RATE
                seconds = len(output) / processor.codec.sampling_rate
                takes.append({"voice": voice, "text": sentence, "finish": finish, "seconds": round(seconds, 2),
                              "espeak_seconds": round(espeak_seconds, 2),
                              "heard": asr.transcribe(output, processor.codec.sampling_rate)})
        rows.append({
            "group": group, "takes": len(takes), "wer": asr.corpus_wer([(t["heard"], t["text"]) for t in takes]),
            "duration_ratio_median": float(np.median([t["seconds"] / t["espeak_seconds"] for t in takes])),
            "seconds_median": float(np.median([t["seconds"] for t in takes])),
            "espeak_seconds_median": float(np.median([t["espeak_seconds"] for t in takes])),
            "stopped": float(np.mean([t["finish"] == "eos" for t in takes])), "per_take": takes,
        })
        print(f"{group}: WER {rows[-1]['wer']:.1%}, duration/espeak {rows[-1]['duration_ratio_median']:.2f}", flush=True)
    return rows


# ---- recognisers --------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _pocketsphinx():
    try:
        from pocketsphinx import Decoder
    except ImportError as error:
        raise ImportError("transcribe_pocketsphinx needs pocketsphinx: pip install pocketsphinx==5.1.1") from error
    return Decoder(samprate=SCORING_RATE, loglevel="FATAL")


def transcribe_pocketsphinx(waveform, sampling_rate: int) -> str:
    """What pocketsphinx (5.x, its bundled en-us model; no longer an instrument of the evaluation)
    hears; lower-case words. The audio goes through `prepare` (16 kHz, dither) and is decoded as
    one utterance."""
    audio = prepare(waveform, sampling_rate)
    pcm = np.clip(np.round(audio * 32767.0), -32768, 32767).astype("<i2")
    decoder = _pocketsphinx()
    decoder.start_utt()
    decoder.process_raw(pcm.tobytes(), no_search=False, full_utt=True)
    decoder.end_utt()
    hypothesis = decoder.hyp()
    return hypothesis.hypstr if hypothesis is not None else ""


def recognisers(voices: list[str], sentences: int) -> list[dict]:
    """Whisper and pocketsphinx side by side on the same espeak originals and codec resyntheses,
    per voice: does pocketsphinx still tell a good rendering from a worse one?"""
    codec = Drama3MelCodecModel.from_pretrained(f"{shipped.TINY_MODEL_PATH}/codec").eval()
    rows = []
    for voice in voices:
        heard = {(name, kind): [] for name in ("whisper", "pocketsphinx") for kind in ("originals", "resyntheses")}
        for text in tqdm(HELDOUT_SENTENCES[:sentences], desc=f"voice {voice}", leave=False):
            original = speak(text, TINY_VOICES[voice])
            audio = {"originals": (original, ESPEAK_RATE),
                     "resyntheses": (resynthesize(codec, original, ESPEAK_RATE), codec.sampling_rate)}
            for kind, (waveform, rate) in audio.items():
                heard["whisper", kind].append((asr.transcribe(waveform, rate), text))
                heard["pocketsphinx", kind].append((transcribe_pocketsphinx(waveform, rate), text))
        for name in ("whisper", "pocketsphinx"):
            rows.append({"voice": voice, "recogniser": name, "utterances": sentences,
                         **{kind: asr.corpus_wer(heard[name, kind]) for kind in ("originals", "resyntheses")}})
    return rows


def recogniser_table(rows: list[dict]) -> str:
    lines = ["| voice | recogniser | WER espeak originals | WER codec resyntheses | utterances |", "|---|---|---|---|---|"]
    lines += [f"| {r['voice']} | {r['recogniser']} | {r['originals']:.1%} | {r['resyntheses']:.1%} | {r['utterances']} |"
              for r in rows]
    return "\n".join(lines)


def codec_table(rows: list[dict]) -> str:
    lines = ["| variant | Whisper WER | utterances |", "|---|---|---|"]
    lines += [f"| {row['variant']} | {row['wer']:.1%} | {row['utterances']} |" for row in rows]
    return "\n".join(lines)


def lm_table(rows: list[dict]) -> str:
    lines = ["| sentences | takes | WER outputs | seconds (median) | espeak seconds (median) | duration / espeak | stop |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['group']} | {r['takes']} | {r['wer']:.1%} | {r['seconds_median']:.2f} | "
              f"{r['espeak_seconds_median']:.2f} | {r['duration_ratio_median']:.2f} | {r['stopped']:.0%} |" for r in rows]
    hello = [t for r in rows if r["group"] == "1 word" for t in r["per_take"] if t["text"] == "Hello."]
    lines.append("")
    lines.append('"Hello.": ' + ", ".join(f"{t['voice']} {t['seconds']:.2f} s (espeak {t['espeak_seconds']:.2f} s)"
                                          for t in hello))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.drama3_tiny.intelligibility_levers",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("codec", "codecs", "lm", "recognisers"))
    parser.add_argument("--codecs", default="", help="codecs part: saved codec folders, comma-separated")
    parser.add_argument("--voices", default="A,B,D,F")
    parser.add_argument("--sentences", type=int, default=8, help="codec part: the first N held-out sentences of drama3 eval")
    parser.add_argument("--fit-utterances", type=int, default=150, help="codec part: corpus utterances per voice to fit on")
    parser.add_argument("--model", default=None, help="lm part: a model folder (default: the bundled drama3-tiny)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    voices = [name.strip() for name in args.voices.split(",") if name.strip()]
    unknown = [name for name in voices if name not in TINY_VOICES]
    if unknown:
        parser.error(f"--voices: {unknown[0]!r} is not one of {sorted(TINY_VOICES)}")
    started = time.perf_counter()
    if args.part == "codec":
        rows = codec_levers(voices, args.sentences, args.fit_utterances)
        print(codec_table(rows))
    elif args.part == "codecs":
        paths = [path for path in args.codecs.split(",") if path]
        if not paths:
            parser.error("codecs: give --codecs DIR[,DIR...]")
        rows = saved_codecs(paths, voices, args.sentences)
        print(saved_codecs_table(rows, voices))
    elif args.part == "lm":
        rows = lm_levers(voices, args.model)
        print(lm_table(rows))
    else:
        rows = recognisers(voices, args.sentences)
        print(recogniser_table(rows))
    print(f"{args.part} levers measured in {time.perf_counter() - started:.0f} s on one thread")
    if args.json:
        write_text_atomic(args.json, json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
