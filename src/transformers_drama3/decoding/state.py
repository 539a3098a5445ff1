"""The one decode cache and the one decode state: preallocated, fixed shapes, written in place.

`DecodeCache` holds what a decode run remembers, set up once per run (as gpt-fast's
`setup_caches`) and filled in place by the prefill, by `extend` and by every decode step:

    backbone attention layers   keys / values [batch, kv_heads, capacity, head_dim]
    Gated DeltaNet layers       conv / recurrent states (fixed shapes, transformers' own layer,
                                updated in place)
    tower layers                keys / values [batch, kv_heads, capacity, head_dim]

Row r of a prompt (left padding included) and of the decoded frames lives in column r. Each part
(backbone, tower) keeps `next_column`, a 0-d tensor: where its next row goes. The backbone always
holds one row more than the tower: the open row, fed through the backbone but not yet through the
tower, whose next row is not drawn yet.

`window` says how many columns an attention layer reads: the columns filled so far on the eager
path (exactly the keys a growing cache would hold, so the eager path computes what a dynamic cache
computes), every column when the step is compiled (one shape for every step).

`DecodeState` is everything else a step reads, in tensors of fixed shape (see its docstring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, LinearAttentionLayer

MIN_COMPILED_CAPACITY = 256
"""The smallest cache a compiled run gets; capacities round up to powers of two from here, so one
compiled step serves every request of the same batch size and length class."""


def compiled_capacity(rows: int) -> int:
    """Columns for a compiled run that may feed `rows` rows: the next power of two >= `rows` (at
    least `MIN_COMPILED_CAPACITY`)."""
    return max(MIN_COMPILED_CAPACITY, 1 << max(0, math.ceil(math.log2(max(rows, 1)))))


class _Part:
    """The bookkeeping one set of attention layers shares: where the next row goes (`next_column`,
    a 0-d long tensor), how many columns are filled (`filled`, known on the host), how many columns
    the layers read (`window`), and the capacity."""

    def __init__(self, capacity: int, device: torch.device):
        self.capacity = capacity
        self.next_column = torch.zeros((), dtype=torch.long, device=device)
        self.filled = 0
        self.window = 0


class ColumnKeysLayer(CacheLayerMixin):
    """An attention layer's keys and values in preallocated columns: `update` writes the new rows
    at the part's `next_column` onward (the same columns for every item) and returns the first
    `window` columns. The part, not the layer, moves `next_column` on after a forward."""

    is_compileable = True

    def __init__(self, part: _Part):
        super().__init__()
        self.part = part

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        shape = (batch, heads, self.part.capacity, dim)
        self.keys = key_states.new_zeros(shape)
        self.values = value_states.new_zeros(value_states.shape[:2] + (self.part.capacity, value_states.shape[-1]))
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states, value_states: [batch, kv_heads, rows, head_dim] -> the first `window`
        columns of every item, [batch, kv_heads, window, head_dim]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        columns = self.part.next_column + torch.arange(key_states.shape[-2], device=key_states.device)
        self.keys.index_copy_(2, columns, key_states)
        self.values.index_copy_(2, columns, value_states)
        window = self.part.window
        return self.keys[:, :, :window], self.values[:, :, :window]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.part.window, 0

    def get_seq_length(self) -> int:
        return self.part.filled

    def get_max_length(self) -> int:
        return self.part.capacity

    def grow(self, capacity: int) -> None:
        if self.is_initialized:
            self.keys = _grown(self.keys, capacity)
            self.values = _grown(self.values, capacity)


def _grown(tensor: torch.Tensor, capacity: int) -> torch.Tensor:
    grown = tensor.new_zeros(tensor.shape[:2] + (capacity, tensor.shape[-1]))
    grown[:, :, : tensor.shape[2]].copy_(tensor)
    return grown


class DecodeCache:
    """The preallocated cache of one decode run (see the module docstring).

    backbone / tower: transformers `Cache`s the model reads and writes (`model.prefill`,
    `model.extend`, the decode step); `capacity` columns each."""

    def __init__(self, model, capacity: int, device: torch.device):
        text = model.config.text_config
        self.capacity = capacity
        self.backbone_part = _Part(capacity, device)
        self.tower_part = _Part(capacity, device)
        self.backbone = Cache(layers=[
            LinearAttentionLayer() if kind == "linear_attention" else ColumnKeysLayer(self.backbone_part)
            for kind in text.layer_types[: text.num_hidden_layers]
        ])
        self.tower = Cache(layers=[ColumnKeysLayer(self.tower_part) for _ in model.tower_layers])
        self.compiled = False

    def get_seq_length(self) -> int:
        """Rows the backbone holds."""
        return self.backbone_part.filled

    @property
    def parts(self) -> tuple[_Part, _Part]:
        return self.backbone_part, self.tower_part

    def open_window(self, part: _Part, rows: int) -> None:
        """Before a forward that writes `rows` rows into `part`: the layers read every column a
        compiled step reads, else the filled ones and the new rows."""
        if part.filled + rows > part.capacity:
            raise ValueError(f"the decode cache holds {part.capacity} rows; {part.filled + rows} asked for")
        part.window = part.capacity if self.compiled else part.filled + rows

    def advance(self, part: _Part, rows: int) -> None:
        """After a forward that wrote `rows` rows into `part` (host side; a compiled step moves
        `next_column` itself)."""
        part.filled += rows

    def reserve(self, rows: int) -> None:
        """Make room for `rows` more backbone rows (eager runs that grow turn by turn: the text
        stream); a compiled run's capacity is fixed when it is set up."""
        needed = self.backbone_part.filled + rows
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity)
        for layer in (*self.backbone.layers, *self.tower.layers):
            if isinstance(layer, ColumnKeysLayer):
                layer.grow(capacity)
        self.capacity = self.backbone_part.capacity = self.tower_part.capacity = capacity

    def mark_static(self) -> None:
        """For a compiled step: every layer reads the whole capacity, and the cache's tensors keep
        their addresses (CUDA graphs replay on them)."""
        self.compiled = True
        for part in self.parts:
            torch._dynamo.mark_static_address(part.next_column)
        for layer in (*self.backbone.layers, *self.tower.layers):
            if isinstance(layer, ColumnKeysLayer) and layer.is_initialized:
                torch._dynamo.mark_static_address(layer.keys)
                torch._dynamo.mark_static_address(layer.values)


