"""The counter-based random numbers of the sampler (`decoding.counter_noise`): exact integer
arithmetic against a plain-Python restatement, uniform and independent numbers, draws in
proportion to the probabilities, the same numbers eagerly and compiled, and no host state."""

import math

import pytest
import torch

from transformers_drama3.decoding import counter_noise
from transformers_drama3.decoding.counter_noise import exponentials, mix, seed_keys, uniforms
from transformers_drama3.decoding.sampler import race

WORD = 2**32


def python_mix(x: int) -> int:
    """lowbias32 in Python's unbounded ints: the reference the int64 halves must equal."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) % WORD
    x ^= x >> 15
    x = (x * 0x846CA68B) % WORD
    return x ^ (x >> 16)


def test_the_mix_equals_plain_integer_arithmetic_over_the_whole_word():
    words = torch.cat((torch.randint(0, WORD, (4000,), generator=torch.Generator().manual_seed(0)),
                       torch.tensor([0, 1, 0xFFFF, 0x10000, WORD - 1, WORD // 2])))
    assert mix(words).tolist() == [python_mix(int(word)) for word in words]


def test_the_mix_is_a_bijection_on_a_sample_and_stays_in_the_word():
    words = torch.arange(0, 1 << 20, dtype=torch.long) * 4093  # a spread of distinct words
    mixed = mix(words % WORD)
    assert mixed.unique().numel() == words.numel()
    assert int(mixed.min()) >= 0 and int(mixed.max()) < WORD


def test_seeds_become_distinct_keys_negative_and_64_bit_seeds_too():
    seeds = [0, 1, 2, -1, 2**32, 2**32 + 1, 2**63 - 1, -(2**63), 1_000_003]
    keys = seed_keys(seeds)
    assert keys.unique().numel() == len(seeds)
    assert torch.equal(seed_keys([5, 7]), seed_keys([5, 7]))  # a key is a function of its seed


def test_uniforms_are_uniform_in_the_open_interval():
    keys, steps = seed_keys(range(64)), torch.arange(64)
    numbers = uniforms(keys, steps, 3, 4096).flatten()
    assert float(numbers.min()) > 0 and float(numbers.max()) < 1
    # Kolmogorov-Smirnov against U(0, 1): 262,144 numbers; the 0.1% critical value is 1.95 / sqrt(n)
    ordered = numbers.double().sort().values
    n = ordered.numel()
    grid = torch.arange(1, n + 1, dtype=torch.double) / n
    statistic = max(float((grid - ordered).max()), float((ordered - (grid - 1 / n)).max()))
    assert statistic < 1.95 / math.sqrt(n)


@pytest.mark.parametrize("moved", ["lane", "step", "stream", "key"])
def test_neighbouring_counters_give_uncorrelated_numbers(moved):
    """Numbers one lane, one step, one stream or one seed apart are uncorrelated (|r| well under
    4 / sqrt(n)) and never equal: a hash whose rounds leaked low bits would correlate neighbours."""
    batch, lanes = 256, 1024
    keys, steps = seed_keys(range(batch)), torch.arange(batch) * 7
    first = uniforms(keys, steps, 2, lanes + 1)
    if moved == "lane":
        first, second = first[:, :-1], first[:, 1:]
    elif moved == "step":
        first, second = first[:, :-1], uniforms(keys, steps + 1, 2, lanes)
    elif moved == "stream":
        first, second = first[:, :-1], uniforms(keys, steps, 3, lanes)
    else:
        first, second = first[:, :-1], uniforms(seed_keys(range(1, batch + 1)), steps, 2, lanes)
    a, b = first.flatten().double() - 0.5, second.flatten().double() - 0.5
    correlation = float((a * b).mean() / (a.std() * b.std()))
    assert abs(correlation) < 4 / math.sqrt(a.numel())
    assert float((first == second).double().mean()) < 1e-3


def test_a_race_over_the_numbers_draws_in_proportion_to_the_probabilities():
    probabilities = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    draws = 40_000
    noise = exponentials(seed_keys(range(draws)), torch.zeros(draws, dtype=torch.long), 0, 5)
    counts = torch.bincount(race(probabilities.expand(draws, 5), noise), minlength=5).double()
    expected = probabilities.double() * draws
    assert counts[4] == 0
    chi_square = float(((counts[:4] - expected[:4]) ** 2 / expected[:4]).sum())
    assert chi_square < 16.3  # 3 degrees of freedom, p = 0.001
    # the same draws along one item's steps instead of across items
    one_item = exponentials(seed_keys([11]).expand(draws), torch.arange(draws), 0, 5)
    counts = torch.bincount(race(probabilities.expand(draws, 5), one_item), minlength=5).double()
    assert float(((counts[:4] - expected[:4]) ** 2 / expected[:4]).sum()) < 16.3


def test_lanes_past_an_items_width_never_win():
    keys, steps = seed_keys([1, 2, 3]), torch.zeros(3, dtype=torch.long)
    noise = exponentials(keys, steps, 0, 6, torch.tensor([6, 5, 2]))
    assert torch.isinf(noise[1, 5]) and torch.isinf(noise[2, 2:]).all() and torch.isfinite(noise[0]).all()
    # a full width changes nothing (another batch size: the log may take another vector path)
    torch.testing.assert_close(noise[0], exponentials(keys[:1], steps[:1], 0, 6)[0], rtol=1.3e-6, atol=1e-6)


def test_compiled_numbers_equal_the_eager_ones():
    """A compiled step computes the same integer words (bitwise) and the same Exp(1) numbers within
    float32 rounding: the draws of a compiled run are the eager run's."""
    keys, steps = seed_keys([3, 1_000_003, -5]), torch.tensor([0, 17, 4096])

    def words(keys, steps):
        return mix(mix(keys ^ 12345) ^ steps)

    compiled_words = torch.compile(words, fullgraph=True, dynamic=False)
    assert torch.equal(compiled_words(keys, steps), words(keys, steps))
    compiled = torch.compile(exponentials, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(keys, steps, 4, 300), exponentials(keys, steps, 4, 300), rtol=1.3e-6, atol=1e-6)


