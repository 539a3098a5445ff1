"""The one decode cache and the one decode state: preallocated, fixed shapes, written in place.

`DecodeCache` holds what a decode run remembers, set up once per run (as gpt-fast's
`setup_caches`) and filled in place by the prefill, by `extend` and by every decode step:

    backbone attention layers   keys / values [batch, kv_heads, capacity, head_dim]
    Gated DeltaNet layers       conv / recurrent states (fixed shapes, transformers' own layer,
                                updated in place)
    tower layers                keys / values [batch, kv_heads, capacity, head_dim]

Row r of a prompt (left padding included) and of the decoded frames lives in column r. Each part
(backbone, tower) keeps `next_column` [batch]: where each item's next row goes (the same column
for every item of a left-padded batch; each its own in the serving engine, whose items are
requests that joined at different times). The backbone always holds one row more than the tower:
the open row, fed through the backbone but not yet through the tower, whose next row is not drawn
yet.

`window` says how many columns an attention layer reads: the columns filled so far on the eager
path (exactly the keys a growing cache would hold, so the eager path computes what a dynamic cache
computes), every column when the step is compiled (one shape for every step).

The serving engine keeps one cache of `max_batch` items as its pool of slots: a request is
prefilled into a one-item cache and `place`d into a free item; the engine steps the running items
through `head(n)`, a view of the first n.

`DecodeState` is everything else a step reads, in tensors of fixed shape (see its docstring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionLayer

MIN_COMPILED_CAPACITY = 256
"""The smallest cache a compiled run gets; capacities round up to powers of two from here, so one
compiled step serves every request of the same batch size and length class."""


def compiled_capacity(rows: int) -> int:
    """Columns for a compiled run that may feed `rows` rows: the next power of two >= `rows` (at
    least `MIN_COMPILED_CAPACITY`)."""
    return max(MIN_COMPILED_CAPACITY, 1 << max(0, math.ceil(math.log2(max(rows, 1)))))


class _Part:
    """The bookkeeping one set of attention layers shares: where each item's next row goes
    (`next_column` [batch]), how many columns the fullest item has filled (`filled`, known on the
    host), how many columns the layers read (`window`), and the capacity."""

    def __init__(self, capacity: int, next_column: torch.Tensor):
        self.capacity = capacity
        self.next_column = next_column
        self.filled = 0
        self.window = 0

    def head(self, items: int) -> _Part:
        view = _Part(self.capacity, self.next_column[:items])
        view.filled, view.window = self.filled, self.window
        return view


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
        """key_states, value_states: [batch, kv_heads, rows, head_dim], written at each item's
        next columns -> the first `window` columns of every item, [batch, kv_heads, window, head_dim]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, heads, rows, _ = key_states.shape
        columns = self.part.next_column[:, None] + torch.arange(rows, device=key_states.device)  # [batch, rows]
        self.keys.scatter_(2, columns[:, None, :, None].expand(batch, heads, rows, self.keys.shape[-1]), key_states)
        self.values.scatter_(2, columns[:, None, :, None].expand(batch, heads, rows, self.values.shape[-1]), value_states)
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


def linear_layer_counters(layer: LinearAttentionLayer) -> dict[str, torch.Tensor]:
    """The tensors a Gated DeltaNet layer's cache keeps besides its conv and recurrent states, by
    attribute name: transformers' token counter (`cumulative_length_linear`, a 0-d long tensor that
    every forward adds its rows to, in place). transformers creates it on the CPU and moves it to
    the states' device only in `lazy_initialization`, which a layer built here never runs."""
    return {name: value for name, value in vars(layer).items() if isinstance(value, torch.Tensor)}


def empty_linear_layer(device: torch.device) -> LinearAttentionLayer:
    """An empty Gated DeltaNet layer's cache whose counters are on `device` already: a prefill
    (eager, or compiled, where moving them inside the graph would leave them unmarked graph
    outputs) writes them in place."""
    layer = LinearAttentionLayer()
    for name, counter in linear_layer_counters(layer).items():
        setattr(layer, name, counter.to(device))
    return layer


