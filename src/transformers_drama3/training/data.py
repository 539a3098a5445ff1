"""Speech records -> codes, once: load, validate, resample, encode with the codec, cache, report.

A record is (audio, transcript[, speaker]). Sources:

- a folder of `name.wav` + `name.txt` pairs (the usual "my voice" folder),
- a folder in `datasets`' audiofolder layout (audio files + `metadata.csv`/`metadata.jsonl`),
- a CSV or JSONL manifest (columns `audio` or `path`, `text` or `transcript`, optional `speaker`;
  relative paths are read from the manifest's folder),
- a Hub dataset name or any `datasets.Dataset` with an audio column.

Audio is never decoded by `datasets` (that needs torchcodec): the audio column is cast to
`Audio(decode=False)` and read by the feature extractor's `read_audio` (transformers' `load_audio`,
soundfile backend) straight at the codec's rate. Bad records are skipped and reported, never fatal.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from ..feature_extraction_drama3 import is_inaudible, read_audio
from ..output_files import write_text_atomic
from ..decoding.budget import MIN_SPEECH_FRACTION, speech_shortfall

AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3")
TEXT_COLUMNS = ("text", "transcript", "transcription", "sentence")
AUDIO_COLUMNS = ("audio", "path", "file", "file_name", "audio_path")
SPEAKER_COLUMNS = ("speaker", "speaker_id", "voice")
MIN_SECONDS = 0.5
MAX_SECONDS = 30.0
UNDECODABLE = "\ufffd"  # what undecodable bytes of a transcript become


# ---- loading ---------------------------------------------------------------------------------------


def load_speech_records(source, split: str = "train", audio_column: str | None = None, **load_kwargs):
    """Any supported source -> a `datasets.Dataset` with columns `audio` ({"path", "bytes"}, not
    decoded), `text` (str or None) and `speaker` (str).

    Args:
        source: a folder, a `.csv` / `.jsonl` / `.json` manifest, a Hub dataset name, or a
            `datasets.Dataset`.
        split: split of a Hub dataset or audiofolder.
        audio_column: the audio column of a Hub dataset / `Dataset` (found by name when None).
    """
    import datasets

    if isinstance(source, datasets.Dataset):
        return _normalise_columns(source, audio_column, base_dir=None)
    path = Path(os.fspath(source))
    if path.is_dir():
        if any((path / name).exists() for name in ("metadata.csv", "metadata.jsonl")):
            dataset = datasets.load_dataset("audiofolder", data_dir=str(path), split=split, **load_kwargs)
            return _normalise_columns(dataset, audio_column or "audio", base_dir=None)
        return _sidecar_folder(path)
    if path.suffix in (".csv", ".jsonl", ".json") and path.exists():
        builder = "csv" if path.suffix == ".csv" else "json"
        dataset = datasets.load_dataset(builder, data_files=str(path), split="train", **load_kwargs)
        return _normalise_columns(dataset, audio_column, base_dir=path.parent)
    dataset = datasets.load_dataset(os.fspath(source), split=split, **load_kwargs)
    return _normalise_columns(dataset, audio_column, base_dir=None)


def _sidecar_folder(folder: Path):
    """A folder of `x.wav` + `x.txt` (speaker: the sub-folder name, or the folder's own name)."""
    import datasets

    records = []
    for audio in sorted(p for p in folder.rglob("*") if p.suffix.lower() in AUDIO_SUFFIXES):
        transcript = audio.with_suffix(".txt")
        # errors="replace": one transcript in another encoding must not abort the whole load;
        # check_record skips and reports the record (its text then holds U+FFFD)
        text = transcript.read_text(encoding="utf-8", errors="replace").strip() if transcript.exists() else None
        speaker = audio.parent.name if audio.parent != folder else folder.name
        records.append({"audio": str(audio), "text": text, "speaker": speaker})
    if not records:
        raise ValueError(f"{folder}: no audio files ({', '.join(AUDIO_SUFFIXES)}) found")
    dataset = datasets.Dataset.from_list(records)
    return dataset.cast_column("audio", datasets.Audio(decode=False))


def _pick(columns: Iterable[str], candidates: tuple[str, ...], given: str | None, what: str) -> str | None:
    columns = list(columns)
    if given is not None:
        if given not in columns:
            raise ValueError(f"{what} column {given!r} is not in the dataset (columns: {columns})")
        return given
    return next((name for name in candidates if name in columns), None)


def _normalise_columns(dataset, audio_column: str | None, base_dir: Path | None):
    import datasets

    audio = _pick(dataset.column_names, AUDIO_COLUMNS, audio_column, "audio")
    if audio is None:
        raise ValueError(f"no audio column among {dataset.column_names}; expected one of {AUDIO_COLUMNS}")
    text = _pick(dataset.column_names, TEXT_COLUMNS, None, "text")
    speaker = _pick(dataset.column_names, SPEAKER_COLUMNS, None, "speaker")
    if not isinstance(dataset.features[audio], datasets.Audio):
        # paths as Audio structs; relative paths are read from the manifest's folder
        def as_struct(value):
            if value is not None and base_dir is not None and not os.path.isabs(value):
                value = str(base_dir / value)
            return {audio: {"bytes": None, "path": value}}

        dataset = dataset.map(as_struct, input_columns=audio)
    dataset = dataset.map(
        lambda row: {
            "_text": None if text is None or row[text] is None else str(row[text]),
            "_speaker": "0" if speaker is None or row[speaker] is None else str(row[speaker]),
        },
        remove_columns=[name for name in dataset.column_names if name != audio],
    )
    dataset = dataset.rename_columns({audio: "audio", "_text": "text", "_speaker": "speaker"})
    return dataset.cast_column("audio", datasets.Audio(decode=False))


# ---- reading and validating ----------------------------------------------------------------------


def read_record_audio(value: Any, sampling_rate: int) -> np.ndarray:
    """An undecoded `Audio` value ({"path", "bytes"}) or a path -> mono float32 samples at `sampling_rate`."""
    source = (value.get("bytes") or value.get("path")) if isinstance(value, dict) else value
    if not source:
        raise ValueError("no audio (neither bytes nor a path)")
    return read_audio(source, sampling_rate, _describe(value))


@dataclass
class Skipped:
    """One record left out: its index in the source, where its audio came from, and why."""

    index: int
    source: str
    reason: str
    detail: str = ""


@dataclass
class PreparationReport:
    """What `prepare_dataset` kept and skipped. `reasons` counts skips per reason."""

    total: int = 0
    kept: int = 0
    from_cache: int = 0
    skipped: list[Skipped] = field(default_factory=list)

    @property
    def reasons(self) -> dict[str, int]:
        return dict(Counter(item.reason for item in self.skipped))

    def summary(self) -> str:
        lines = [f"{self.kept} of {self.total} records kept ({self.from_cache} from the cache)"]
        for reason, count in sorted(self.reasons.items()):
            lines.append(f"  skipped {count}: {reason}")
        for item in self.skipped[:20]:
            lines.append(f"    #{item.index} {item.source}: {item.reason} {item.detail}".rstrip())
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "total": self.total,
            "kept": self.kept,
            "from_cache": self.from_cache,
            "reasons": self.reasons,
            "skipped": [vars(item) for item in self.skipped],
        }


