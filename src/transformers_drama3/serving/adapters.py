"""Fine-tuned voices as LoRA adapters on the served model: the registry the server keeps.

    registry = AdapterRegistry(model, max_loaded=8, max_rank=16, storage="drama3-adapters")
    registry.register("me", "out/adapter")           # checked against the model, then loaded
    lease = registry.acquire("me")                   # a request holds its adapter's slot ...
    lease.slot                                       # ... the slot its batch item routes to
    lease.release()                                  # ... until it ends
    registry.delete("me")                            # unloads once no request holds it
    with registry.use("me"):                         # this thread's generate() speaks with it
        model.generate(...)

An adapter is *registered* (a name and a folder, checked) and, while requests use it or until a
newer one needs its slot, *loaded* into one of `max_loaded` slots of the model (`AdapterSlots`).
A request acquires its adapter (loading it from its folder when it is not loaded; the least
recently used adapter that no request holds gives up its slot), and releases it when it ends. A
deleted adapter is forgotten at once (no new request gets it), and so is what `storage` keeps of
it; its slot is freed when the last request that holds it ends. An adapter registered from an
upload is stored under `storage` (written to a temporary folder, checked, then renamed); one
registered from a server path (under `allowed_root`) is only read, and its path is kept in
`storage/.paths/<name>.json`: both kinds are registered again when a server starts
(`register_stored`). Every read of an adapter's files, at registration and at each reload into a
slot, takes them only as regular files inside their folder (`allowed_root`, or `storage` for an
upload) once every link is resolved, and happens outside the registry's lock: a slow or hostile
file delays only the request that asked for it.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import itertools
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..output_files import write_text_atomic
from .adapter_layers import ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_FILE, READ_SECONDS, AdapterError, AdapterSlots, read_adapter
from .routing import AdapterSlotsBusy, routed  # noqa: F401  (AdapterSlotsBusy: re-exported)
from .safe_files import is_inside, parse_json, read_regular_file
from .voices import check_voice_id

logger = logging.getLogger(__name__)

ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_FILE)
PATHS = ".paths"
"""The folder under `storage` that keeps the server paths adapters were registered from."""
MAX_PATH_CHARS = 1024
"""The longest `adapter.path` read (PATH_MAX is 4096 bytes; adapter folders are a few levels deep)."""


class AdapterExists(Exception):
    """An adapter of that name is registered already."""


@dataclass
class _Entry:
    name: str
    path: str  # the folder its files are read from
    root: Path | None  # the folder every file must lie in once its links are resolved (None: an operator's flag)
    record: Path | None  # what `storage` keeps of it (an upload's folder, a server path's record): goes with it
    uid: int  # changes whenever the adapter is (re)registered: the voice-prefix cache keys by it
    slot: int | None = None
    leases: int = 0
    last_used: float = field(default_factory=time.monotonic)
    deleted: bool = False


class Lease:
    """A request's hold on a loaded adapter: its `slot`, until `release()` (idempotent)."""

    def __init__(self, registry: AdapterRegistry, entry: _Entry):
        self.registry, self.entry, self.slot = registry, entry, entry.slot
        self.key = (entry.name, entry.uid)
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.registry._release(self.entry)


