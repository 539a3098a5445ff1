"""drama3-tiny as shipped inside the package: where it lies and its bundled reference voices.

    from transformers_drama3.tiny.shipped import TINY_MODEL_PATH, reference_voice
    model = AutoModel.from_pretrained(TINY_MODEL_PATH)          # Drama3ForSpeechGeneration
    processor = AutoProcessor.from_pretrained(TINY_MODEL_PATH)  # tokenizer + log-mel codec
    audio, text = reference_voice("A")                           # a 22.05 kHz clip and its words

The folder holds `config.json` + `model.safetensors` (published layout), the tokenizer files,
`codec/` and `voices/` (one espeak-ng clip per voice, `X.wav` + `X.txt`, never a held-out
sentence). The recipe that makes it (`recipes/drama3_tiny/` in the source tree, not installed)
writes it there: `python -m recipes.drama3_tiny.export RUN/model --corpus CORPUS --to FOLDER` (replacing the
installed package's own folder needs `--force`).
"""

from __future__ import annotations

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