@dataclass
class DecodeState:
    """Where a decode run stands between steps; every field is a tensor of fixed shape.

    hidden [batch, 1, dim], ids [batch, 1], codes [batch, 1, num_codebooks]: the open row (fed
    through the backbone, its next row not drawn yet); key_mask bool [batch, capacity]: the
    columns holding rows of each item (padding excluded), the open row's included; position
    [batch, 1]: the open row's position (padding skipped); active [batch]: still speaking;
    produced [batch]: frames made; budgets [batch]: frames each item may make; separators_left
    [batch]: line boundaries each item may still draw (zeros for a layout without lines);
    alignment: the phoneme-alignment tracker of the run, or None (host-side state: eager only)."""

    hidden: torch.Tensor
    ids: torch.Tensor
    codes: torch.Tensor
    key_mask: torch.Tensor
    position: torch.Tensor
    active: torch.Tensor
    produced: torch.Tensor
    budgets: torch.Tensor
    separators_left: torch.Tensor
    alignment: object | None = None

    @property
    def batch(self) -> int:
        return self.ids.shape[0]

    def attention_mask(self, rows: int) -> torch.Tensor:
        """The first `rows` columns of the key mask as a [batch, rows] long padding mask (what
        transformers' mask builders take)."""
        return self.key_mask[:, :rows].long()


def empty_state(model, batch: int, capacity: int, device: torch.device) -> DecodeState:
    """A state holding no row yet (a prefill opens it)."""
    config = model.config
    return DecodeState(
        hidden=torch.zeros(batch, 1, config.text_config.hidden_size, device=device),
        ids=torch.zeros(batch, 1, dtype=torch.long, device=device),
        codes=torch.zeros(batch, 1, config.num_codebooks, dtype=torch.long, device=device),
        key_mask=torch.zeros(batch, capacity, dtype=torch.bool, device=device),
        position=torch.zeros(batch, 1, dtype=torch.long, device=device),
        active=torch.ones(batch, dtype=torch.bool, device=device),
        produced=torch.zeros(batch, dtype=torch.long, device=device),
        budgets=torch.zeros(batch, dtype=torch.long, device=device),
        separators_left=torch.zeros(batch, dtype=torch.long, device=device),
    )


@dataclass
class Drama3Cache:
    """A growing cache: the backbone's hybrid `DynamicCache` and one for the tower's layers.

    What the serving engine's slots and its voice-prefix cache still hold; `DecodeCache` is the
    cache of every other decode run."""

    backbone: DynamicCache
    tower: DynamicCache

    @classmethod
    def empty(cls, config) -> Drama3Cache:
        return cls(backbone=DynamicCache(config=config.text_config), tower=DynamicCache())

    def get_seq_length(self) -> int:
        return self.backbone.get_seq_length()