class AdapterRegistry:
    """The adapters a server knows, on `model` (see the module docstring).

    max_loaded: adapters loaded at once (the slots; slot 0 more is the base model);
    max_rank: the largest LoRA rank a slot holds; storage: where uploaded adapters and the server
    paths adapters were registered from are kept (None: nothing is kept);
    allowed_root: server folders under which `register_path` may read adapters (None: none)."""

    def __init__(self, model, max_loaded: int = 8, max_rank: int = 16, storage: str | os.PathLike | None = None,
                 allowed_root: str | os.PathLike | None = None):
        if max_loaded < 1:
            raise ValueError(f"max_loaded={max_loaded}; expected at least 1")
        self.model, self.max_rank = model, max_rank
        self.slots = AdapterSlots(model, max_loaded + 1, max_rank)
        self.storage = Path(storage) if storage is not None else None
        self.allowed_root = Path(allowed_root).resolve() if allowed_root is not None else None
        self._entries: dict[str, _Entry] = {}
        self._free = list(range(1, max_loaded + 1))
        self._lock = threading.RLock()
        self._uids = itertools.count(1)
        self.loads = 0
        if self.storage is not None:
            self.storage.mkdir(parents=True, exist_ok=True)
            self._sweep_staging()

    # ---- registering --------------------------------------------------------------------------

    def register(self, name: str, path: str | os.PathLike) -> None:
        """Check the adapter folder `path` against the model and register it as `name` (loaded now
        when a slot is free or can be freed). Raises AdapterError (the registry is unchanged),
        AdapterExists, or ValueError for a bad name. Not kept across restarts (an operator's
        `--adapter` flag, or Python)."""
        self._register(name, os.fspath(path), None, None)

    def register_path(self, name: str, path: str) -> None:
        """Register an adapter folder of the server's own disk, which must lie under `allowed_root`
        (its files too, once their links are resolved); kept across restarts when the registry has
        a `storage`."""
        folder = self._folder_under_root(path)
        record = self.storage / PATHS / f"{check_voice_id(name)}.json" if self.storage is not None else None
        self._register(name, folder, self.allowed_root, record, json.dumps({"path": path}))

    def _folder_under_root(self, path) -> str:
        """The folder a client's `path` names under `allowed_root`; PermissionError outside it."""
        if self.allowed_root is None:
            raise PermissionError("path: this server reads no adapter folders from its disk (start it with "
                                  "--adapter-root DIR to allow those under DIR)")
        if not isinstance(path, str) or not path or "\x00" in path or len(path) > MAX_PATH_CHARS:
            raise ValueError(f"path: expected a folder path under the server's adapter root (at most {MAX_PATH_CHARS} "
                             "characters, no NUL)")
        folder = os.path.join(self.allowed_root, path)  # an absolute path stays itself: refused unless inside
        if not is_inside(os.path.realpath(folder), str(self.allowed_root)):
            shown = path if len(path) <= 80 else path[:77] + "..."
            raise PermissionError(f"path: {shown!r} lies outside the folder this server reads adapters from")
        return folder

    def _register(self, name: str, folder: str, root: Path | None, record: Path | None,
                  record_text: str | None = None) -> None:
        """Read and check `folder` (its files inside `root`), then register it as `name`; `record_text`
        is written to `record` first (a server path kept for restarts; OSError: nothing registered)."""
        check_voice_id(name)
        with self._lock:
            if name in self._entries:
                raise AdapterExists(f"id: an adapter {name!r} is registered; delete it first")
        weights = read_adapter(folder, self.model, self.max_rank, name, root)
        with self._lock:
            if name in self._entries:
                raise AdapterExists(f"id: an adapter {name!r} is registered; delete it first")
            if record is not None and record_text is not None:
                record.parent.mkdir(exist_ok=True)
                write_text_atomic(record, record_text + "\n")
            entry = _Entry(name, folder, root, record, next(self._uids))
            self._entries[name] = entry
            slot = self._take_slot()
            if slot is not None:
                self._load(entry, slot, weights)

    def register_upload(self, name: str, files: dict[str, bytes]) -> None:
        """Store an uploaded adapter (`files`: adapter_config.json, adapter_model.safetensors and
        optionally drama3_base.json, as bytes) under `storage` and register it. The files are
        written to a temporary folder and checked there; only a good adapter is renamed into place."""
        if self.storage is None:
            raise PermissionError("adapter: this server stores no uploaded adapters")
        check_voice_id(name)
        unknown = sorted(set(files) - set(ADAPTER_FILES))
        if unknown:
            raise AdapterError(f"adapter {name!r}: unexpected files {unknown}; expected {list(ADAPTER_FILES)}")
        with self._lock:
            if name in self._entries:
                raise AdapterExists(f"id: an adapter {name!r} is registered; delete it first")
        staging = Path(tempfile.mkdtemp(dir=self.storage, prefix=f".staging.{name}."))
        try:
            for file, data in files.items():
                (staging / file).write_bytes(data)
            target = self.storage / name
            read_adapter(staging, self.model, self.max_rank, name, self.storage)  # refused here: nothing is in place yet
            if target.exists():
                raise AdapterExists(f"id: a stored adapter folder {name!r} exists; delete the adapter first")
            os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        try:
            self._register(name, os.fspath(target), self.storage, target)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise

    def delete(self, name: str) -> None:
        """Forget `name` now, and what `storage` keeps of it; its slot goes when no request holds it.
        KeyError: no such adapter (also for all but one of several deletes of one name at once)."""
        with self._lock:
            entry = self._entries.pop(name)  # KeyError: no such adapter
            entry.deleted = True
            if entry.leases == 0:
                self._unload(entry)
            aside = self._set_aside(entry.record)  # gone at once: the name can be registered again
        _remove(aside)

    def _set_aside(self, record: Path | None) -> Path | None:
        """Remove a path record, or move an upload's folder to a staging name (swept if we die here);
        returns what is left to remove."""
        if record is None or not record.exists():
            return None
        if not record.is_dir():
            record.unlink()
            return None
        aside = Path(tempfile.mkdtemp(dir=self.storage, prefix=f".staging.{record.name}."))
        os.rename(record, aside / record.name)
        return aside

    # ---- requests -----------------------------------------------------------------------------

    def acquire(self, name: str) -> Lease:
        """Hold `name`'s slot for a request, loading it when it is not loaded. KeyError: no such
        adapter; AdapterSlotsBusy: every slot serves running requests; AdapterError: its folder
        changed since it was registered and no longer fits the model (or left its root). The
        files are read outside the registry's lock: other requests go on meanwhile."""
        with self._lock:
            entry = self._entries[name]
            if entry.slot is not None:
                return self._lease(entry)
            if not self._free and not any(e.slot is not None and e.leases == 0 for e in self._entries.values()):
                raise self._busy()
        try:
            weights = read_adapter(entry.path, self.model, self.max_rank, name, entry.root)
        except AdapterError as error:
            logger.warning("adapters: %r cannot be loaded from %s: %s", name, entry.path, error)
            raise
        with self._lock:
            if self._entries.get(name) is not entry:
                raise KeyError(name)  # deleted (or deleted and registered again) while it was read
            if entry.slot is None:  # another request may have loaded it meanwhile
                slot = self._take_slot()
                if slot is None:
                    raise self._busy()
                self._load(entry, slot, weights)
            return self._lease(entry)

    def _lease(self, entry: _Entry) -> Lease:
        entry.leases += 1
        entry.last_used = time.monotonic()
        return Lease(self, entry)

    def _busy(self) -> AdapterSlotsBusy:
        return AdapterSlotsBusy(f"voice: all {self.slots.slots - 1} adapter slots serve running requests with other "
                                "adapters; retry when one ends")

    @contextlib.contextmanager
    def use(self, name: str):
        """Within the block, this thread's forwards (`generate()`, `stream()`, a text stream) speak
        with adapter `name`, every batch item alike; yields the lease."""
        lease = self.acquire(name)
        try:
            with routed(torch.tensor([lease.slot], device=self.model.device)):
                yield lease
        finally:
            lease.release()

    def _release(self, entry: _Entry) -> None:
        with self._lock:
            entry.leases -= 1
            entry.last_used = time.monotonic()
            if entry.deleted and entry.leases == 0:
                self._unload(entry)

    # ---- what the server lists ------------------------------------------------------------------

    def __contains__(self, name) -> bool:
        with self._lock:
            return name in self._entries

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def listing(self) -> list[dict]:
        with self._lock:
            return [{"voice_id": name, "name": name, "kind": "adapter", "loaded": entry.slot is not None}
                    for name, entry in sorted(self._entries.items())]

    def loaded(self) -> list[str]:
        with self._lock:
            return sorted(name for name, entry in self._entries.items() if entry.slot is not None)

    # ---- slots --------------------------------------------------------------------------------

    def _take_slot(self) -> int | None:
        """A free slot, or the slot of the least recently used adapter no request holds (unloaded)."""
        if self._free:
            return self._free.pop(0)
        idle = [entry for entry in self._entries.values() if entry.slot is not None and entry.leases == 0]
        if not idle:
            return None
        victim = min(idle, key=lambda entry: entry.last_used)
        slot, victim.slot = victim.slot, None
        return slot

    def _load(self, entry: _Entry, slot: int, weights) -> None:
        self.slots.write(slot, weights)
        entry.slot = slot
        entry.last_used = time.monotonic()
        self.loads += 1

    def _unload(self, entry: _Entry) -> None:
        if entry.slot is not None:
            self.slots.clear(entry.slot)
            self._free.append(entry.slot)
            entry.slot = None

    def _sweep_staging(self) -> None:
        """Remove what a write that was killed left: upload staging folders, half-written path records."""
        for child in self.storage.iterdir():
            if child.name.startswith(".staging."):
                shutil.rmtree(child, ignore_errors=True)
        for child in (self.storage / PATHS).iterdir() if (self.storage / PATHS).is_dir() else []:
            if child.name.startswith("."):
                _remove(child)

    def register_stored(self) -> list[str]:
        """Register the adapters kept under `storage` before a restart: uploads (the folders under
        it) and server paths (`.paths/<name>.json`, checked against this server's `allowed_root`).
        One that no longer loads is skipped (and kept on disk), named with its reason in the
        returned list."""
        if self.storage is None:
            return []
        skipped = []
        for child in sorted(self.storage.iterdir()):
            if child.name.startswith(".") or not child.is_dir() or child.name in self:
                continue
            try:
                self._register(child.name, os.fspath(child), self.storage, child)
            except (AdapterError, AdapterExists, ValueError, OSError) as error:
                skipped.append(f"{child.name}: {error}")
        records = self.storage / PATHS
        for record in sorted(records.iterdir()) if records.is_dir() else []:
            name = record.name.removesuffix(".json")
            if record.name.startswith(".") or not record.name.endswith(".json"):
                continue
            try:
                path = _recorded_path(record, self.storage)
                self._register(name, self._folder_under_root(path), self.allowed_root, record)
            except (AdapterError, AdapterExists, ValueError, OSError) as error:  # PermissionError is an OSError
                skipped.append(f"{name}: {error}")
        return skipped


