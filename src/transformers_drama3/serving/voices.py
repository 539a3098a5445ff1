"""Named voices: reference clips with transcripts (one or several speakers), kept on disk.

A voice is a folder `<root>/<id>/` holding `voice.json` (name, and per reference its transcript,
speaker and clip file) and the clips as WAV files. Every file is written to a temporary name and
renamed into place, and a new voice folder appears only once complete, so a crash never leaves a
half-written voice. Each reference's codes are encoded once, when the voice is registered or first
used, and kept in memory.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile

from ..prompting import Reference
from ..tiny import shipped

VOICE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
"""What a voice id may look like: a file-name-safe word."""


@dataclass(frozen=True)
class VoiceReference:
    """One reference of a voice: a waveform [samples] at `sampling_rate`, its transcript and speaker."""

    waveform: np.ndarray
    sampling_rate: int
    transcript: str
    speaker: int = 0


def read_audio_bytes(data: bytes, location: str) -> tuple[np.ndarray, int]:
    """Audio file bytes (WAV, FLAC, OGG, ...) -> mono float32 samples and their rate."""
    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (RuntimeError, soundfile.LibsndfileError) as error:
        raise ValueError(f"{location}: not a readable audio file ({error})") from None
    if samples.shape[0] == 0:
        raise ValueError(f"{location}: the audio is empty")
    return samples.mean(axis=1), int(rate)


def _atomic_write(path: Path, data: bytes) -> None:
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


class VoiceStore:
    """Voices under `root`, their encoded references cached.

    Args:
        root: the folder that holds one sub-folder per voice (created when missing).
        processor: a `Drama3Processor` with a codec: encodes each reference once.
    """

    def __init__(self, root: str | os.PathLike, processor):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.processor = processor
        self._codes: dict[str, tuple[Reference, ...]] = {}
        self._lock = threading.Lock()

    def ids(self) -> list[str]:
        return sorted(path.name for path in self.root.iterdir() if (path / "voice.json").is_file())

    def describe(self, voice_id: str) -> dict:
        """{"id", "name", "references": [{"text", "speaker"}]} of a stored voice."""
        meta = self._meta(voice_id)
        references = [{"text": item["text"], "speaker": item["speaker"]} for item in meta["references"]]
        return {"id": voice_id, "name": meta["name"], "references": references}

    def __contains__(self, voice_id: str) -> bool:
        return VOICE_ID.match(voice_id or "") is not None and (self.root / voice_id / "voice.json").is_file()

    def add(self, voice_id: str, references: list[VoiceReference], name: str | None = None, replace: bool = False) -> None:
        """Store a voice and encode its references; raises ValueError naming what is wrong."""
        if not VOICE_ID.match(voice_id or ""):
            raise ValueError(f"id: {voice_id!r} is not a voice id; use letters, digits, '_', '-' or '.' (at most 64)")
        if not references:
            raise ValueError("references: a voice needs at least one reference clip")
        if voice_id in self and not replace:
            raise ValueError(f"id: a voice named {voice_id!r} exists; delete it first")
        encoded = self._encode(references)
        staging = Path(tempfile.mkdtemp(dir=self.root, prefix=f".{voice_id}."))
        try:
            meta = {"name": name or voice_id, "references": []}
            for index, reference in enumerate(references):
                clip = f"reference_{index}.wav"
                buffer = io.BytesIO()
                soundfile.write(buffer, reference.waveform, reference.sampling_rate, format="WAV", subtype="FLOAT")
                _atomic_write(staging / clip, buffer.getvalue())
                meta["references"].append({"clip": clip, "text": reference.transcript, "speaker": reference.speaker})
            _atomic_write(staging / "voice.json", (json.dumps(meta, indent=2) + "\n").encode())
            with self._lock:
                target = self.root / voice_id
                if target.exists():
                    shutil.rmtree(target)
                os.replace(staging, target)
                self._codes[voice_id] = encoded
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def delete(self, voice_id: str) -> None:
        if voice_id not in self:
            raise KeyError(voice_id)
        with self._lock:
            self._codes.pop(voice_id, None)
            shutil.rmtree(self.root / voice_id)

    def references(self, voice_id: str) -> tuple[Reference, ...]:
        """The voice's references with their codes (encoded on first use, then cached)."""
        with self._lock:
            cached = self._codes.get(voice_id)
        if cached is not None:
            return cached
        meta = self._meta(voice_id)
        loaded = []
        for item in meta["references"]:
            waveform, rate = soundfile.read(self.root / voice_id / item["clip"], dtype="float32")
            loaded.append(VoiceReference(waveform, int(rate), item["text"], int(item["speaker"])))
        encoded = self._encode(loaded)
        with self._lock:
            self._codes[voice_id] = encoded
        return encoded

    def _meta(self, voice_id: str) -> dict:
        if voice_id not in self:
            raise KeyError(voice_id)
        return json.loads((self.root / voice_id / "voice.json").read_text(encoding="utf-8"))

    def _encode(self, references: list[VoiceReference]) -> tuple[Reference, ...]:
        return tuple(self.encode(reference, f"references[{index}]") for index, reference in enumerate(references))

    def encode(self, reference: VoiceReference, location: str) -> Reference:
        """A checked reference with codes [num_codebooks, frames] in place of its waveform; a
        ValueError naming `location` for a bad transcript, or audio that is unreadable, silent, too
        long, or far too short for its transcript."""
        checked = Reference(reference.transcript, reference.waveform, reference.speaker, reference.sampling_rate)
        checked = checked.checked(location)
        codes = self.processor.codes_of(checked.audio, f"{location}.audio", is_reference=True)
        self.processor.check_reference_covers(codes, checked.transcript, f"{location}.audio")
        return Reference(checked.transcript, codes, checked.speaker)


def register_bundled_voices(store: VoiceStore) -> None:
    """Store drama3-tiny's bundled voices (A and B) when they are not stored yet."""
    for name in shipped.voices():
        if name in store:
            continue
        path, transcript = shipped.reference_voice(name)
        waveform, rate = soundfile.read(path, dtype="float32", always_2d=True)
        store.add(name, [VoiceReference(waveform.mean(axis=1), int(rate), transcript)])


def reference_file_voice(spec: str) -> tuple[str, list[VoiceReference]]:
    """`NAME=clip.wav:transcript.txt[,clip2.wav:transcript2.txt...]` (the `--voice` option; the
    i-th clip is speaker i) -> (name, references)."""
    name, separator, clips = spec.partition("=")
    if not separator or not name or not clips:
        raise ValueError(f"--voice {spec}: expected NAME=clip.wav:transcript.txt")
    references = []
    for speaker, pair in enumerate(clips.split(",")):
        clip, separator, transcript_path = pair.rpartition(":")
        if not separator or not clip:
            raise ValueError(f"--voice {spec}: {pair!r} should be clip.wav:transcript.txt")
        for path in (clip, transcript_path):
            if not os.path.isfile(path):
                raise ValueError(f"--voice {spec}: no such file {path}")
        waveform, rate = soundfile.read(clip, dtype="float32", always_2d=True)
        text = Path(transcript_path).read_text(encoding="utf-8").strip()
        references.append(VoiceReference(waveform.mean(axis=1), int(rate), text, speaker))
    return name, references

