"""A preallocated slot pool: the running batch's decode state in fixed tensors, written in place.

Where `slots.SlotBatch` (the plain reference) keeps one `Drama3Cache` whose keys grow by
concatenation every step and are re-padded whenever a request joins, the pool allocates, per
layer, one tensor for all slots once (the way SGLang keeps a mamba-state pool beside its KV pool):

    attention keys/values   [slots, kv_heads, capacity, head_dim]   (backbone attention + tower)
    Gated DeltaNet states   conv [slots, channels, kernel], recurrent [slots, heads, k_dim, v_dim]
    mask                    [slots, capacity]   1 on each slot's real rows

Running requests occupy slots 0..B-1. Slot b holds n_b rows from column 0 on (no left padding):
each step writes one key per slot at column n_b - 1 and attends over the first max(n_b) columns,
its mask hiding the columns past its own length; positions come from the mask, as in
`generate()`. A request joins by copying its prefilled state into slot B; a request that leaves
is filled by moving the later slots down. The model is handed views of the pool, so the
Gated DeltaNet layers update their slots in place and attention layers write their one new key.
Capacity doubles (one copy) when a slot outgrows it.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, LinearAttentionLayer

from .decoding import Drama3Cache
from .slots import SlotBatch

INITIAL_CAPACITY = 512
"""Key columns allocated at first; doubled as needed."""


class PooledKeysLayer(DynamicLayer):
    """An attention layer's cache over pool views: `update` writes each slot's one new key at its
    own column and returns the first `window` columns of every running slot."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, write_at: torch.Tensor, window: int):
        super().__init__()
        self.keys_pool, self.values_pool, self.write_at, self.window = keys, values, write_at, window
        self.rows = torch.arange(write_at.shape[0], device=keys.device)
        self.device, self.is_initialized = keys.device, True
        self.keys, self.values = keys[: len(self.rows), :, : window - 1], values[: len(self.rows), :, : window - 1]

    def update(self, key_states, value_states, *args, **kwargs):
        """key_states, value_states: [batch, kv_heads, 1, head_dim] -> [batch, kv_heads, window, head_dim]."""
        self.keys_pool[self.rows, :, self.write_at] = key_states[:, :, 0]
        self.values_pool[self.rows, :, self.write_at] = value_states[:, :, 0]
        batch = len(self.rows)
        self.keys, self.values = self.keys_pool[:batch, :, : self.window], self.values_pool[:batch, :, : self.window]
        return self.keys, self.values


def _linear_layer_view(conv: torch.Tensor, recurrent: torch.Tensor, batch: int) -> LinearAttentionLayer:
    """A Gated DeltaNet layer's cache whose states are the first `batch` slots of the pool (views:
    the layer's in-place updates land in the pool)."""
    layer = LinearAttentionLayer()
    layer.conv_states[0], layer.recurrent_states[0] = conv[:batch], recurrent[:batch]
    layer.conv_kernel_size[0] = conv.shape[-1]
    layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
    layer.has_previous_state[0] = True
    layer.device, layer.dtype = conv.device, conv.dtype
    return layer


class _CachePool:
    """The pooled tensors of one `DynamicCache` (every layer), allocated from a prefilled example."""

    def __init__(self, example: DynamicCache, slots: int, capacity: int):
        self.layers = []  # per layer: ("keys", keys, values) or ("linear", conv, recurrent)
        for layer in example.layers:
            if isinstance(layer, LinearAttentionLayer):
                conv, recurrent = layer.conv_states[0], layer.recurrent_states[0]
                self.layers.append(("linear", conv.new_zeros(slots, *conv.shape[1:]),
                                    recurrent.new_zeros(slots, *recurrent.shape[1:])))
            else:
                keys = layer.keys
                shape = (slots, keys.shape[1], capacity, keys.shape[3])
                self.layers.append(("keys", keys.new_zeros(shape), keys.new_zeros(shape)))

    def store(self, slot: int, cache: DynamicCache) -> None:
        """Copy a one-row cache into `slot` (keys from column 0)."""
        for (kind, first, second), layer in zip(self.layers, cache.layers, strict=True):
            if kind == "linear":
                first[slot].copy_(layer.conv_states[0][0])
                second[slot].copy_(layer.recurrent_states[0][0])
            else:
                length = layer.keys.shape[2]
                first[slot, :, :length].copy_(layer.keys[0])
                second[slot, :, :length].copy_(layer.values[0])

    def move(self, source: int, target: int, columns: int) -> None:
        for kind, first, second in self.layers:
            if kind == "linear":
                first[target].copy_(first[source])
                second[target].copy_(second[source])
            else:
                first[target, :, :columns].copy_(first[source, :, :columns])
                second[target, :, :columns].copy_(second[source, :, :columns])

    def grow(self, capacity: int) -> None:
        grown = []
        for kind, first, second in self.layers:
            if kind == "keys":
                shape = (first.shape[0], first.shape[1], capacity, first.shape[3])
                new_first, new_second = first.new_zeros(shape), second.new_zeros(shape)
                new_first[:, :, : first.shape[2]].copy_(first)
                new_second[:, :, : second.shape[2]].copy_(second)
                first, second = new_first, new_second
            grown.append((kind, first, second))
        self.layers = grown

    def view(self, batch: int, write_at: torch.Tensor, window: int) -> DynamicCache:
        cache = DynamicCache()
        cache.layers = [
            _linear_layer_view(first, second, batch) if kind == "linear"
            else PooledKeysLayer(first, second, write_at, window)
            for kind, first, second in self.layers
        ]
        return cache


