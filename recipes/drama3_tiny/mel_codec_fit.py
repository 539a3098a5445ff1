"""Fit drama3-tiny's log-mel residual-VQ codec on a corpus (minutes on a CPU, no gradient training).

    python -m recipes.drama3_tiny.mel_codec_fit --corpus CORPUS --out CODEC [--codebooks 4]

Every other train utterance of CORPUS (manifest order) is cut into codec frames (4 log-mel frames
of 80 bands each), the frame vectors are standardised per dimension, and each residual codebook
is fitted by k-means on what the codebooks before it leave. The defaults reproduce the codec
shipped with drama3-tiny (4 codebooks of 256, 15 iterations, seed 0, "sample" seeding).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F


def fit_codec(corpus: str | Path, num_codebooks: int = 4, codebook_size: int = 256, iterations: int = 15,
              seed: int = 0, init: str = "sample", every: int = 2, progress: bool = True):
    """A fitted `Drama3MelCodecModel` for `corpus` (see the module docstring)."""
    from transformers_drama3.codec.mel_codec import Drama3MelCodecConfig, Drama3MelCodecModel, fit_residual_codebooks
    from .corpus import read_manifest, read_wav

    corpus = Path(corpus)
    codec = Drama3MelCodecModel(Drama3MelCodecConfig(num_codebooks=num_codebooks, codebook_size=codebook_size)).eval()
    train = [r for r in read_manifest(corpus / "manifest.jsonl") if r.split == "train"]
    features = []
    with torch.no_grad():
        for record in train[::every]:
            samples, rate = read_wav(corpus / record.wav)
            if rate != codec.sampling_rate:
                raise ValueError(f"{record.wav}: {rate} Hz; the codec works at {codec.sampling_rate} Hz")
            audio = torch.from_numpy(samples)
            frames = -(-len(audio) // codec.hop_length)
            audio = F.pad(audio, (0, frames * codec.hop_length - len(audio)))
            features.append(codec.features(codec.log_mel(audio[None]))[0])
        features = torch.cat(features)
        mean, scale = features.mean(0), features.std(0).clamp_min(1e-3)
        codec.feature_mean.copy_(mean)
        codec.feature_scale.copy_(scale)
        codec.codebooks.copy_(fit_residual_codebooks(
            (features - mean) / scale, num_codebooks, codebook_size, iterations=iterations, seed=seed, init=init,
            progress=progress,
        ))
    return codec


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.drama3_tiny.mel_codec_fit", description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--codebooks", type=int, default=4)
    parser.add_argument("--codebook-size", type=int, default=256)
    parser.add_argument("--iterations", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init", choices=("sample", "kmeans++"), default="sample")
    parser.add_argument("--every", type=int, default=2, help="fit on every N-th train utterance (manifest order)")
    args = parser.parse_args(argv)
    if args.every < 1:
        parser.error(f"--every must be >= 1; got {args.every}")
    codec = fit_codec(args.corpus, args.codebooks, args.codebook_size, args.iterations, args.seed, args.init, args.every)
    codec.save_pretrained(args.out)
    print(f"codec with {args.codebooks} codebooks of {args.codebook_size} saved to {args.out}")


if __name__ == "__main__":
    main()
