"""Copy a finished drama3-tiny training run into the package, where `drama3 say` finds it.

    python -m recipes.drama3_tiny.export RUN/model --corpus CORPUS [--to FOLDER]

RUN/model is what `lm_training` writes; CORPUS the corpus it trained on (one plain English train
clip per voice becomes that voice's bundled reference). The default destination is the package's
`assets/drama3-tiny` (`transformers_drama3.tiny.shipped.TINY_MODEL_PATH`).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from transformers_drama3.tiny.shipped import TINY_MODEL_PATH


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
    parser = argparse.ArgumentParser(prog="python -m recipes.drama3_tiny.export",
                                     description="copy a trained drama3-tiny into the package")
    parser.add_argument("run_model", help="lm_training's RUN/model folder")
    parser.add_argument("--corpus", required=True, help="the corpus the run trained on (for the reference clips)")
    parser.add_argument("--to", default=TINY_MODEL_PATH)
    args = parser.parse_args(argv)
    export(args.run_model, args.corpus, args.to)
    print(f"drama3-tiny exported to {args.to}")


if __name__ == "__main__":
    main()
