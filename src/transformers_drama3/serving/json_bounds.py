"""What a JSON text would cost to parse, counted from its bytes before it is parsed.

`json.loads` builds every value of a document in one call that holds the GIL: ~30 MiB of
`[[],[],...]` is 10 M lists (~0.9 GB, seconds), an object of 2.9 M keys a dict as large. A server
that parses a body only once `json_cost` has found it within its `JsonBounds` (depth, items, keys)
never builds more than those bounds allow, and the count itself allocates nothing that grows with
the document: it scans the bytes window by window (`WINDOW`), each window one short C call, so a
thread that counts lets the event loop run between windows.

    cost = json_cost(body)                 # JsonCost(depth=2, items=5, keys=3, over=None)
    if cost.over is None:
        value = json.loads(body)

Outside strings a JSON text's structure is its `[ ] { } , :` characters: the depth is the largest
nesting of brackets, the items are the containers and the values after each comma (every value
but the first of a container follows a comma, so a document holds at most 2 x items + 1 values),
the keys are the colons. For valid JSON these are exact; for text that is not JSON the count is
never lower than what `json.loads` builds before it finds the error (a bracket that closes nothing
is refused here).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

WINDOW = 1 << 20
"""Bytes one C call looks at: about a millisecond, so counting never holds the GIL for long."""

_STRUCTURE = re.compile(rb'["\[\]{},:]')
_IN_STRING = re.compile(rb'[\\"]')
_QUOTE, _COLON, _COMMA = ord('"'), ord(":"), ord(",")
_OPENING, _CLOSING = (ord("["), ord("{")), (ord("]"), ord("}"))


@dataclass(frozen=True)
class JsonBounds:
    """How much JSON a server parses: nesting depth, items (containers and the values after each
    comma) and keys (object members), each counted over the whole document. The defaults hold the
    API's bodies many times over (a speech request is ~20 items; a PEFT adapter config that lists
    every adapted module of the published model's 40 layers in `rank_pattern` and `alpha_pattern`
    ~900 keys) and keep a refused body's count to ~0.1 s of one thread."""

    depth: int = 32
    items: int = 10_000
    keys: int = 2_000

    def steps(self) -> int:
        """The strings, brackets, commas, colons and escapes (`\\`) a document within the bounds
        holds at most, give or take a few escapes: a longer run of them is over a bound, or not
        JSON (e.g. `""""""...`), or a string of escapes no request needs."""
        return 3 * self.items + 2 * self.keys + 2


@dataclass(frozen=True)
class JsonCost:
    """What a scan counted: the largest depth, the items and keys; `over` says which bound the
    document passes (the scan stopped there), None when it is within all of them."""

    depth: int
    items: int
    keys: int
    over: str | None = None


def _string_end(data: bytes, start: int, budget: int) -> tuple[int, int]:
    """(the index after the closing quote of the string whose text starts at `start`, or len(data)
    when it never closes; the escapes it holds, counting stopped past `budget`): a search for the
    next quote or backslash, a backslash skipping the byte it escapes."""
    size, escapes = len(data), 0
    while start < size and escapes <= budget:
        end = min(size, start + WINDOW)
        found = _IN_STRING.search(data, start, end)
        if found is None:
            start = end
            continue
        at = found.start()
        if data[at] == _QUOTE:
            return at + 1, escapes
        start, escapes = at + 2, escapes + 1
    return size, escapes


def json_cost(data: bytes, bounds: JsonBounds = JsonBounds()) -> JsonCost:
    """Count `data` (a JSON text's bytes) against `bounds`, stopping at the first bound passed."""
    size, position = len(data), 0
    depth = deepest = items = keys = steps = 0
    limit = bounds.steps()
    while position < size:
        end = min(size, position + WINDOW)
        found = _STRUCTURE.search(data, position, end)
        if found is None:
            position = end
            continue
        at = found.start()
        character, position = data[at], at + 1
        steps += 1
        if character == _QUOTE:
            position, escapes = _string_end(data, position, limit - steps)
            steps += escapes
        elif character in _OPENING:
            depth, items = depth + 1, items + 1
            deepest = max(deepest, depth)
            if depth > bounds.depth:
                return JsonCost(deepest, items, keys, f"nested deeper than {bounds.depth} levels")
        elif character in _CLOSING:
            depth -= 1
            if depth < 0:
                return JsonCost(deepest, items, keys, f"not JSON: byte {at} closes a bracket that was never opened")
        elif character == _COMMA:
            items += 1
        else:  # a colon
            keys += 1
        if items > bounds.items:
            return JsonCost(deepest, items, keys, f"more than {bounds.items} items (arrays, objects and their elements)")
        if keys > bounds.keys:
            return JsonCost(deepest, items, keys, f"more than {bounds.keys} keys")
        if steps > limit:
            return JsonCost(deepest, items, keys, f"more than {limit} strings, brackets and escapes")
    return JsonCost(deepest, items, keys)