def test_unseeded_keys_follow_torchs_global_generator():
    torch.manual_seed(123)
    first = counter_noise.random_keys(4)
    torch.manual_seed(123)
    assert torch.equal(counter_noise.random_keys(4), first)
    assert first.unique().numel() == 4


def test_the_streams_of_one_step_are_pairwise_distinct(monkeypatch):
    """Every draw of a step (the main token, its RAS redraw, codebooks 1..9) takes its numbers from
    its own stream: two draws on one stream would use the same numbers (codebook 1 reusing the RAS
    redraw's, say), which no distribution test of a single draw can see. Recorded from a seeded
    generate() of one frame through the real decode step."""
    from generation_helpers import prompt, tiny_model

    from transformers_drama3.decoding import sampler

    model = tiny_model(seed=0)
    streams = []

    def recording(keys, steps, stream, lanes, widths=None):
        streams.append((int(steps.max()), stream))
        return exponentials(keys, steps, stream, lanes, widths)

    monkeypatch.setattr(sampler, "exponentials", recording)
    ids, codes = prompt(0)
    with torch.no_grad():
        model.generate(ids[None], codes[None], do_sample=True, seed=0, max_new_tokens=2, repetition_aware=True)
    first_step = [stream for step, stream in streams if step == 0]
    # the main token, its RAS redraw, and one stream per acoustic codebook
    assert len(first_step) == 2 + model.config.num_codebooks - 1
    assert len(set(first_step)) == len(first_step), f"streams drawn on twice in one step: {first_step}"
    assert {counter_noise.MAIN_STREAM, counter_noise.RAS_STREAM} <= set(first_step)
