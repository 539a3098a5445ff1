"""The running batch's decode state, one batch row per request (slot).

Each row holds one request's backbone hybrid state (Gated DeltaNet conv + recurrent states, the
attention layers' keys/values) and its tower keys/values, inside one `Drama3Cache` whose batch
dimension is the running batch. Requests have different lengths: keys/values are left-padded to a
common length and a `[batch, keys]` attention mask marks each row's real keys, exactly as
`generate()` runs a left-padded static batch (positions come from the mask, so padding never
shifts a row). The state is rebuilt only when the batch changes: a request that joins is
prefilled alone and its state is padded and appended (`join`); requests that leave are dropped
(`keep`), and key columns no row uses any more are cut off (`trim`).

At a step boundary (a backbone output ready, the next main token not drawn yet) a row with
`mask` length T has T backbone keys and T - 1 tower keys (the tower takes the current row when
the frame is drawn).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _layer_key_tensors(layer) -> list[str]:
    """Names of a cache layer's tensors that have a key axis (dim -2): keys and values."""
    if getattr(layer, "keys", None) is None or not torch.is_tensor(layer.keys) or layer.keys.numel() == 0:
        return []
    return ["keys", "values"]


def _state_dicts(layer) -> list[dict]:
    """A linear-attention layer's per-state dicts (conv and recurrent), batch first."""
    return [states for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)) if states]


def _map_cache(cache, on_keys, on_state) -> None:
    """Apply `on_keys(tensor)` to every key/value tensor and `on_state(tensor)` to every
    recurrent/conv state of a `DynamicCache` (in place on the layer objects)."""
    for layer in cache.layers:
        for name in _layer_key_tensors(layer):
            setattr(layer, name, on_keys(getattr(layer, name)))
        for states in _state_dicts(layer):
            for index, state in states.items():
                if state is not None:
                    states[index] = on_state(state)


def left_pad_cache(cache, columns: int) -> None:
    """Add `columns` zero keys on the left of every key/value tensor `[batch, heads, keys, dim]`."""
    if columns:
        _map_cache(cache, lambda t: F.pad(t, (0, 0, columns, 0)), lambda t: t)


def select_rows(cache, rows: torch.Tensor) -> None:
    """Keep the batch rows `rows` (a long tensor) of every tensor of a `DynamicCache`."""
    _map_cache(cache, lambda t: t.index_select(0, rows.to(t.device)), lambda t: t.index_select(0, rows.to(t.device)))


def cut_left(cache, columns: int) -> None:
    """Drop the first `columns` keys of every key/value tensor."""
    if columns:
        _map_cache(cache, lambda t: t[:, :, columns:].contiguous(), lambda t: t)


def _concatenate(running, joining) -> None:
    """Append `joining`'s batch rows to `running` (same layer structure, same key lengths)."""
    for layer, other in zip(running.layers, joining.layers, strict=True):
        for name in _layer_key_tensors(layer):
            setattr(layer, name, torch.cat((getattr(layer, name), getattr(other, name)), dim=0))
        for states, other_states in zip(_state_dicts(layer), _state_dicts(other), strict=True):
            for index, state in states.items():
                if state is not None:
                    states[index] = torch.cat((state, other_states[index]), dim=0)


class SlotBatch:
    """The decode state of the running batch (the plain reference of `slot_pool.SlotPool`).

    hidden: [batch, 1, dim] backbone output of each row's current row; input_ids [batch, 1] and
    audio_codes [batch, 1, num_codebooks]: the current row; mask: [batch, keys] (left padding).
    `SlotBatch.empty()` holds no request yet.
    """

    def __init__(self, cache, hidden, input_ids, audio_codes, mask):
        self.cache, self.hidden, self.input_ids, self.audio_codes, self.mask = cache, hidden, input_ids, audio_codes, mask

    @classmethod
    def empty(cls) -> SlotBatch:
        return cls(None, None, None, None, None)

    @property
    def size(self) -> int:
        return 0 if self.mask is None else self.mask.shape[0]

    def join(self, other: SlotBatch) -> None:
        """Append `other`'s rows (a freshly prefilled request), padding the shorter side's keys."""
        if self.size == 0:
            self.cache, self.hidden, self.input_ids = other.cache, other.hidden, other.input_ids
            self.audio_codes, self.mask = other.audio_codes, other.mask
            return
        length = max(self.mask.shape[1], other.mask.shape[1])
        for batch in (self, other):
            missing = length - batch.mask.shape[1]
            if missing:
                left_pad_cache(batch.cache.backbone, missing)
                left_pad_cache(batch.cache.tower, missing)
                batch.mask = F.pad(batch.mask, (missing, 0))
        _concatenate(self.cache.backbone, other.cache.backbone)
        _concatenate(self.cache.tower, other.cache.tower)
        self.hidden = torch.cat((self.hidden, other.hidden))
        self.input_ids = torch.cat((self.input_ids, other.input_ids))
        self.audio_codes = torch.cat((self.audio_codes, other.audio_codes))
        self.mask = torch.cat((self.mask, other.mask))

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows` [kept] (in that order)."""
        if rows.numel() == 0:
            self.__init__(None, None, None, None, None)
            return
        select_rows(self.cache.backbone, rows)
        select_rows(self.cache.tower, rows)
        rows = rows.to(self.mask.device)
        self.hidden, self.input_ids = self.hidden[rows], self.input_ids[rows]
        self.audio_codes, self.mask = self.audio_codes[rows], self.mask[rows]
        self.trim()

    def open_row(self) -> None:
        """Every row gains its next row (the one `decode_row` is about to feed)."""
        self.mask = torch.cat((self.mask, self.mask.new_ones(self.size, 1)), dim=1)

    def set_current(self, hidden: torch.Tensor, input_ids: torch.Tensor, audio_codes: torch.Tensor) -> None:
        self.hidden, self.input_ids, self.audio_codes = hidden, input_ids, audio_codes

    def trim(self) -> None:
        """Cut the leading key columns that are padding in every row."""
        used = self.mask.bool().any(dim=0)
        first = int(used.nonzero()[0]) if bool(used.any()) else 0
        if first:
            cut_left(self.cache.backbone, first)
            cut_left(self.cache.tower, first)
            self.mask = self.mask[:, first:]
