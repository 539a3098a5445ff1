"""What a MessagePack document would cost to unpack, counted from its bytes before it is unpacked.

`msgpack.unpackb` builds every value of a document in one C call that holds the GIL, and a
container's header says how many values follow: 30 MiB of `[[],[],...]` is 30 M lists, and a map
header may promise four billion entries. `msgpack_cost` walks the document's headers with the same
bounds a JSON body has (`json_bounds.JsonBounds`: nesting depth, items, keys) and stops at the
first one passed, so a server that unpacks a body only once it is within them never builds more
than they allow. The walk reads headers, not payloads (a string or a binary is skipped by its
length), so it takes one short step per value: at most ~items + keys steps for any document.

    cost = msgpack_cost(body)              # JsonCost(depth=2, items=5, keys=3, over=None)
    if cost.over is None:
        value = msgpack.unpackb(body, raw=False)

Counted as in JSON: a container is an item, and so is every element of an array and every value
of a map; every map entry is a key. Extension types (timestamps, application types) are refused:
the APIs that take MessagePack here carry strings, numbers, binaries, arrays and maps only. A
length that runs past the end of the bytes, bytes after the document, and the byte 0xc1 (never
used) make it "not MessagePack".
"""

from __future__ import annotations

import struct

from .json_bounds import JsonBounds, JsonCost

# header byte -> (bytes of its length field, kind): kinds "str"/"bin" skip a payload of that
# length, "array"/"map" open a container of that many elements / entries, "ext" is refused.
_SIZED = {
    0xC4: (1, "bin"), 0xC5: (2, "bin"), 0xC6: (4, "bin"),
    0xC7: (1, "ext"), 0xC8: (2, "ext"), 0xC9: (4, "ext"),
    0xD9: (1, "str"), 0xDA: (2, "str"), 0xDB: (4, "str"),
    0xDC: (2, "array"), 0xDD: (4, "array"), 0xDE: (2, "map"), 0xDF: (4, "map"),
}
# header byte -> bytes of the fixed-size value after it (nil, booleans and fixints have none)
_FIXED = {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
_FIXEXT = range(0xD4, 0xD9)
_LENGTH = {1: struct.Struct(">B"), 2: struct.Struct(">H"), 4: struct.Struct(">I")}


class _NotMessagePack(Exception):
    pass


def _header(data: bytes, at: int) -> tuple[str, int, int]:
    """The value starting at `at`: (kind, its count or payload length, where its payload starts).
    Kinds: "scalar" (count 0, payload = the bytes to skip), "str", "bin", "array", "map", "ext"."""
    size = len(data)
    byte = data[at]
    if byte <= 0x7F or byte >= 0xE0 or byte in (0xC0, 0xC2, 0xC3):
        return "scalar", 0, at + 1
    if byte <= 0x8F:
        return "map", byte & 0x0F, at + 1
    if byte <= 0x9F:
        return "array", byte & 0x0F, at + 1
    if byte <= 0xBF:
        return "str", byte & 0x1F, at + 1
    if byte in _FIXED:
        return "scalar", _FIXED[byte], at + 1
    if byte in _FIXEXT:
        return "ext", 0, at + 1
    if byte in _SIZED:
        width, kind = _SIZED[byte]
        if at + 1 + width > size:
            raise _NotMessagePack(f"not MessagePack: the header at byte {at} runs past the end")
        return kind, _LENGTH[width].unpack_from(data, at + 1)[0], at + 1 + width
    raise _NotMessagePack(f"not MessagePack: byte {at} is 0xc1, which MessagePack never uses")


def msgpack_cost(data: bytes, bounds: JsonBounds = JsonBounds()) -> JsonCost:
    """Count `data` (one MessagePack document) against `bounds`, stopping at the first bound passed
    or at the first byte that is not MessagePack (`over` says which)."""
    data = bytes(data)
    size, at = len(data), 0
    depth = deepest = items = keys = 0
    # open containers: [values still to read, whether it is a map, values read so far]
    open_containers: list[list] = []

    def cost(over=None) -> JsonCost:
        return JsonCost(deepest, items, keys, over)

    if not size:
        return cost("not MessagePack: the body is empty")
    try:
        while True:
            if at >= size:
                raise _NotMessagePack("not MessagePack: the document ends early")
            if open_containers:  # one value of the innermost container: a key, or an item
                container = open_containers[-1]
                if container[1] and container[2] % 2 == 0:
                    keys += 1
                else:
                    items += 1
                container[2] += 1
                container[0] -= 1
            kind, count, payload = _header(data, at)
            if kind == "ext":
                return cost(f"byte {at} starts an extension type value; only strings, numbers, binaries, "
                            "arrays and maps are accepted")
            if kind in ("array", "map"):
                items += 1
                depth += 1
                deepest = max(deepest, depth)
                if depth > bounds.depth:
                    return cost(f"nested deeper than {bounds.depth} levels")
                # a header promises its values: refuse it before reading them
                if kind == "array" and items + count > bounds.items:
                    return cost(f"more than {bounds.items} items (arrays, maps and their elements)")
                if kind == "map" and (keys + count > bounds.keys or items + count > bounds.items):
                    return cost(f"more than {bounds.keys} keys" if keys + count > bounds.keys else
                                f"more than {bounds.items} items (arrays, maps and their elements)")
                open_containers.append([2 * count if kind == "map" else count, kind == "map", 0])
                at = payload
            else:
                at = payload + count
                if at > size:
                    raise _NotMessagePack(f"not MessagePack: the value at byte {payload - 1} runs past the end")
            if items > bounds.items:
                return cost(f"more than {bounds.items} items (arrays, maps and their elements)")
            while open_containers and open_containers[-1][0] == 0:  # containers this value completed
                open_containers.pop()
                depth -= 1
            if not open_containers:
                break
    except _NotMessagePack as error:
        return cost(str(error))
    if at != size:
        return cost(f"not MessagePack: {size - at} bytes follow the document")
    return cost()
