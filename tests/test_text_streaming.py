"""Streaming text input: text pieces in, audio out, the cache extended turn by turn.

The reference path builds the whole `StreamingScript` rows for the chunks known at each turn (the
takes so far as `spoken`) and generates from scratch; `model.stream_text` must give the same takes,
frame for frame, while prefilling once and reading text only as far as each turn needs."""

import copy
import random
import re

import pytest
import torch

from generation_helpers import GrowingCache, tiny_speech_bundle
from model_helpers import tiny_model
from processor_helpers import random_codes
from transformers_drama3.codec.take_audio import AudioChunk, decode_audio
from transformers_drama3.decoding.sampler import SEED_STRIDE
from transformers_drama3.generation.live_text import ChunkSpoken, ChunkStarted, TextStreamCancelled
from transformers_drama3.prompting import (
    Reference,
    StreamingScript,
    StreamingSystemTurn,
    StreamingTurn,
    TextStreamChunker,
    chunk_lines,
    parse_text,
)

TEXT = "The fox ran far away. It came back soon, tired and hungry. Then it slept all night long. The end."
MAX_BYTES = 30
FRAMES = 12


def word_pieces(text):
    return re.findall(r"\S+\s*", text)


def uneven_pieces(text, seed=0):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), 9))
    return [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)])]


CHUNKINGS = {"word by word": word_pieces, "uneven pieces": uneven_pieces, "one piece": lambda text: [text]}


@pytest.fixture(scope="module")
def bundle():
    """A tiny model + processor whose eos row shadows one semantic token's, so greedy takes end by
    eos at different lengths (and one by its budget)."""
    model, processor = tiny_speech_bundle(seed=0)
    config = model.config
    with torch.no_grad():
        weight = model.get_output_embeddings().weight
        weight[config.eos_token_id] = 1.3 * weight[config.semantic_start_token_id + 3]
    return model, processor


@pytest.fixture(scope="module")
def reference(bundle):
    model, _ = bundle
    codes = random_codes(6, seed=3, num_codebooks=model.config.num_codebooks) % model.config.codebook_size
    return Reference("Hello there friend.", codes)


def stream(bundle, reference, pieces, **kwargs):
    model, processor = bundle
    kwargs = {"do_sample": False, "max_new_tokens": FRAMES, "max_bytes": MAX_BYTES, "codec": processor.codec, **kwargs}
    return list(model.stream_text(iter(pieces), processor=processor, references=[reference], **kwargs))


def spoken(items):
    return [item for item in items if isinstance(item, ChunkSpoken)]


def rebuilt_prompt_takes(bundle, reference, incremental, **kwargs):
    """The reference path: each turn's whole StreamingScript rows, generated from scratch; the
    context keeps the takes as drawn (the incremental run's, which these must equal)."""
    model, processor = bundle
    chunks = chunk_lines(parse_text(TEXT), MAX_BYTES)
    takes = []
    for turn in range(len(chunks)):
        script = StreamingScript(chunks[: turn + 2], [reference], spoken=[event.take.T for event in incremental[:turn]])
        out = model.generate(
            **processor(script, return_labels=False), max_new_tokens=FRAMES, return_dict_in_generate=True, **kwargs
        )
        takes.append(out.audio_codes[0, : int(out.lengths[0])])
    return takes


@pytest.fixture(scope="module")
def word_by_word(bundle, reference):
    return stream(bundle, reference, word_pieces(TEXT))


