"""`serving.json_bounds.json_cost`: the depth, items and keys it counts from a JSON text's bytes equal
those of the parsed value (a plain walk of `json.loads`'s result), across window boundaries, and a
document one past a bound is refused while one at it is not; a hostile body is refused before
anything that grows with it is built."""

import json
import random
import tracemalloc

import pytest

from transformers_drama3.serving import json_bounds
from transformers_drama3.serving.json_bounds import JsonBounds, json_cost
from transformers_drama3.serving.protocol import ApiError, load_json

GENEROUS = JsonBounds(depth=10_000, items=10**9, keys=10**9)
AWKWARD = ['', 'a', '[', ']', '{', '}', ',', ':', '\\', '"', '\\"', '\\\\', 'é', '\U0001f600', '\n', '\u2028', ' x ',
           '"]"', '\\u005b', '[{"a":1}]']


def reference(value, depth: int = 1) -> tuple[int, int, int]:
    """(deepest nesting, items, keys) of a parsed JSON value: containers plus their elements after
    the first (the commas), and object members."""
    if isinstance(value, list):
        children = value
    elif isinstance(value, dict):
        children = list(value.values())
    else:
        return 0, 0, 0
    deepest, items, keys = depth, 1 + max(len(children) - 1, 0), len(value) if isinstance(value, dict) else 0
    for child in children:
        child_depth, child_items, child_keys = reference(child, depth + 1)
        deepest, items, keys = max(deepest, child_depth), items + child_items, keys + child_keys
    return deepest, items, keys


def random_value(generator: random.Random, depth: int = 0):
    kind = generator.randrange(7 if depth < 6 else 4)
    if kind == 0:
        return "".join(generator.choice(AWKWARD) for _ in range(generator.randrange(6)))
    if kind == 1:
        return generator.choice([0, -1.5e3, 12345678901234567890, True, False, None])
    if kind in (2, 3):
        return generator.choice(AWKWARD)
    if kind in (4, 5):
        return [random_value(generator, depth + 1) for _ in range(generator.randrange(5))]
    return {random_value_key(generator): random_value(generator, depth + 1) for _ in range(generator.randrange(5))}


def random_value_key(generator: random.Random) -> str:
    return "".join(generator.choice(AWKWARD) for _ in range(generator.randrange(4)))


@pytest.mark.parametrize("window", [2, 3, 7, 64, json_bounds.WINDOW])
def test_the_count_equals_a_walk_of_the_parsed_value_across_window_boundaries(monkeypatch, window):
    monkeypatch.setattr(json_bounds, "WINDOW", window)
    generator = random.Random(window)
    for _ in range(300):
        value = random_value(generator)
        for text in (json.dumps(value), json.dumps(value, ensure_ascii=False, indent=1, separators=(" , ", " : "))):
            cost = json_cost(text.encode(), GENEROUS)
            assert cost.over is None and (cost.depth, cost.items, cost.keys) == reference(json.loads(text)), text


@pytest.mark.parametrize("bound, at, past", [
    ("depth", "[" * 32 + "]" * 32, "[" * 33 + "]" * 33),
    ("items", "[" + ",".join(["0"] * 10_000) + "]", "[" + ",".join(["0"] * 10_001) + "]"),
    ("keys", "[" + ",".join(["{}"] * 1_000) + "," + ",".join(f'{{"{n}":0}}' for n in range(2_000)) + "]",
     "[" + ",".join(["{}"] * 999) + "," + ",".join(f'{{"{n}":0}}' for n in range(2_001)) + "]"),
], ids=["depth", "items", "keys"])
def test_a_document_at_a_bound_is_parsed_and_one_past_it_refused_naming_the_bound(bound, at, past):
    assert load_json(at.encode()) == json.loads(at)
    with pytest.raises(ApiError) as refused:
        load_json(past.encode())
    assert refused.value.status == 400 and str(getattr(JsonBounds(), bound)) in refused.value.message


@pytest.mark.parametrize("body", [
    b"[" + b"[]," * 10_000_000 + b"[]]",
    ("{" + ",".join(f'"{n:x}":0' for n in range(2_900_000)) + "}").encode(),
    b'["' + b'\\"' * 2_000_000 + b'",' + b"[]," * 5_000_000 + b"[]]",
    b'""' * 5_000_000,
    b'["' + b"\\\\" * 5_000_000 + b'"]',
    b"[" + b"]" * 10_000_000,
], ids=["30-mib-of-lists", "2.9-m-keys", "escaped-quotes", "adjacent-strings", "escapes", "closing-brackets"])
def test_a_hostile_body_is_refused_before_anything_that_grows_with_it_is_built(body):
    tracemalloc.start()
    try:
        with pytest.raises(ApiError) as refused:
            load_json(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refused.value.status == 400
    assert peak < 2 * 2**20, f"{peak / 2**20:.1f} MiB allocated for a {len(body) / 2**20:.0f} MiB body"


def test_a_body_that_is_not_utf_8_json_is_refused_before_it_is_counted():
    with pytest.raises(ApiError, match="not JSON in UTF-8"):
        load_json('{"input": "\u0122"}'.encode("utf-16"))
    assert load_json('{"input": "é"}'.encode("utf-8-sig")) == {"input": "é"}