class SlotPool:
    """The running batch in preallocated slots; the same interface as `slots.SlotBatch`.

    hidden [batch, 1, dim], input_ids [batch, 1], audio_codes [batch, 1, num_codebooks]: each
    running slot's current row; `mask` [batch, max rows] and `cache` are views for the model.
    """

    def __init__(self, slots: int, capacity: int = INITIAL_CAPACITY):
        self.slots, self.capacity = slots, capacity
        self.backbone: _CachePool | None = None
        self.tower: _CachePool | None = None
        self.lengths = torch.zeros(slots, dtype=torch.long)
        self.size = 0

    # ---- the model's views ------------------------------------------------------------------

    @property
    def mask(self) -> torch.Tensor:
        return self.mask_pool[: self.size, : self.window]

    @property
    def window(self) -> int:
        return int(self.lengths[: self.size].max())

    @property
    def cache(self) -> Drama3Cache:
        """Views for the next model call: each slot writes at column n_b - 1 (the tower takes the
        current row; after `open_row`, the backbone takes the new one)."""
        write_at = (self.lengths[: self.size] - 1).to(self.mask_pool.device)
        window = self.window
        return Drama3Cache(backbone=self.backbone.view(self.size, write_at, window),
                           tower=self.tower.view(self.size, write_at, window))

    @property
    def hidden(self) -> torch.Tensor:
        return self.hidden_pool[: self.size]

    @property
    def input_ids(self) -> torch.Tensor:
        return self.ids_pool[: self.size]

    @property
    def audio_codes(self) -> torch.Tensor:
        return self.codes_pool[: self.size]

    # ---- membership ---------------------------------------------------------------------------

    def join(self, other: SlotBatch) -> None:
        """Copy a freshly prefilled request (a one-row `SlotBatch`) into the next free slot."""
        if other.size != 1:
            raise ValueError(f"a slot takes one prefilled request; got a batch of {other.size}")
        if self.size >= self.slots:
            raise ValueError(f"every one of the {self.slots} slots is taken")
        rows = other.mask.shape[1]
        if self.backbone is None:
            self._allocate(other, max(self.capacity, 2 * rows))
        while rows + 1 > self.capacity:
            self._grow()
        slot = self.size
        self.backbone.store(slot, other.cache.backbone)
        self.tower.store(slot, other.cache.tower)
        self.mask_pool[slot].zero_()
        self.mask_pool[slot, :rows] = 1
        self.lengths[slot] = rows
        self.hidden_pool[slot], self.ids_pool[slot], self.codes_pool[slot] = other.hidden[0], other.input_ids[0], other.audio_codes[0]
        self.size += 1

    def keep(self, rows: torch.Tensor) -> None:
        """Keep the running slots `rows` (ascending), moved down to 0..len(rows)-1 in that order."""
        columns = self.window
        for target, source in enumerate(rows.tolist()):
            if source != target:
                self._move(source, target, columns)
        self.size = rows.shape[0]

    def open_row(self) -> None:
        """Every running slot gains its next row (the one `decode_row` is about to feed)."""
        if self.window + 1 > self.capacity:
            self._grow()
        index = torch.arange(self.size, device=self.mask_pool.device)
        self.mask_pool[index, self.lengths[: self.size].to(self.mask_pool.device)] = 1
        self.lengths[: self.size] += 1

    def set_current(self, hidden: torch.Tensor, input_ids: torch.Tensor, audio_codes: torch.Tensor) -> None:
        self.hidden_pool[: self.size], self.ids_pool[: self.size], self.codes_pool[: self.size] = hidden, input_ids, audio_codes

    # ---- storage ------------------------------------------------------------------------------

    def _allocate(self, example: SlotBatch, capacity: int) -> None:
        self.capacity = capacity
        self.backbone = _CachePool(example.cache.backbone, self.slots, capacity)
        self.tower = _CachePool(example.cache.tower, self.slots, capacity)
        self.mask_pool = example.mask.new_zeros(self.slots, capacity)
        self.hidden_pool = example.hidden.new_zeros(self.slots, *example.hidden.shape[1:])
        self.ids_pool = example.input_ids.new_zeros(self.slots, *example.input_ids.shape[1:])
        self.codes_pool = example.audio_codes.new_zeros(self.slots, *example.audio_codes.shape[1:])

    def _grow(self) -> None:
        self.capacity *= 2
        self.backbone.grow(self.capacity)
        self.tower.grow(self.capacity)
        grown = self.mask_pool.new_zeros(self.slots, self.capacity)
        grown[:, : self.mask_pool.shape[1]] = self.mask_pool
        self.mask_pool = grown

    def _move(self, source: int, target: int, columns: int) -> None:
        self.backbone.move(source, target, columns)
        self.tower.move(source, target, columns)
        self.mask_pool[target] = self.mask_pool[source]
        self.lengths[target] = self.lengths[source]
        for pool in (self.hidden_pool, self.ids_pool, self.codes_pool):
            pool[target] = pool[source]