def check_record(
    text: str | None, samples: np.ndarray, rate: int, min_seconds: float, max_seconds: float,
    min_speech_fraction: float = MIN_SPEECH_FRACTION,
) -> tuple[str, str] | None:
    """(reason, detail) when a record is unusable, else None. Reasons: "missing transcript",
    "unreadable transcript", "empty audio", "non-finite samples", "silent", "too short", "too long",
    "transcript too long for the audio" (audio under `min_speech_fraction` of the transcript's
    expected duration: 300 words in 1 s cannot be a recording of them; 0 turns this off)."""
    if text is None or not text.strip():
        return "missing transcript", ""
    if UNDECODABLE in text:
        return "unreadable transcript", "not UTF-8 (undecodable bytes became U+FFFD)"
    if samples.size == 0:
        return "empty audio", ""
    if not np.isfinite(samples).all():
        return "non-finite samples", ""
    if is_inaudible(samples):  # the reference rule: a record without an audible voice teaches nothing
        return "silent", f"peak {float(np.abs(samples).max()):.2e}"
    seconds = samples.shape[0] / rate
    if seconds < min_seconds:
        return "too short", f"{seconds:.2f} s < {min_seconds} s"
    if seconds > max_seconds:
        return "too long", f"{seconds:.2f} s > {max_seconds} s"
    shortfall = speech_shortfall(seconds, text, min_speech_fraction)
    if shortfall is not None:
        return "transcript too long for the audio", shortfall
    return None


# ---- encoding with a cache -----------------------------------------------------------------------


def codec_fingerprint(codec) -> str:
    """A short hash of the codec's config and weights: cached codes are only reused by the same codec."""
    digest = hashlib.sha1(json.dumps(codec.config.to_dict(), sort_keys=True, default=str).encode())
    for name, tensor in sorted(codec.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().sum().item().hex().encode())
    return digest.hexdigest()[:16]


