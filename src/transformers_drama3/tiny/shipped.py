"""drama3-tiny as shipped inside the package: where it lies and its bundled reference voices.

    from transformers_drama3.tiny.shipped import TINY_MODEL_PATH, reference_voice
    model = AutoModel.from_pretrained(TINY_MODEL_PATH)          # Drama3ForSpeechGeneration
    processor = AutoProcessor.from_pretrained(TINY_MODEL_PATH)  # tokenizer + log-mel codec
    audio, text = reference_voice("A")                           # a 22.05 kHz clip and its words

The folder holds `config.json` + `model.safetensors` (published layout), the tokenizer files,
`codec/` and `voices/` (one espeak-ng clip per voice, `X.wav` + `X.txt`, never a held-out
sentence). `python -m transformers_drama3.tiny.shipped export RUN` copies a finished training run
(`lm_training`'s RUN/model) there.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

TINY_MODEL_PATH = str(Path(__file__).resolve().parent.parent / "assets" / "drama3-tiny")
DEFAULT_VOICE = "A"


def is_available() -> bool:
    """True when the package carries the drama3-tiny weights."""
    return (Path(TINY_MODEL_PATH) / "model.safetensors").is_file()


def voices() -> list[str]:
    """Names of the bundled reference voices."""
    return sorted(path.stem for path in (Path(TINY_MODEL_PATH) / "voices").glob("*.wav"))


def reference_voice(name: str = DEFAULT_VOICE) -> tuple[str, str]:
    """(path of the voice's reference clip, its transcript)."""
    folder = Path(TINY_MODEL_PATH) / "voices"
    if not (folder / f"{name}.wav").is_file():
        raise ValueError(f"voice {name!r} is not bundled with drama3-tiny; choose one of {voices()}")
    return str(folder / f"{name}.wav"), (folder / f"{name}.txt").read_text(encoding="utf-8").strip()


def export(run_model: str | Path, corpus: str | Path, destination: str | Path = TINY_MODEL_PATH,
           voice_names: tuple[str, ...] = ("A", "B", "D", "F")) -> None:
    """Copy a trained model folder (config, weights, tokenizer, codec) to `destination` and add one
    plain English train clip per voice from `corpus` as its bundled reference."""
    from .corpus import read_manifest

    run_model, destination = Path(run_model), Path(destination)
    if destination.exists():
        shutil.rmtree(destination)
    keep = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "processor_config.json", "preprocessor_config.json")
    destination.mkdir(parents=True)
    for name in keep:
        if (run_model / name).is_file():
            shutil.copy(run_model / name, destination / name)
    shutil.copytree(run_model / "codec", destination / "codec")
    (destination / "voices").mkdir()
    records = read_manifest(Path(corpus) / "manifest.jsonl")
    for voice in voice_names:
        clean = [r for r in records if r.voice == voice and r.split == "train" and not r.directions and r.language == "en"]
        clip = min(clean, key=lambda r: abs(r.duration - 3.0))
        shutil.copy(Path(corpus) / clip.wav, destination / "voices" / f"{voice}.wav")
        (destination / "voices" / f"{voice}.txt").write_text(clip.transcript + "\n", encoding="utf-8")
    (destination / "voices" / "voices.json").write_text(
        json.dumps({voice: r.voice_spec for voice in voice_names for r in records if r.voice == voice and r.split == "train"}, indent=2)
        + "\n", encoding="utf-8",
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="copy a trained drama3-tiny into the package")
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("export")
    command.add_argument("run_model", help="lm_training's RUN/model folder")
    command.add_argument("--corpus", required=True, help="the corpus the run trained on (for the reference clips)")
    command.add_argument("--to", default=TINY_MODEL_PATH)
    args = parser.parse_args(argv)
    export(args.run_model, args.corpus, args.to)
    print(f"drama3-tiny exported to {args.to}")


if __name__ == "__main__":
    main()