def _recorded_path(record: Path, storage: Path) -> str:
    """The server path a record keeps (ValueError when the record is damaged)."""
    value = parse_json(read_regular_file(record, storage, 2 * MAX_PATH_CHARS + 64, READ_SECONDS, record.name), record.name)
    if not isinstance(value, dict) or not isinstance(value.get("path"), str):
        raise ValueError(f"{record.name}: expected {{\"path\": \"...\"}}")
    return value["path"]


def _remove(path: Path | None) -> None:
    """Remove a file or a folder tree, if there is one."""
    if path is None:
        return
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def parse_adapter_spec(spec: str) -> tuple[str, str]:
    """`NAME=PATH` (the `--adapter` flag) -> (name, path)."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--adapter {spec!r}: expected NAME=PATH (an adapter folder, e.g. me=out/adapter)")
    check_voice_id(name)
    return name, path


def decode_upload(adapter: dict) -> dict[str, bytes]:
    """The files of an uploaded adapter from `POST /v1/audio/voices`'s "adapter" object:
    {"adapter_config.json": an object or its text, "adapter_model.safetensors": base64,
    "drama3_base.json"?: an object or its text}. ValueError names the field."""
    if not isinstance(adapter, dict):
        raise ValueError("adapter: expected an object")
    unknown = sorted(set(adapter) - set(ADAPTER_FILES) - {"path"})
    if unknown:
        raise ValueError(f"adapter: unexpected fields {unknown}; expected 'path' or {list(ADAPTER_FILES)}")
    files = {}
    for file in (ADAPTER_CONFIG, BASE_FILE):
        value = adapter.get(file)
        if value is None:
            continue
        if not isinstance(value, (dict, str)):
            raise ValueError(f"adapter.{file}: expected an object or JSON text")
        files[file] = (json.dumps(value) if isinstance(value, dict) else value).encode("utf-8")
    weights = adapter.get(ADAPTER_WEIGHTS)
    if not isinstance(weights, str):
        raise ValueError(f"adapter.{ADAPTER_WEIGHTS}: expected the file in base64")
    try:
        files[ADAPTER_WEIGHTS] = base64.b64decode(weights, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"adapter.{ADAPTER_WEIGHTS}: not valid base64") from None
    if ADAPTER_CONFIG not in files:
        raise ValueError(f"adapter.{ADAPTER_CONFIG}: required")
    return files