def test_extending_a_cache_matches_prefilling_all_the_rows():
    model = tiny_model(seed=0).eval()
    config = model.config
    generator = torch.Generator().manual_seed(1)
    rows = 40
    is_audio = torch.rand(1, rows, generator=generator) < 0.5
    frames = torch.randint(0, config.codebook_size, (1, rows, config.num_codebooks), generator=generator)
    ids = torch.where(is_audio, config.semantic_start_token_id + frames[..., 0], torch.randint(3, 60, (1, rows), generator=generator))
    codes = torch.where(is_audio[..., None], frames, torch.zeros_like(frames))
    with torch.no_grad():
        whole = GrowingCache.empty(config)
        expected = model.prefill(ids, codes, torch.ones_like(ids), whole)
        cache = GrowingCache.empty(config)
        hidden = [model.prefill(ids[:, :11], codes[:, :11], torch.ones(1, 11, dtype=torch.long), cache)]
        for start, end in ((11, 30), (30, 31), (31, rows)):
            hidden.append(model.extend(
                hidden[-1][:, -1:], ids[:, start - 1 : start], codes[:, start - 1 : start], ids[:, start:end],
                codes[:, start:end], torch.ones(1, end, dtype=torch.long), cache,
            ))
    assert torch.allclose(torch.cat(hidden, dim=1), expected, atol=1e-5)
    assert cache.backbone.get_seq_length() == whole.backbone.get_seq_length() == rows
    for ours, theirs in zip(cache.tower.layers, whole.tower.layers):
        assert ours.keys.shape == theirs.keys.shape  # rows - 1 tower keys: the last row is open
        assert torch.allclose(ours.keys, theirs.keys, atol=1e-5) and torch.allclose(ours.values, theirs.values, atol=1e-5)


def test_streaming_rows_are_the_system_turn_then_each_turn_after_its_take(bundle, reference):
    _, processor = bundle
    chunks = chunk_lines(parse_text(TEXT), MAX_BYTES)
    takes = [random_codes(frames, seed=frames, num_codebooks=4) % 32 for frames in (3, 5)]
    script = StreamingScript(chunks, [reference], spoken=takes)
    whole = processor.rows(script)
    parts = [processor.rows(StreamingSystemTurn([reference])), processor.rows(StreamingTurn(script, 0))]
    ids = [part.input_ids for part in parts]
    codes = [part.audio_codes for part in parts]
    for index, take in enumerate(takes):
        turn = processor.rows(StreamingTurn(script, index + 1))
        ids += [take[0] + processor.token_ids.semantic_start, turn.input_ids]
        codes += [take.T, turn.audio_codes]
    assert torch.equal(torch.cat(ids), whole.input_ids)
    assert torch.equal(torch.cat(codes), whole.audio_codes)


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
def test_the_chunks_of_streamed_text_are_those_of_the_whole_text(chunking):
    chunker = TextStreamChunker(MAX_BYTES)
    chunks = [chunk for piece in CHUNKINGS[chunking](TEXT) for chunk in chunker.feed(piece)] + chunker.finish()
    assert [chunk.lines for chunk in chunks] == list(StreamingScript.from_text(TEXT, max_bytes=MAX_BYTES).chunks)


def test_streamed_chunks_never_depend_on_where_the_pieces_are_cut():
    """Random texts (tags, speaker turns, CJK, line breaks) cut at random places give the chunks of
    the whole text, or the same refusal."""
    rng = random.Random(0)
    words = ["hello", "world", "3.14", "Mr.", "猫が", "走る", "[laughs]", "<whisper>quiet now</whisper>", "\"Stop!\"", "a"]
    marks = ["", "", ",", ".", "!", "?", "...", ":", ".)", "\n"]
    for _ in range(150):
        text = "".join(
            (f"<|speaker:{rng.randint(0, 4)}|>" if rng.random() < 0.05 else "") + rng.choice(words) + rng.choice(marks)
            + rng.choice([" ", " ", "  ", ""])
            for _ in range(rng.randint(1, 80))
        )
        max_bytes, max_speakers = rng.choice([20, 40, 300]), rng.choice([1, 3])
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 30))))
        pieces = [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)])]
        try:
            expected = chunk_lines(parse_text(text), max_bytes, max_speakers)
        except ValueError:
            expected = ValueError
        chunker = TextStreamChunker(max_bytes, max_speakers)
        try:
            got = [chunk.lines for piece in pieces for chunk in chunker.feed(piece)] + [c.lines for c in chunker.finish()]
        except ValueError:
            got = ValueError
        assert got == expected, (text, pieces, max_bytes, max_speakers)


