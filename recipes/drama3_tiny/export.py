"""Copy a finished drama3-tiny training run into the package, where `drama3 say` finds it.

    python -m recipes.drama3_tiny.export RUN/model --corpus CORPUS --to FOLDER [--voices A,B] [--codec CODEC] [--force]

RUN/model is what `lm_training` writes; CORPUS the corpus it trained on (one plain English train
clip per voice becomes that voice's bundled reference). CODEC replaces the run's codec folder: the
same codes (labels, codebooks) with other weights, e.g. the phonetic codec's decoder fine-tuned
after the run had encoded its corpus. FOLDER is replaced whole once the copy is
complete; the package's own `assets/drama3-tiny` (`transformers_drama3.tiny.shipped.TINY_MODEL_PATH`)
is replaced only with `--force`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from transformers_drama3.output_files import atomic_folder
from transformers_drama3.tiny.shipped import TINY_MODEL_PATH

from .corpus import read_manifest

_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "processor_config.json", "preprocessor_config.json")


def export(run_model: str | Path, corpus: str | Path, destination: str | Path,
           voice_names: tuple[str, ...] = ("A", "B", "D", "F"), force: bool = False,
           codec: str | Path | None = None) -> None:
    """Copy a trained model folder (config, weights, tokenizer, codec) to `destination` and add one
    plain English train clip per voice from `corpus` as its bundled reference. `codec`, when given,
    is copied instead of the run's `codec/` (it must code the same labels in as many codebooks).

    The source is checked before `destination` is touched, the new folder is built beside it and
    swapped in whole, and the installed package's own model folder is replaced only with `force`."""
    run_model, corpus, destination = Path(run_model), Path(corpus), Path(destination)
    if destination.resolve() == Path(TINY_MODEL_PATH).resolve() and not force:
        raise ValueError(f"{destination}: this is the drama3-tiny installed with the package; pass force=True (--force) to replace it")
    clips = _check_export_source(run_model, corpus, voice_names)
    codec = run_model / "codec" if codec is None else _check_codec_swap(run_model / "codec", Path(codec))
    with atomic_folder(destination) as building:
        building = Path(building)
        for name in _MODEL_FILES:
            if (run_model / name).is_file():
                shutil.copy(run_model / name, building / name)
        shutil.copytree(codec, building / "codec")
        record_speaking_rate(run_model, corpus, building, voice_names)
        record_short_reference(building)
        (building / "voices").mkdir()
        for voice, clip in clips.items():
            shutil.copy(corpus / clip.wav, building / "voices" / f"{voice}.wav")
            (building / "voices" / f"{voice}.txt").write_text(clip.transcript + "\n", encoding="utf-8")
        (building / "voices" / "voices.json").write_text(
            json.dumps({voice: clip.voice_spec for voice, clip in clips.items()}, indent=2) + "\n", encoding="utf-8",
        )


def record_speaking_rate(run_model: Path, corpus: Path, building: Path, voice_names=None) -> float:
    """Measure the corpus's speaking rate in the model's text tokens (`lm_training.corpus_speaking_rate`),
    over the utterances of `voice_names` (all voices when None), and write it to `building`'s
    generation config as `text_tokens_per_second` (a model trained before the rate was recorded
    gets it here; one that has it gets it measured again)."""
    from transformers import GenerationConfig

    from transformers_drama3.processing_drama3 import Drama3Processor
    from .lm_training import corpus_speaking_rate

    records = [r for r in read_manifest(corpus / "manifest.jsonl")
               if r.split == "train" and (voice_names is None or r.voice in voice_names)]
    rate = corpus_speaking_rate(
        Drama3Processor.from_pretrained(run_model),
        [{"audio": str(corpus / r.wav), "text": r.directed_text} for r in records],
        [r.duration for r in records],
    )
    config = GenerationConfig.from_pretrained(building)
    config.text_tokens_per_second = rate
    config.save_pretrained(building)
    return rate


SHORT_REFERENCE_SECONDS = 1.0
"""drama3-tiny's cloning broke down under this (model_card.md, "Cloning wants a reference of 2-3 s":
6 of 10 takes cloned from a 0.75 s reference stopped after a word or two; none from 1.0 s or
longer did). It was trained on references of 1.9-3.3 s."""


def record_short_reference(building: Path, seconds: float = SHORT_REFERENCE_SECONDS) -> None:
    """Write `short_reference_seconds` into `building`'s processor config, so that the processor
    warns about references shorter than the model clones from."""
    path = building / "processor_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["short_reference_seconds"] = seconds
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


CODES_FIELDS = ("model_type", "num_codebooks", "codebook_size", "phonemes", "voices", "sampling_rate", "hop_length")
"""What a replacement codec must share with the run's: what its codes mean and how many a frame."""


def _check_codec_swap(trained: Path, replacement: Path) -> Path:
    """`replacement` after checking it codes what the run's codec `trained` codes (ValueError naming
    the first field that differs)."""
    if not (replacement / "config.json").is_file():
        raise ValueError(f"--codec {replacement}: no config.json; expected a codec folder")
    old, new = (json.loads((folder / "config.json").read_text()) for folder in (trained, replacement))
    for field in CODES_FIELDS:
        if old.get(field) != new.get(field):
            raise ValueError(f"--codec {replacement}: its {field} differs from the run's codec's ({trained}); "
                             "the model was trained on the run codec's codes")
    return replacement


def _check_export_source(run_model: Path, corpus: Path, voice_names) -> dict:
    """voice -> the corpus record of its reference clip, after checking that the run folder and the
    corpus hold everything `export` copies (ValueError naming what is missing)."""
    for needed in ("config.json", "model.safetensors", "codec/config.json"):
        if not (run_model / needed).is_file():
            raise ValueError(f"{run_model}: no {needed}; expected lm_training's RUN/model folder")
    if not (corpus / "manifest.jsonl").is_file():
        raise ValueError(f"{corpus}: no manifest.jsonl; expected the corpus the run trained on")
    records = read_manifest(corpus / "manifest.jsonl")
    clips = {}
    for voice in voice_names:
        clean = [r for r in records if r.voice == voice and r.split == "train" and not r.directions and r.language == "en"]
        if not clean:
            raise ValueError(f"{corpus}: no plain English train clip of voice {voice} to bundle as its reference")
        clips[voice] = min(clean, key=lambda r: abs(r.duration - 3.0))
        if not (corpus / clips[voice].wav).is_file():
            raise ValueError(f"{corpus / clips[voice].wav}: the manifest lists it but the file is missing")
    return clips


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.drama3_tiny.export",
                                     description="copy a trained drama3-tiny into the package")
    parser.add_argument("run_model", help="lm_training's RUN/model folder")
    parser.add_argument("--corpus", required=True, help="the corpus the run trained on (for the reference clips)")
    parser.add_argument("--to", required=True, help="the folder to write (replaced whole once the copy is complete)")
    parser.add_argument("--force", action="store_true", help="allow --to to be the installed package's own drama3-tiny")
    parser.add_argument("--voices", default="A,B,D,F",
                        help="the voices to bundle (comma-separated; the voices the run trained on)")
    parser.add_argument("--codec", default=None, help="a codec folder to bundle instead of the run's (the same codes)")
    args = parser.parse_args(argv)
    try:
        export(args.run_model, args.corpus, args.to, voice_names=tuple(args.voices.split(",")), force=args.force,
               codec=args.codec)
    except ValueError as error:
        parser.exit(2, f"export: {error}\n")
    print(f"drama3-tiny exported to {args.to}")


if __name__ == "__main__":
    main()
