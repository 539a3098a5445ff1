"""Named voices: reference clips with transcripts (one or several speakers), kept on disk.

A voice is a folder `<root>/<id>/` holding `voice.json` (name, and per reference its transcript,
speaker and clip file) and the clips as WAV files. A voice is checked completely (id, name,
transcripts, audio: its references encoded) before anything touches the disk, written into a
staging folder `<root>/.staging.<id>.<random>/` and renamed into place, so a crash never leaves a
half-written voice; staging folders a crash left behind are swept when a store opens. Creating and
deleting one id is exclusive, across threads and across processes sharing the folder (a lock file
`<root>/.locks/<id>.lock`): a second create of the same id is refused, never interleaved. Each
voice's encoded references are cached in memory, keyed by the folder's files, so a voice another
process replaced is read again. A damaged voice folder (unreadable `voice.json`, a missing clip) is
left out of listings with a logged warning, and a request naming it gets `DamagedVoice`.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile

from ..prompting import Reference
from ..tiny import shipped
from .safe_files import parse_json

try:
    import fcntl
except ImportError:  # no file locks (Windows): creates are exclusive within this process only
    fcntl = None

logger = logging.getLogger(__name__)

VOICE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""What a voice id may look like (the whole id: `fullmatch`): a file-name-safe word."""
MAX_NAME_CHARS = 128
STAGING, TRASH, OLD, LOCKS = ".staging.", ".trash.", ".old.", ".locks"
"""The hidden folders beside the voices: a voice being written, being deleted, being replaced
(the old folder set aside until the new one is in place); the per-id lock files."""


class VoiceExists(Exception):
    """A voice of that id is stored already."""


class VoiceBusy(Exception):
    """Another request (or process) is creating or deleting a voice of that id right now."""


class DamagedVoice(Exception):
    """A stored voice's folder cannot be read (broken `voice.json`, a missing or unreadable clip)."""


def is_voice_id(voice_id) -> bool:
    return isinstance(voice_id, str) and VOICE_ID.fullmatch(voice_id) is not None


def check_voice_id(voice_id) -> str:
    if not is_voice_id(voice_id):
        raise ValueError(f"id: {voice_id!r} is not a voice id; use letters, digits, '_', '-' or '.' (at most 64, "
                         "starting with a letter or digit)")
    return voice_id