def _record_key(audio_value: Any, fingerprint: str) -> str:
    digest = hashlib.sha1(fingerprint.encode())
    if isinstance(audio_value, dict) and audio_value.get("bytes"):
        digest.update(audio_value["bytes"])
    else:
        path = audio_value.get("path") if isinstance(audio_value, dict) else audio_value
        stat = os.stat(path)
        digest.update(f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def _has_audio(audio_value: Any) -> bool:
    """Whether a record's audio cell holds a path or bytes (a manifest's empty cell holds neither)."""
    if isinstance(audio_value, dict):
        return bool(audio_value.get("bytes") or audio_value.get("path"))
    return bool(audio_value)


def _describe(audio_value: Any) -> str:
    if not _has_audio(audio_value):
        return "<empty audio cell>"
    if isinstance(audio_value, dict):
        return str(audio_value.get("path") or "<bytes>")
    return str(audio_value)


def _cached_codes(path: Path, num_codebooks: int) -> np.ndarray | None:
    """The codes cached at `path`, or None when there are none or the file is not readable codes
    `[num_codebooks, frames]` (a corrupt entry is encoded again and overwritten)."""
    if not path.exists():
        return None
    try:
        codes = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if codes.ndim != 2 or codes.shape[0] != num_codebooks or codes.shape[1] == 0 or codes.dtype.kind not in "iu":
        return None
    return codes


def prepare_dataset(
    records,
    codec,
    cache_dir: str | os.PathLike,
    batch_size: int = 8,
    min_seconds: float = MIN_SECONDS,
    max_seconds: float = MAX_SECONDS,
    progress: bool = True,
    report_path: str | os.PathLike | None = None,
    min_speech_fraction: float = MIN_SPEECH_FRACTION,
):
    """Validate, resample and encode every record once; returns (dataset, report).

    The dataset has columns `text`, `speaker`, `codes` (`[num_codebooks][frames]` ints), `frames`
    and `source`. Codes are cached per record under `cache_dir` (keyed by the audio and the codec's
    fingerprint), so a second call, or a call after an interruption, encodes only what is missing.
    Items are encoded `batch_size` at a time (the codec is causal: right padding leaves codes
    unchanged). Skipped records are listed in the report (also written to `report_path` as JSON);
    see `check_record` for the reasons and `min_seconds`, `max_seconds`, `min_speech_fraction`.
    """
    import datasets
    from tqdm.auto import tqdm

    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    fingerprint = codec_fingerprint(codec)
    report = PreparationReport(total=len(records))
    kept: dict[int, dict] = {}
    pending: list[tuple[int, dict, np.ndarray, Path]] = []

    def flush():
        if not pending:
            return
        encoded = codec.encode([item[2] for item in pending], sampling_rate=codec.sampling_rate, max_seconds=max_seconds + 1)
        for (index, row, _, path), codes, length in zip(pending, encoded.audio_codes, encoded.lengths):
            codes = codes[:, : int(length)].to("cpu", torch.int32).numpy()
            np.save(path.with_suffix(".tmp.npy"), codes)
            os.replace(path.with_suffix(".tmp.npy"), path)  # atomic: an interrupted run leaves no half file
            kept[index] = {**row, "codes": codes.tolist(), "frames": int(codes.shape[1])}
        pending.clear()

    for index, record in enumerate(tqdm(records, desc="encoding", disable=not progress)):
        audio_value, text = record["audio"], record["text"]
        source = _describe(audio_value)
        row = {"text": (text or "").strip(), "speaker": record.get("speaker", "0"), "source": source}
        if not _has_audio(audio_value):
            report.skipped.append(Skipped(index, source, "empty audio", "the audio cell is empty (neither a path nor bytes)"))
            continue
        try:
            path = cache / f"{_record_key(audio_value, fingerprint)}.npy"
        except (OSError, TypeError) as error:
            report.skipped.append(Skipped(index, source, "unreadable", str(error)))
            continue
        codes = _cached_codes(path, codec.num_codebooks) if text and text.strip() else None
        if codes is not None:
            kept[index] = {**row, "codes": codes.tolist(), "frames": int(codes.shape[1])}
            report.from_cache += 1
            continue
        try:
            samples = read_record_audio(audio_value, codec.sampling_rate)
        except ValueError as error:  # read_audio turns every decoding failure into a ValueError
            report.skipped.append(Skipped(index, source, "unreadable", str(error)))
            continue
        problem = check_record(text, samples, codec.sampling_rate, min_seconds, max_seconds, min_speech_fraction)
        if problem is not None:
            report.skipped.append(Skipped(index, source, *problem))
            continue
        pending.append((index, row, samples, path))
        if len(pending) >= batch_size:
            flush()
    flush()

    report.kept = len(kept)
    rows = [kept[index] for index in sorted(kept)]
    features = datasets.Features(
        {
            "text": datasets.Value("string"),
            "speaker": datasets.Value("string"),
            "source": datasets.Value("string"),
            "codes": datasets.Sequence(datasets.Sequence(datasets.Value("int32"))),
            "frames": datasets.Value("int32"),
        }
    )
    dataset = datasets.Dataset.from_list(rows, features=features) if rows else datasets.Dataset.from_dict(
        {name: [] for name in features}, features=features
    )
    if report_path is not None:
        write_text_atomic(report_path, json.dumps(report.to_json(), indent=2))
    return dataset, report
