"""The published sampler against hand-computed distributions: temperature before top-p, the
top-p crossing token (kept for the main token, dropped for the codebook heads), top-k caps,
rank 0 always kept, and repetition-aware sampling (RAS)."""

import torch

from transformers_drama3.decoding.sampler import CODEBOOK_TOP_K, Drama3Sampler, EMPTY_WINDOW_SLOT, RAS_WINDOW, SamplingSettings, filtered_probabilities, item_keys, prompt_window

PROBABILITIES = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBABILITIES.log()


def test_main_token_keeps_the_token_that_crosses_top_p():
    # cumulative 0.5, 0.8, ...: the second token crosses 0.7 and stays
    kept = filtered_probabilities(LOGITS, 1.0, None, 0.7, keep_crossing=True)
    assert torch.allclose(kept, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)


def test_codebook_heads_drop_the_token_that_crosses_top_p():
    kept = filtered_probabilities(LOGITS, 1.0, 30, 0.7, keep_crossing=False)
    assert torch.allclose(kept, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_a_token_that_reaches_top_p_exactly_is_kept_by_both():
    logits = torch.tensor([0.5, 0.25, 0.25]).log()
    for keep_crossing in (True, False):
        kept = filtered_probabilities(logits, 1.0, None, 0.75, keep_crossing=keep_crossing)
        assert kept[0] > 0 and kept.count_nonzero() >= 2


def test_temperature_applies_before_top_p():
    # at T = 2 the probabilities are proportional to sqrt(p): 0.707, 0.548, 0.387, 0.224 (sum 1.866)
    tempered = PROBABILITIES.sqrt() / PROBABILITIES.sqrt().sum()
    kept = filtered_probabilities(LOGITS, 2.0, None, 0.7, keep_crossing=False)
    # cumulative 0.379, 0.672, 0.880: the first two stay, the third crosses 0.7 and goes
    expected = torch.tensor([tempered[0], tempered[1], 0, 0])
    assert torch.allclose(kept, expected / expected.sum())


def test_rank_zero_is_always_kept():
    kept = filtered_probabilities(LOGITS, 1.0, None, 0.01, keep_crossing=False)
    assert torch.allclose(kept, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_codebook_top_k_is_capped_at_30_and_the_main_token_is_not():
    settings = SamplingSettings(top_p=1.0)
    assert settings.top_k is None and settings.codebook_top_k == CODEBOOK_TOP_K == 30
    assert SamplingSettings(top_k=10).codebook_top_k == 10
    assert SamplingSettings(top_k=100).codebook_top_k == 30
    uniform = torch.zeros(40)
    main = filtered_probabilities(uniform, 1.0, settings.top_k, 1.0, keep_crossing=True)
    heads = filtered_probabilities(uniform, 1.0, settings.codebook_top_k, 1.0, keep_crossing=False)
    assert main.count_nonzero() == 40 and heads.count_nonzero() == 30
    assert torch.allclose(heads[heads > 0], torch.full((30,), 1 / 30))


def test_filtering_works_on_unsorted_logits():
    logits = LOGITS[[2, 0, 3, 1]]
    kept = filtered_probabilities(logits, 1.0, None, 0.7, keep_crossing=True)
    assert torch.allclose(kept, torch.tensor([0.0, 0.5, 0.0, 0.3]) / 0.8)


def test_a_seeded_item_draws_what_it_draws_alone_whatever_else_is_in_the_batch():
    logits = torch.randn(3, 1, 50, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
    window = torch.full((3, RAS_WINDOW), EMPTY_WINDOW_SLOT)
    candidates = torch.arange(50)
    batch = Drama3Sampler(SamplingSettings(top_p=1.0), candidates, window, item_keys([7, 8, 9], 3, torch.device("cpu")))
    alone = Drama3Sampler(SamplingSettings(top_p=1.0), candidates, window[1:2], item_keys([8], 1, torch.device("cpu")))
    drawn, drawn_alone = [], []
    for _ in range(20):  # 20 steps: the counters move on together
        drawn.append(int(batch.codebook(logits, 1)[1]))
        drawn_alone.append(int(alone.codebook(logits[1:2], 1)[0]))
        batch.advance()
        alone.advance()
    assert drawn == drawn_alone
    assert len(set(drawn)) > 5  # the steps draw different numbers (a flat-ish distribution over 50)


# ---- RAS ---------------------------------------------------------------------------------

SEMANTIC_START, CODEBOOK = 100, 4
EOS = 7
CANDIDATES = torch.tensor([100, 101, 102, 103, EOS])  # band, then eos


def ras_sampler(batch: int, window_tokens: list[int], temperature: float = 0.01, seed: int = 0):
    window = torch.full((batch, RAS_WINDOW), EMPTY_WINDOW_SLOT)
    if window_tokens:
        window[:, -len(window_tokens):] = torch.tensor(window_tokens)
    settings = SamplingSettings(temperature=temperature, top_p=0.9)
    return Drama3Sampler(settings, CANDIDATES, window, item_keys(seed, batch, torch.device("cpu")))


def main_logits(batch: int, probabilities: list[float]) -> torch.Tensor:
    return torch.tensor(probabilities).log().expand(batch, 1, len(probabilities))


def test_ras_redraws_a_semantic_token_that_repeats_the_window():
    # first draw (T = 0.01) is always <|semantic:0|> (id 100); it is in the window, so the second
    # draw decides, at T = 1, top-p 0.95, top-k 30: {100: 0.6, 101: 0.4} (0.6 + 0.4 = 1 > 0.95 and 101 crosses: kept)
    sampler = ras_sampler(4000, [100])
    drawn = sampler.main_token(main_logits(4000, [0.6, 0.4, 1e-9, 1e-9, 1e-9]))[:, 0]
    share = float((drawn == 101).float().mean())
    assert abs(share - 0.4) < 0.03
    assert set(drawn.unique().tolist()) <= {100, 101}
    assert int(sampler.ras_replacements.sum()) == 4000


def test_ras_leaves_a_token_that_is_not_in_the_window():
    sampler = ras_sampler(500, [101, 102])
    drawn = sampler.main_token(main_logits(500, [0.6, 0.4, 1e-9, 1e-9, 1e-9]))[:, 0]
    assert bool((drawn == 100).all())
    assert int(sampler.ras_replacements.sum()) == 0


def test_ras_never_redraws_eos():
    sampler = ras_sampler(200, [EOS])
    drawn = sampler.main_token(main_logits(200, [0.3, 1e-9, 1e-9, 1e-9, 0.7]))[:, 0]
    assert bool((drawn == EOS).all())


def test_ras_window_covers_the_last_16_main_tokens():
    # 100 is the oldest of 16: after one more draw (102) it has left the window, so drawing it
    # again is no repeat
    sampler = ras_sampler(1, [100] + [101] * (RAS_WINDOW - 1))
    sampler.main_token(main_logits(1, [1e-9, 1e-9, 1.0, 1e-9, 1e-9]))
    assert sampler.window[0].tolist() == [101] * (RAS_WINDOW - 1) + [102]
    sampler.main_token(main_logits(1, [1.0, 1e-9, 1e-9, 1e-9, 1e-9]))
    assert int(sampler.ras_replacements.sum()) == 0


def test_the_random_stream_does_not_depend_on_the_window():
    # both draws always run: what the codebook heads draw next is the same whether RAS fired or not
    logits = main_logits(1, [0.6, 0.4, 1e-9, 1e-9, 1e-9])
    head_logits = torch.randn(1, 1, 64)
    fired, quiet = ras_sampler(1, [100], seed=3), ras_sampler(1, [], seed=3)
    fired.main_token(logits)
    quiet.main_token(logits)
    assert torch.equal(fired.codebook(head_logits, 1), quiet.codebook(head_logits, 1))


def test_greedy_takes_the_argmax_without_ras():
    sampler = Drama3Sampler(SamplingSettings(do_sample=False), CANDIDATES, torch.full((1, RAS_WINDOW), 100))
    assert sampler.main_token(main_logits(1, [0.6, 0.4, 1e-9, 1e-9, 1e-9])).item() == 100
    assert sampler.codebook(torch.tensor([[[0.1, 3.0, 0.2]]]), 1).item() == 1


def test_the_prompt_window_holds_the_last_rows_and_marks_padding():
    input_ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    window = prompt_window(input_ids, mask)
    assert window.shape == (2, RAS_WINDOW)
    assert window[0, -5:].tolist() == [-1, -1, 5, 6, 7]
    assert window[1, -5:].tolist() == [1, 2, 3, 4, 5]
    assert bool((window[:, :-5] == EMPTY_WINDOW_SLOT).all())