def test_a_chunk_is_final_before_the_text_ends():
    chunker = TextStreamChunker(MAX_BYTES)
    made = [(index, chunk.index) for index, piece in enumerate(word_pieces(TEXT)) for chunk in chunker.feed(piece)]
    assert made and made[0][1] == 0 and made[0][0] < len(word_pieces(TEXT)) - 1


def test_a_tag_split_across_pieces_reads_as_the_whole_tag():
    text = "<|speaker:1|>Hi there. [laughs] <whisper>Quietly now.</whisper> Done."
    whole = StreamingScript.from_text(text, max_bytes=40).chunks
    chunker = TextStreamChunker(40)
    pieces = ["<|spea", "ker:1|>Hi there. [lau", "ghs] <whi", "sper>Quietly now.</whis", "per> Done."]
    chunks = [chunk for piece in pieces for chunk in chunker.feed(piece)] + chunker.finish()
    assert [chunk.lines for chunk in chunks] == list(whole)
    assert chunks[0].lines[0].speaker == 1


def test_a_piece_that_is_not_text_is_refused_by_its_index():
    chunker = TextStreamChunker()
    chunker.feed("Hello ")
    with pytest.raises(ValueError, match=r"text\[1\]: a text piece must be a str; got int"):
        chunker.feed(7)


def test_empty_pieces_add_nothing_and_an_empty_text_is_refused_as_the_batch_api_refuses_it():
    chunker = TextStreamChunker()
    assert chunker.feed("") == [] and chunker.feed("  ") == []
    with pytest.raises(ValueError, match="text is empty"):
        chunker.finish()


def test_a_tag_left_open_at_the_end_is_refused_as_the_batch_api_refuses_it():
    with pytest.raises(ValueError) as batch:
        parse_text("Hello [laughs")
    chunker = TextStreamChunker()
    chunker.feed("Hello [lau")
    chunker.feed("ghs")
    with pytest.raises(ValueError) as streamed:
        chunker.finish()
    assert str(streamed.value) == str(batch.value)


def test_a_spelled_special_token_is_refused_once_its_text_arrives():
    chunker = TextStreamChunker()
    chunker.feed("Hello <|im_")
    with pytest.raises(ValueError, match="spelled like a special token"):
        chunker.feed("end|> there")


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
def test_incremental_greedy_equals_the_rebuilt_prompt_greedy_frame_for_frame(bundle, reference, word_by_word, chunking):
    items = word_by_word if chunking == "word by word" else stream(bundle, reference, CHUNKINGS[chunking](TEXT))
    incremental = spoken(items)
    expected = rebuilt_prompt_takes(bundle, reference, spoken(word_by_word), do_sample=False)
    assert len(incremental) == len(expected) == 5
    assert {event.finish_reason for event in incremental} == {"eos", "length"}  # both ways a take ends
    for event, take in zip(incremental, expected):
        assert torch.equal(event.take, take)


def test_sampled_turns_draw_what_generate_draws_with_the_turn_seed(bundle, reference):
    incremental = spoken(stream(bundle, reference, word_pieces(TEXT), do_sample=True, seed=11))
    model, processor = bundle
    chunks = chunk_lines(parse_text(TEXT), MAX_BYTES)
    for turn, event in enumerate(incremental):
        script = StreamingScript(chunks[: turn + 2], [reference], spoken=[e.take.T for e in incremental[:turn]])
        out = model.generate(
            **processor(script, return_labels=False), max_new_tokens=FRAMES, do_sample=True,
            seed=11 + turn * SEED_STRIDE, return_dict_in_generate=True,
        )
        assert torch.equal(event.take, out.audio_codes[0, : int(out.lengths[0])])


def test_the_prompt_is_prefilled_once_and_each_turn_extends_the_cache():
    model, processor = tiny_speech_bundle(seed=0)
    calls = {"prefill": 0, "extend": 0}
    for name in calls:
        method = getattr(model, name)

        def counted(*args, _method=method, _name=name, **kwargs):
            calls[_name] += 1
            return _method(*args, **kwargs)

        setattr(model, name, counted)
    items = list(model.stream_text(word_pieces(TEXT), processor=processor, do_sample=False, max_new_tokens=3, max_bytes=MAX_BYTES))
    assert len(spoken(items)) == 5
    assert calls == {"prefill": 1, "extend": 5}  # the system turn once; then one extension per turn


