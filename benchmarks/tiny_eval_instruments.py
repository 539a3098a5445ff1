"""Validate the drama3-tiny instruments on espeak-ng originals (no model involved).

    python -m benchmarks.tiny_eval_instruments [--sentences 40] [--voices A,B,D,F]   # from the repository root

Builds a small corpus (held-out sentences spoken by every voice, plus plain enrolment utterances
per voice) and prints:
  - Whisper tiny.en WER on the originals, per voice (pocketsphinx, the instrument before it, read
    A 42%, B 34%, D 88%, F 82%);
  - resemblyzer similarity: same voice vs cross voice (pairs of held-out originals), and each
    original against its own voice's centroid vs the others';
  - voice identification accuracy of the originals against the enrolment centroids;
  - DTW identification accuracy (right sentence among 9 other held-out sentences, same voice) of
    the originals against re-renderings: identical, re-timed/re-pitched (speed x0.85, pitch +8),
    with white noise at 20 and 10 dB SNR, and across voices (A's originals against B's renderings).
Prints only; asserts nothing. About 5-10 minutes on 2 busy cores (the recogniser dominates).
"""

import argparse
import json
import tempfile
import time
from dataclasses import replace
from itertools import combinations

import numpy as np

from recipes.drama3_tiny import instruments as I
from recipes.drama3_tiny.corpus import SAMPLING_RATE, VOICES_BY_NAME, build_corpus, read_wav, synthesize


def noisy(samples: np.ndarray, snr_db: float, seed: int = 1) -> np.ndarray:
    """`samples` (float or int16) plus white noise `snr_db` below its mean power."""
    audio = I.as_mono_float(samples)
    noise = np.random.default_rng(seed).standard_normal(len(audio)).astype(np.float32)
    scale = np.sqrt(np.mean(audio**2) / 10 ** (snr_db / 10))
    return audio + scale * noise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sentences", type=int, default=40)
    parser.add_argument("--voices", default="A,B,D,F")
    parser.add_argument("--enrolment", type=int, default=20, help="plain utterances per voice for the centroid")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args()
    voices = [VOICES_BY_NAME[name] for name in args.voices.split(",")]
    results: dict = {}

    with tempfile.TemporaryDirectory() as directory:
        start = time.perf_counter()
        records = build_corpus(directory, args.seed, args.enrolment, args.sentences, voices,
                               direction_rate=0.0, spanish_rate=0.0, progress=False)
        print(f"corpus: {len(records)} utterances in {time.perf_counter() - start:.1f} s")
        audio = {r.id: read_wav(f"{directory}/{r.wav}")[0] for r in records}
    heldout = {v.name: [r for r in records if r.split == "heldout" and r.voice == v.name] for v in voices}
    enrolment = {v.name: [r for r in records if r.split == "train" and r.voice == v.name] for v in voices}

    print("\n== Whisper tiny.en WER on espeak originals ==")
    start, count = time.perf_counter(), 0
    results["wer"] = {}
    for name, group in heldout.items():
        pairs = [(I.transcribe(audio[r.id], SAMPLING_RATE), r.transcript) for r in group]
        count += len(pairs)
        results["wer"][name] = I.corpus_wer(pairs)
        print(f"  voice {name} ({group[0].voice_spec}): {100 * results['wer'][name]:.1f}%  ({len(pairs)} utterances)")
        if name == next(iter(heldout)):
            for hypothesis, reference in pairs[:3]:
                print(f"    e.g. heard {hypothesis!r} for {reference!r}")
    print(f"  {(time.perf_counter() - start) / count:.2f} s per utterance")

    print("\n== resemblyzer speaker similarity ==")
    start = time.perf_counter()
    embedding = {r.id: I.speaker_embedding(audio[r.id], SAMPLING_RATE) for r in records}
    print(f"  {(time.perf_counter() - start) / len(records):.3f} s per utterance")
    originals = [r for group in heldout.values() for r in group]
    same, cross = [], []
    for a, b in combinations(originals, 2):
        (same if a.voice == b.voice else cross).append(I.speaker_similarity(embedding[a.id], embedding[b.id]))
    centroids = {name: I.voice_centroid([embedding[r.id] for r in group]) for name, group in enrolment.items()}
    own = [I.speaker_similarity(embedding[r.id], centroids[r.voice]) for r in originals]
    other = [I.speaker_similarity(embedding[r.id], centroids[n]) for r in originals for n in centroids if n != r.voice]
    identified = [I.identify_voice(embedding[r.id], centroids) == r.voice for r in originals]
    results["similarity"] = {"same_voice_pairs": float(np.mean(same)), "cross_voice_pairs": float(np.mean(cross)),
                             "own_centroid": float(np.mean(own)), "other_centroids": float(np.mean(other)),
                             "own_centroid_min": float(np.min(own)), "other_centroids_max": float(np.max(other)),
                             "identification": float(np.mean(identified))}
    print(f"  pairs: same voice {np.mean(same):.3f}, cross voice {np.mean(cross):.3f}")
    print(f"  vs centroid of {args.enrolment} enrolment utterances: own {np.mean(own):.3f} (min {np.min(own):.3f}), "
          f"others {np.mean(other):.3f} (max {np.max(other):.3f})")
    for name in centroids:
        row = [np.mean([I.speaker_similarity(embedding[r.id], centroids[n]) for r in heldout[name]]) for n in centroids]
        print(f"    originals of {name} vs centroids {list(centroids)}: " + " ".join(f"{x:.3f}" for x in row))
    print(f"  voice identification of originals: {100 * np.mean(identified):.1f}% ({len(identified)})")

    print("\n== DTW identification (right sentence among 9 other held-out sentences, same voice) ==")
    start = time.perf_counter()
    features = {r.id: I.mfcc(audio[r.id], SAMPLING_RATE) for r in originals}
    results["dtw"] = {}

    def report(label: str, outputs_of) -> None:
        rates = {}
        for name, group in heldout.items():
            renderings = [features[r.id] for r in group]
            rates[name] = I.dtw_identification_rate(outputs_of(name, group), renderings, seed=args.seed)
        results["dtw"][label] = rates
        print(f"  {label}: " + ", ".join(f"{n} {100 * x:.0f}%" for n, x in rates.items()))

    def rerendered(name, group):
        return [I.mfcc(synthesize(r.directed_text, VOICES_BY_NAME[name]), SAMPLING_RATE) for r in group]

    def retimed(name, group):
        voice = VOICES_BY_NAME[name]
        voice = replace(voice, speed=int(voice.speed * 0.85), pitch=min(99, voice.pitch + 8))
        return [I.mfcc(synthesize(r.directed_text, voice), SAMPLING_RATE) for r in group]

    def with_noise(snr_db):
        return lambda name, group: [I.mfcc(noisy(audio[r.id], snr_db), SAMPLING_RATE) for r in group]

    report("re-rendered (identical)", rerendered)
    report("re-timed x0.85, pitch +8", retimed)
    report("white noise 20 dB", with_noise(20.0))
    report("white noise 10 dB", with_noise(10.0))
    names = list(heldout)
    if len(names) >= 2:
        def other_voice(name, group):
            partner = names[(names.index(name) + 1) % len(names)]
            return [features[r.id] for r in heldout[partner]]
        report("other voice's rendering (next voice in the list)", other_voice)
    pairs = sum(len(g) for g in heldout.values()) * 10 * len(results["dtw"])
    print(f"  {1000 * (time.perf_counter() - start) / pairs:.1f} ms per DTW comparison (incl. MFCC, synthesis)")

    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()