def _linear_layer(conv: torch.Tensor, recurrent: torch.Tensor, counters: dict[str, torch.Tensor] | None = None) -> LinearAttentionLayer:
    """A Gated DeltaNet layer's cache over the given states (views: its in-place updates land in
    the tensors given), past its prefill. `counters`: the counters to share (a view of a pool shares
    the pool's, so their address stays the same for every view); by default new ones, on the
    states' device."""
    layer = empty_linear_layer(conv.device) if counters is None else LinearAttentionLayer()
    if counters is not None:
        for name, counter in counters.items():
            setattr(layer, name, counter)
    layer.conv_states[0], layer.recurrent_states[0] = conv, recurrent
    layer.conv_kernel_size[0] = conv.shape[-1]
    layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
    layer.has_previous_state[0] = True
    layer.device, layer.dtype = conv.device, conv.dtype
    return layer


def _grown(tensor: torch.Tensor, capacity: int) -> torch.Tensor:
    grown = tensor.new_zeros(tensor.shape[:2] + (capacity, tensor.shape[-1]))
    grown[:, :, : tensor.shape[2]].copy_(tensor)
    return grown


class DecodeCache:
    """The preallocated cache of one decode run (see the module docstring).

    backbone / tower: transformers `Cache`s the model reads and writes (`model.prefill`,
    `model.extend`, the decode step); `capacity` columns each."""

    def __init__(self, model, capacity: int, device: torch.device, batch: int = 1):
        text = model.config.text_config
        self.capacity = capacity
        self.backbone_part = _Part(capacity, torch.zeros(batch, dtype=torch.long, device=device))
        self.tower_part = _Part(capacity, torch.zeros(batch, dtype=torch.long, device=device))
        self.backbone = Cache(layers=[
            empty_linear_layer(device) if kind == "linear_attention" else ColumnKeysLayer(self.backbone_part)
            for kind in text.layer_types[: text.num_hidden_layers]
        ])
        self.tower = Cache(layers=[ColumnKeysLayer(self.tower_part) for _ in model.tower_layers])
        self.compiled = False

    # -- the serving engine's pool of slots ---------------------------------------------------------

    @classmethod
    def pool_like(cls, example: DecodeCache, items: int, capacity: int) -> DecodeCache:
        """An empty cache of `items` items, each shaped as the filled one-item `example`'s."""
        pool = cls.__new__(cls)
        pool.capacity, pool.compiled = capacity, False
        device = example.backbone_part.next_column.device
        pool.backbone_part = _Part(capacity, torch.zeros(items, dtype=torch.long, device=device))
        pool.tower_part = _Part(capacity, torch.zeros(items, dtype=torch.long, device=device))

        def layer_like(layer, part):
            if isinstance(layer, ColumnKeysLayer):
                empty = ColumnKeysLayer(part)
                keys, values = layer.keys, layer.values
                empty.lazy_initialization(keys.new_zeros(items, *keys.shape[1:]), values.new_zeros(items, *values.shape[1:]))
                return empty
            conv, recurrent = layer.conv_states[0], layer.recurrent_states[0]
            return _linear_layer(conv.new_zeros(items, *conv.shape[1:]), recurrent.new_zeros(items, *recurrent.shape[1:]))

        pool.backbone = Cache(layers=[layer_like(layer, pool.backbone_part) for layer in example.backbone.layers])
        pool.tower = Cache(layers=[layer_like(layer, pool.tower_part) for layer in example.tower.layers])
        return pool

    def place(self, item: int, source: DecodeCache) -> None:
        """Copy the one-item cache `source` (a prefilled request) into item `item`."""
        filled = source.backbone_part.filled
        if filled > self.capacity:
            raise ValueError(f"a request of {filled} rows does not fit a pool of {self.capacity} columns")
        for mine, theirs in zip((*self.backbone.layers, *self.tower.layers), (*source.backbone.layers, *source.tower.layers), strict=True):
            if isinstance(mine, ColumnKeysLayer):
                mine.keys[item, :, :filled].copy_(theirs.keys[0, :, :filled])
                mine.values[item, :, :filled].copy_(theirs.values[0, :, :filled])
            else:
                mine.conv_states[0][item].copy_(theirs.conv_states[0][0])
                mine.recurrent_states[0][item].copy_(theirs.recurrent_states[0][0])
        for mine, theirs in zip(self.parts, source.parts):
            mine.next_column[item] = theirs.next_column[0]

    def move(self, source: int, target: int) -> None:
        """Copy item `source` over item `target` (the engine closes the gap a request left)."""
        for layer in (*self.backbone.layers, *self.tower.layers):
            if isinstance(layer, ColumnKeysLayer):
                layer.keys[target].copy_(layer.keys[source])
                layer.values[target].copy_(layer.values[source])
            else:
                layer.conv_states[0][target].copy_(layer.conv_states[0][source])
                layer.recurrent_states[0][target].copy_(layer.recurrent_states[0][source])
        for part in self.parts:
            part.next_column[target] = part.next_column[source]

    def item_tensors(self, item: int, rows: int) -> list[torch.Tensor]:
        """What item `item` holds when its backbone holds `rows` rows (its tower one fewer): per
        attention layer its keys and values, per Gated DeltaNet layer its conv and recurrent states."""
        held = []
        for layer, filled in [*((layer, rows) for layer in self.backbone.layers), *((layer, rows - 1) for layer in self.tower.layers)]:
            if isinstance(layer, ColumnKeysLayer):
                held += [layer.keys[item, :, :filled], layer.values[item, :, :filled]]
            else:
                held += [layer.conv_states[0][item], layer.recurrent_states[0][item]]
        return [tensor.clone() for tensor in held]

    def head(self, items: int) -> DecodeCache:
        """A view of the first `items` items: what the model reads and writes lands in this cache."""
        view = DecodeCache.__new__(DecodeCache)
        view.capacity, view.compiled = self.capacity, self.compiled
        view.backbone_part, view.tower_part = self.backbone_part.head(items), self.tower_part.head(items)

        def layer_view(layer, part):
            if isinstance(layer, ColumnKeysLayer):
                viewed = ColumnKeysLayer(part)
                viewed.keys, viewed.values = layer.keys[:items], layer.values[:items]
                viewed.dtype, viewed.device, viewed.is_initialized = layer.dtype, layer.device, True
                return viewed
            return _linear_layer(layer.conv_states[0][:items], layer.recurrent_states[0][:items], linear_layer_counters(layer))

        view.backbone = Cache(layers=[layer_view(layer, view.backbone_part) for layer in self.backbone.layers])
        view.tower = Cache(layers=[layer_view(layer, view.tower_part) for layer in self.tower.layers])
        if self.compiled:
            view.mark_static()
        return view

    def clear_items(self, first: int) -> None:
        """Items from `first` on hold no request: their next rows go to column 0 (a compiled step
        still steps them, with the running ones, in a batch-size bucket)."""
        for part in self.parts:
            part.next_column[first:] = 0

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
        if needed > self.capacity:
            self.grow(max(needed, 2 * self.capacity))

    def grow(self, capacity: int) -> None:
        """Give every item `capacity` columns (one copy of the keys and values)."""
        for layer in (*self.backbone.layers, *self.tower.layers):
            if isinstance(layer, ColumnKeysLayer):
                layer.grow(capacity)
        self.capacity = self.backbone_part.capacity = self.tower_part.capacity = capacity

    def mark_counters_static(self) -> None:
        """Before a compiled prefill: the tensors it writes in place that exist before it (the
        parts' next columns, the Gated DeltaNet layers' counters, `linear_layer_counters`) keep
        their addresses; the prefill allocates the rest (`own_states` copies them out after)."""
        for part in self.parts:
            torch._dynamo.mark_static_address(part.next_column)
        for counter in self._counters():
            torch._dynamo.mark_static_address(counter)

    def _counters(self) -> list[torch.Tensor]:
        return [counter for layer in self.backbone.layers if isinstance(layer, LinearAttentionLayer)
                for counter in linear_layer_counters(layer).values()]

    def own_states(self) -> None:
        """After a compiled prefill: every layer's tensors, counters included, copied into memory of
        their own (what a CUDA-graph replay allocated, the next replay reuses; a counter the graph
        replaced would be such an output too). The copies are not marked static: `mark_static`
        does that for a compiled step."""
        for layer in (*self.backbone.layers, *self.tower.layers):
            if isinstance(layer, ColumnKeysLayer) and layer.is_initialized:
                layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
            elif isinstance(layer, LinearAttentionLayer):
                if layer.is_conv_states_initialized[0]:
                    layer.conv_states[0] = layer.conv_states[0].clone()
                    layer.recurrent_states[0] = layer.recurrent_states[0].clone()
                for name, counter in linear_layer_counters(layer).items():
                    setattr(layer, name, counter.clone())

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the cache holds, by a name that says where (`backbone.3.conv_states`,
        `backbone.3.cumulative_length_linear`, `tower_part.next_column`, ...): what a compiled
        step reads and writes, all of it on the states' device."""
        held = {f"{name}.next_column": part.next_column for name, part in (("backbone_part", self.backbone_part),
                                                                           ("tower_part", self.tower_part))}
        for cache_name, cache in (("backbone", self.backbone), ("tower", self.tower)):
            for index, layer in enumerate(cache.layers):
                prefix = f"{cache_name}.{index}"
                if isinstance(layer, ColumnKeysLayer):
                    if layer.is_initialized:
                        held[f"{prefix}.keys"], held[f"{prefix}.values"] = layer.keys, layer.values
                    continue
                for kind in ("conv_states", "recurrent_states"):
                    for state_index, tensor in getattr(layer, kind).items():
                        if isinstance(tensor, torch.Tensor):
                            held[f"{prefix}.{kind}.{state_index}"] = tensor
                for name, counter in linear_layer_counters(layer).items():
                    held[f"{prefix}.{name}"] = counter
        return held

    def mark_static(self) -> None:
        """For a compiled step: every layer reads the whole capacity, and the cache's tensors
        (counters included) keep their addresses (CUDA graphs replay on them)."""
        self.compiled = True
        for tensor in self.tensors().values():
            torch._dynamo.mark_static_address(tensor)