def test_first_audio_arrives_before_the_last_text_piece_is_sent(bundle, reference):
    model, processor = bundle
    pieces, log = word_pieces(TEXT), []

    def feed():
        for index, piece in enumerate(pieces):
            log.append(("piece", index))
            yield piece

    for item in model.stream_text(feed(), processor=processor, references=[reference], codec=processor.codec,
                                  do_sample=False, max_new_tokens=FRAMES, max_bytes=MAX_BYTES):
        if isinstance(item, AudioChunk) and item.codes.numel():
            log.append(("audio", item.first_frame))
    first_audio = log.index(next(entry for entry in log if entry[0] == "audio"))
    assert first_audio < log.index(("piece", len(pieces) - 1))


def test_each_chunk_reports_the_delay_from_its_completing_piece_to_its_first_audio(word_by_word):
    started = [item for item in word_by_word if isinstance(item, ChunkStarted)]
    for start, event in zip(started, spoken(word_by_word)):
        assert start.index == event.index and start.text == event.text
        assert 0 <= event.final_at <= event.started_at <= event.first_audio_at
        assert event.delay == pytest.approx(event.first_audio_at - event.final_at)
    assert started[-1].look_ahead == "" and started[0].look_ahead == started[1].text


def test_the_audio_chunks_concatenate_to_the_offline_decode_of_every_take_heard(bundle, reference):
    # a float64 copy of the codec: streaming == offline up to 1e-9, free of float32 rounding
    codec = copy.deepcopy(bundle[1].codec).double()
    items = stream(bundle, reference, word_pieces(TEXT), codec=codec)
    chunks = [item for item in items if isinstance(item, AudioChunk)]
    assert chunks[-1].is_last and not any(chunk.is_last for chunk in chunks[:-1])
    sizes = [chunk.codes.shape[0] for chunk in chunks if chunk.codes.numel()]
    assert [chunk.first_frame for chunk in chunks if chunk.codes.numel()] == [sum(sizes[:index]) for index in range(len(sizes))]
    heard = torch.cat([chunk.codes for chunk in chunks if chunk.codes.numel()])
    assert heard.shape[0] == sum(event.frames for event in spoken(items))
    offline = decode_audio(codec, heard[None], torch.tensor([heard.shape[0]]))[0]
    streamed = torch.cat([chunk.audio for chunk in chunks])
    assert streamed.shape == offline.shape
    assert torch.allclose(streamed, offline, atol=1e-9)


def test_stop_cancels_the_stream_between_frames(bundle, reference):
    model, processor = bundle
    frames = []
    with pytest.raises(TextStreamCancelled):
        for item in model.stream_text(word_pieces(TEXT), processor=processor, references=[reference], do_sample=False,
                                      max_new_tokens=FRAMES, max_bytes=MAX_BYTES, stop=lambda: len(frames) >= 3):
            if isinstance(item, AudioChunk):
                frames.append(item)
    assert len(frames) == 3


def test_a_piece_that_is_not_text_stops_the_stream_naming_it(bundle):
    model, processor = bundle
    with pytest.raises(ValueError, match=r"text\[2\]: a text piece must be a str; got bytes"):
        list(model.stream_text(["Hello ", "there ", b"friend"], processor=processor, do_sample=False, max_new_tokens=2))


def test_a_compiled_text_stream_speaks_the_takes_of_the_eager_one(bundle, reference, word_by_word):
    """`stream_text` through the compiled step (dynamo's whole graph, run by its eager backend), its
    cache growing from one length class to the next between turns: the takes of the eager stream."""
    from transformers import CompileConfig

    torch._dynamo.reset()
    compiled = stream(bundle, reference, word_pieces(TEXT), cache_implementation="static",
                      compile_config=CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None))
    eager = spoken(word_by_word)
    assert len(spoken(compiled)) == len(eager) == 5
    for mine, theirs in zip(spoken(compiled), eager):
        assert torch.equal(mine.take, theirs.take) and mine.finish_reason == theirs.finish_reason
