"""espeak-ng renderings in drama3-tiny's bundled voices: the originals an evaluation compares with.

drama3-tiny was trained on espeak-ng speech, and its bundled reference clips (`voices/A.wav`, ...)
are espeak-ng renderings in these voices; rendering a sentence in the same voice gives what the
model imitates, and what the codec's resynthesis and the recogniser are measured on. espeak-ng is
a Debian package (`apt-get install -y espeak-ng`), called as a program.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import NamedTuple
from xml.sax.saxutils import escape

import numpy as np

ESPEAK = "espeak-ng"
ESPEAK_RATE = 22050  # what espeak-ng writes
INSTALL_HINT = "install it with `apt-get install -y espeak-ng` (Debian package espeak-ng)"


class EspeakVoice(NamedTuple):
    """An espeak-ng voice: language + variant (`en-us+m1`), pitch 0-99, speed in words per minute."""

    voice: str
    pitch: int = 50
    speed: int = 175


TINY_VOICES = {
    "A": EspeakVoice("en-us+m1", 50, 170),
    "B": EspeakVoice("en-us+f2", 65, 160),
    "D": EspeakVoice("en-gb-x-rp+f4", 55, 185),
    "F": EspeakVoice("en-029+m7", 50, 175),
}
"""The bundled voices of drama3-tiny, as its corpus recipe speaks them."""


def espeak_available() -> bool:
    return shutil.which(ESPEAK) is not None


def espeak_pcm(ssml: str, voice: str, pitch: int, speed: int) -> np.ndarray:
    """One espeak-ng call in SSML mode (`<speak>...</speak>`, or plain text); int16 samples
    [time] at `ESPEAK_RATE`."""
    if not espeak_available():
        raise RuntimeError(f"{ESPEAK} is not on PATH; {INSTALL_HINT}")
    command = [ESPEAK, "-m", "-v", voice, "-p", str(pitch), "-s", str(speed), "--stdout", ssml]
    raw = subprocess.run(command, capture_output=True, check=True).stdout
    # espeak streams a RIFF header with placeholder sizes: read the fixed 44-byte PCM header.
    if raw[:4] != b"RIFF" or int.from_bytes(raw[24:28], "little") != ESPEAK_RATE:
        raise RuntimeError(f"{ESPEAK} -v {voice} did not write {ESPEAK_RATE} Hz WAV")
    return np.frombuffer(raw[44:], dtype="<i2").copy()


def speak(text: str, voice: EspeakVoice) -> np.ndarray:
    """Plain English `text` in `voice`: float32 samples [time] at `ESPEAK_RATE`."""
    pcm = espeak_pcm(f"<speak>{escape(text)}</speak>", voice.voice, voice.pitch, voice.speed)
    return pcm.astype(np.float32) / 32768.0