@dataclass
class DecodeState:
    """Where a decode run stands between steps; every field is a tensor of fixed shape.

    hidden [batch, 1, dim], ids [batch, 1], codes [batch, 1, num_codebooks]: the open row (fed
    through the backbone, its next row not drawn yet); key_mask bool [batch, capacity]: the
    columns holding rows of each item (padding excluded), the open row's included; position
    [batch, 1]: the open row's position (padding skipped); active [batch]: still speaking;
    produced [batch]: frames made; budgets [batch]: frames each item may make; separators_left
    [batch]: line boundaries each item may still draw (zeros for a layout without lines);
    alignment: the run's phoneme alignment (`alignment.AlignmentMasks`, tensors), or None."""

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

    def select(self, items: list[int]) -> DecodeState:
        """The state of the items `items`, in that order (the alignment's too)."""
        index = torch.tensor(items, dtype=torch.long, device=self.ids.device)
        fields = {name: getattr(self, name).index_select(0, index) for name in _ITEM_TENSORS}
        alignment = None if self.alignment is None else self.alignment.take(items)
        return DecodeState(**fields, alignment=alignment)

    def joined(self, other: DecodeState) -> DecodeState:
        """This state's items, then `other`'s (key masks padded to the wider of the two)."""
        width = max(self.key_mask.shape[1], other.key_mask.shape[1])
        masks = [torch.nn.functional.pad(mask, (0, width - mask.shape[1])) for mask in (self.key_mask, other.key_mask)]
        fields = {name: torch.cat((getattr(self, name), getattr(other, name))) for name in _ITEM_TENSORS if name != "key_mask"}
        alignment = None
        if self.alignment is not None or other.alignment is not None:
            alignment = self.alignment.joined(other.alignment)
        return DecodeState(**fields, key_mask=torch.cat(masks), alignment=alignment)

    def attention_mask(self, rows: int) -> torch.Tensor:
        """The first `rows` columns of the key mask as a [batch, rows] long padding mask (what
        transformers' mask builders take)."""
        return self.key_mask[:, :rows].long()


_ITEM_TENSORS = ("hidden", "ids", "codes", "key_mask", "position", "active", "produced", "budgets", "separators_left")


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

