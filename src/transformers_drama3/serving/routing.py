"""Which adapter each batch item speaks with, per thread (`routed`), and the adapter errors the
routes answer: what the engine and the routes need of adapters, without loading the adapter code
(`adapter_layers`, `adapters`), which a server imports only once it is given adapters.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch


class AdapterSlotsBusy(Exception):
    """Every slot holds an adapter that a running request uses."""


class AdapterError(ValueError):
    """An adapter folder that cannot be served by this model; the message names what differs."""


class _Routing(threading.local):
    index: torch.Tensor | None = None


_ROUTING = _Routing()


@contextmanager
def routed(index: torch.Tensor | None):
    """Within the block, this thread's forwards give batch item i the adapter in slot `index[i]`
    (index: long [items], or [1] for every item; None: the base model)."""
    previous = _ROUTING.index
    _ROUTING.index = index
    try:
        yield
    finally:
        _ROUTING.index = previous


def routing_index() -> torch.Tensor | None:
    """This thread's slot index (`routed`), None outside any."""
    return _ROUTING.index
