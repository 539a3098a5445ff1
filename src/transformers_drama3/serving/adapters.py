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
deleted adapter is forgotten at once (no new request gets it); its slot is freed when the last
request that holds it ends. An adapter registered from an upload is stored under `storage`
(written to a temporary folder, checked, then renamed) and removed from there when deleted;
an adapter registered from a server path is only read.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import itertools
import json
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .adapter_layers import ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_FILE, AdapterError, AdapterSlots, read_adapter
from .routing import AdapterSlotsBusy, routed  # noqa: F401  (AdapterSlotsBusy: re-exported)
from .voices import check_voice_id

ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_FILE)


class AdapterExists(Exception):
    """An adapter of that name is registered already."""


@dataclass
class _Entry:
    name: str
    path: str
    owned: bool  # stored by the registry (an upload): its folder goes when the adapter does
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
    max_rank: the largest LoRA rank a slot holds; storage: where uploaded adapters are kept;
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

    def register(self, name: str, path: str | os.PathLike, owned: bool = False) -> None:
        """Check the adapter folder `path` against the model and register it as `name` (loaded now
        when a slot is free or can be freed). Raises AdapterError (the registry is unchanged),
        AdapterExists, or ValueError for a bad name."""
        check_voice_id(name)
        with self._lock:
            if name in self._entries:
                raise AdapterExists(f"id: an adapter {name!r} is registered; delete it first")
        weights = read_adapter(path, self.model, self.max_rank, name)
        with self._lock:
            if name in self._entries:
                raise AdapterExists(f"id: an adapter {name!r} is registered; delete it first")
            entry = _Entry(name, os.fspath(path), owned, next(self._uids))
            self._entries[name] = entry
            slot = self._take_slot()
            if slot is not None:
                self._load(entry, slot, weights)

    def register_path(self, name: str, path: str) -> None:
        """Register an adapter folder of the server's own disk, which must lie under `allowed_root`."""
        if self.allowed_root is None:
            raise PermissionError("path: this server reads no adapter folders from its disk (start it with "
                                  "--adapter-root DIR to allow those under DIR)")
        resolved = (self.allowed_root / path).resolve()
        if resolved != self.allowed_root and self.allowed_root not in resolved.parents:
            raise PermissionError(f"path: {path!r} lies outside the folder this server reads adapters from")
        self.register(name, resolved)

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
            read_adapter(staging, self.model, self.max_rank, name)  # refused here: nothing is in place yet
            if target.exists():
                raise AdapterExists(f"id: a stored adapter folder {name!r} exists; delete the adapter first")
            os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        try:
            self.register(name, target, owned=True)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise

    def delete(self, name: str) -> None:
        """Forget `name` now; its slot (and an uploaded adapter's folder) goes when no request holds it."""
        with self._lock:
            entry = self._entries.pop(name)  # KeyError: no such adapter
            entry.deleted = True
            if entry.leases == 0:
                self._unload(entry)

    # ---- requests -----------------------------------------------------------------------------

    def acquire(self, name: str) -> Lease:
        """Hold `name`'s slot for a request, loading it when it is not loaded. KeyError: no such
        adapter; AdapterSlotsBusy: every slot serves running requests; AdapterError: its folder
        changed since it was registered and no longer fits the model."""
        with self._lock:
            entry = self._entries[name]
            if entry.slot is None:
                slot = self._take_slot()
                if slot is None:
                    raise AdapterSlotsBusy(f"voice: all {self.slots.slots - 1} adapter slots serve running "
                                           "requests with other adapters; retry when one ends")
                try:
                    weights = read_adapter(entry.path, self.model, self.max_rank, name)
                except BaseException:
                    self._free.append(slot)
                    raise
                self._load(entry, slot, weights)
            entry.leases += 1
            entry.last_used = time.monotonic()
            return Lease(self, entry)

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
        if entry.owned:
            shutil.rmtree(entry.path, ignore_errors=True)

    def _sweep_staging(self) -> None:
        for child in self.storage.iterdir():
            if child.name.startswith(".staging."):
                shutil.rmtree(child, ignore_errors=True)

    def register_stored(self) -> list[str]:
        """Register the adapters uploaded before a restart (the folders under `storage`); a folder
        that no longer fits the model is skipped and named in the returned list."""
        skipped = []
        for child in sorted(self.storage.iterdir()) if self.storage is not None else []:
            if child.name.startswith(".") or not child.is_dir() or child.name in self:
                continue
            try:
                self.register(child.name, child, owned=True)
            except (AdapterError, ValueError) as error:
                skipped.append(f"{child.name}: {error}")
        return skipped


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