def check_voice_name(name) -> str:
    """A display name: 1 to `MAX_NAME_CHARS` characters of valid Unicode, no control or format
    characters (newlines, zero-width and direction marks), not only spaces."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name: expected a non-empty string; got {name!r}")
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"name: {len(name)} characters; at most {MAX_NAME_CHARS}")
    for index, character in enumerate(name):
        if unicodedata.category(character) in ("Cc", "Cf", "Cs", "Co", "Cn"):
            raise ValueError(f"name: character {index} (U+{ord(character):04X}) is a control, format, surrogate, "
                             "private-use or unassigned character")
    return name


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
    except (RuntimeError, soundfile.LibsndfileError) as error:  # its text names the BytesIO object: left out
        reason = getattr(error, "error_string", None) or "unknown format"
        raise ValueError(f"{location}: not a readable audio file ({reason.rstrip('.')})") from None
    if samples.shape[0] == 0:
        raise ValueError(f"{location}: the audio is empty")
    return samples.mean(axis=1), int(rate)


def _fingerprint(folder: Path) -> tuple:
    """What identifies a voice folder's content: its files' names, sizes, modification times and
    inodes (a voice deleted and created again, here or by another process, differs)."""
    files = []
    for entry in os.scandir(folder):
        stat = entry.stat()
        files.append((entry.name, stat.st_size, stat.st_mtime_ns, stat.st_ino))
    return tuple(sorted(files))


def _staged_id(name: str) -> str | None:
    """The voice id in the name of a staging, trash or set-aside folder (`.staging.<id>.<random>`)."""
    for prefix in (STAGING, TRASH, OLD):
        if name.startswith(prefix):
            voice_id = name[len(prefix):].rpartition(".")[0]
            return voice_id if is_voice_id(voice_id) else None
    return None


class VoiceStore:
    """Voices under `root`, their encoded references cached.

    Args:
        root: the folder that holds one sub-folder per voice (created when missing).
        processor: a `Drama3Processor` with a codec: encodes each reference once.
    """

    def __init__(self, root: str | os.PathLike, processor):
        self.root = Path(root)
        (self.root / LOCKS).mkdir(parents=True, exist_ok=True)
        self.processor = processor
        self._codes: dict[str, tuple[tuple, tuple[Reference, ...]]] = {}  # id -> (fingerprint, references)
        self._claimed: set[str] = set()
        self._warned: set[tuple] = set()
        self._lock = threading.Lock()
        self.sweep()

    # ---- reading --------------------------------------------------------------------------------

    def ids(self) -> list[str]:
        """The ids of the stored voices that can be read (damaged ones are logged and left out)."""
        return [voice["id"] for voice in self.listing()]

    def listing(self) -> list[dict]:
        """[{"id", "name"}] of every readable voice, by id; a damaged one is logged and left out."""
        voices = []
        for voice_id in sorted(path.name for path in self.root.iterdir() if (path / "voice.json").is_file()):
            if not is_voice_id(voice_id):
                self._warn(voice_id, f"{voice_id!r} is not a voice id")
                continue
            try:
                voices.append({"id": voice_id, "name": self._meta(voice_id)["name"]})
            except DamagedVoice as error:
                self._warn(voice_id, str(error))
            except KeyError:
                continue  # deleted meanwhile
        return voices

    def describe(self, voice_id: str) -> dict:
        """{"id", "name", "references": [{"text", "speaker"}]} of a stored voice."""
        meta = self._meta(voice_id)
        references = [{"text": item["text"], "speaker": item["speaker"]} for item in meta["references"]]
        return {"id": voice_id, "name": meta["name"], "references": references}

    def __contains__(self, voice_id) -> bool:
        return is_voice_id(voice_id) and (self.root / voice_id / "voice.json").is_file()

    def references(self, voice_id: str) -> tuple[Reference, ...]:
        """The voice's references with their codes (encoded on first use, then cached while the
        folder is unchanged); KeyError for an unknown voice, DamagedVoice for one that cannot be read."""
        folder = self.root / voice_id
        try:
            fingerprint = _fingerprint(folder)
        except OSError:
            raise KeyError(voice_id) from None
        with self._lock:
            cached = self._codes.get(voice_id)
        if cached is not None and cached[0] == fingerprint:
            return cached[1]
        try:
            encoded = self._encode(self._read_references(voice_id))
        except DamagedVoice as error:
            self._warn(voice_id, str(error))
            raise
        except ValueError as error:
            self._warn(voice_id, str(error))
            raise DamagedVoice(f"voice {voice_id!r} is damaged: {error}") from None
        with self._lock:
            self._codes[voice_id] = (fingerprint, encoded)
        return encoded

    def _read_references(self, voice_id: str) -> list[VoiceReference]:
        """The voice's references as stored (waveforms); DamagedVoice when a clip cannot be read."""
        folder = self.root / voice_id
        loaded = []
        for item in self._meta(voice_id)["references"]:
            try:
                waveform, rate = soundfile.read(folder / item["clip"], dtype="float32", always_2d=True)
            except (OSError, RuntimeError, soundfile.LibsndfileError) as error:
                raise DamagedVoice(f"voice {voice_id!r} is damaged: its clip {item['clip']!r} cannot be read "
                                   f"({type(error).__name__}: {error})") from None
            loaded.append(VoiceReference(waveform.mean(axis=1), int(rate), item["text"], int(item["speaker"])))
        return loaded

    def _meta(self, voice_id: str) -> dict:
        """The checked `voice.json` of a voice; KeyError when there is none, DamagedVoice when it is
        not what `add` writes."""
        if voice_id not in self:
            raise KeyError(voice_id)
        try:
            meta = parse_json((self.root / voice_id / "voice.json").read_bytes(), "voice.json")
        except FileNotFoundError:
            raise KeyError(voice_id) from None
        except (OSError, ValueError) as error:  # a 100,000-deep file too: never a RecursionError
            raise DamagedVoice(f"voice {voice_id!r} is damaged: its voice.json cannot be read ({error})") from None
        try:
            check_voice_name(meta["name"])
            references = meta["references"]
            if not isinstance(references, list) or not references:
                raise ValueError("references: expected a non-empty list")
            for item in references:
                clip = item["clip"]
                if not isinstance(clip, str) or Path(clip).name != clip or clip.startswith("."):
                    raise ValueError(f"clip: {clip!r} is not a file name in the voice's folder")
                if not (self.root / voice_id / clip).is_file():
                    raise ValueError(f"clip: {clip!r} is missing")
                if not isinstance(item["text"], str) or isinstance(item["speaker"], bool) or not isinstance(item["speaker"], int):
                    raise ValueError("references: text must be a string, speaker an integer")
        except (ValueError, KeyError, TypeError) as error:
            raise DamagedVoice(f"voice {voice_id!r} is damaged: its voice.json is not a voice ({error})") from None
        return meta

    def _warn(self, voice_id: str, reason: str) -> None:
        with self._lock:
            if (voice_id, reason) in self._warned:
                return
            self._warned.add((voice_id, reason))
        logger.warning("voices: skipping %r in %s: %s", voice_id, self.root, reason)

    # ---- writing --------------------------------------------------------------------------------

    def add(self, voice_id: str, references: list[VoiceReference], name: str | None = None, replace: bool = False) -> None:
        """Store a voice and encode its references. Raises ValueError naming what is wrong (before
        anything is written), VoiceExists when the id is taken (and not `replace`), VoiceBusy while
        another create or delete of the id runs; OSError from the disk leaves the store as it was."""
        check_voice_id(voice_id)
        name = check_voice_name(voice_id if name is None else name)
        if not references:
            raise ValueError("references: a voice needs at least one reference clip")
        encoded = self._encode(references)
        with self._claim(voice_id):
            target = self.root / voice_id
            if voice_id in self and not replace:
                raise VoiceExists(f"id: a voice {voice_id!r} exists; delete it first")
            staging = Path(tempfile.mkdtemp(dir=self.root, prefix=f"{STAGING}{voice_id}."))
            try:
                self._write(staging, references, name)
                if target.exists():
                    self._swap(staging, target)
                else:
                    os.replace(staging, target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            with self._lock:
                self._codes[voice_id] = (_fingerprint(target), encoded)

    def delete(self, voice_id: str) -> None:
        """Remove a stored voice; KeyError when there is none, VoiceBusy while it is being created."""
        if not is_voice_id(voice_id) or not (self.root / voice_id).exists():
            raise KeyError(voice_id)  # nothing to claim: a delete of a voice that is not there is told so at once
        with self._claim(voice_id):
            if not (self.root / voice_id).exists():
                raise KeyError(voice_id)
            trash = Path(tempfile.mkdtemp(dir=self.root, prefix=f"{TRASH}{voice_id}."))
            os.rename(self.root / voice_id, trash / voice_id)  # gone at once, removed at leisure
            with self._lock:
                self._codes.pop(voice_id, None)
            shutil.rmtree(trash, ignore_errors=True)

    def sweep(self) -> None:
        """Clean up after writers that are gone (a crash, `kill -9`), skipping ids a live process
        holds: staging and trash folders are removed; a voice set aside for a replacement that never
        arrived is put back."""
        for path in self.root.iterdir():
            voice_id = _staged_id(path.name)
            if voice_id is None or not path.is_dir():
                continue
            try:
                with self._claim(voice_id):
                    target, old = self.root / voice_id, path / voice_id
                    if path.name.startswith(OLD) and old.is_dir() and not target.exists():
                        logger.warning("voices: restoring %s from %s, set aside by an interrupted replace", target, path)
                        os.rename(old, target)
                    logger.warning("voices: removing %s, left by an interrupted write", path)
                    shutil.rmtree(path, ignore_errors=True)
            except VoiceBusy:
                continue

    @staticmethod
    def _write(folder: Path, references: list[VoiceReference], name: str) -> None:
        meta = {"name": name, "references": []}
        for index, reference in enumerate(references):
            clip = f"reference_{index}.wav"
            soundfile.write(folder / clip, reference.waveform, reference.sampling_rate, format="WAV", subtype="FLOAT")
            meta["references"].append({"clip": clip, "text": reference.transcript, "speaker": reference.speaker})
        (folder / "voice.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")

    def _swap(self, staging: Path, target: Path) -> None:
        """Put `staging` in place of the voice folder `target`; the old one stays if that fails."""
        aside = Path(tempfile.mkdtemp(dir=self.root, prefix=f"{OLD}{target.name}."))
        os.rename(target, aside / target.name)
        try:
            os.replace(staging, target)
        except BaseException:
            os.rename(aside / target.name, target)
            raise
        finally:
            if target.exists():
                shutil.rmtree(aside, ignore_errors=True)

    @contextlib.contextmanager
    def _claim(self, voice_id: str):
        """Hold the id exclusively (this process's threads, then a lock file for other processes);
        VoiceBusy at once when someone else holds it."""
        with self._lock:
            if voice_id in self._claimed:
                raise VoiceBusy(f"id: the voice {voice_id!r} is being created or deleted; retry shortly")
            self._claimed.add(voice_id)
        try:
            with open(self.root / LOCKS / f"{voice_id}.lock", "a+b") as lock:
                if fcntl is not None:
                    try:
                        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        raise VoiceBusy(f"id: the voice {voice_id!r} is being created or deleted by another "
                                        "process; retry shortly") from None
                yield
        finally:
            with self._lock:
                self._claimed.discard(voice_id)

    # ---- encoding -------------------------------------------------------------------------------

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
        try:
            store.add(name, [VoiceReference(waveform.mean(axis=1), int(rate), transcript)])
        except (VoiceExists, VoiceBusy):
            continue  # another server on the same folder stored it first


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

