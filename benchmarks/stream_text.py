"""Streaming text input on drama3-tiny: how soon speech starts, and how far it lags behind the text.

    python benchmarks/stream_text.py [--words-per-second 5] [--chunk-bytes 60] [--voice B] [--words N]

A producer thread feeds a long text word by word at `--words-per-second` (an LLM emits 20-50 words
a second, a typist 1-2, speech runs at ~2.5) into `model.stream_text`, which reads the pieces as it
needs them. It prints, measured in one run:
  - the time from the first text piece to the first audio;
  - per chunk: when its text was complete (the piece that made it final), when its turn started
    (its look-ahead known), its first audio, the delay between the two, and its audio's length;
  - the lag of the audio behind the text: a player starts at the first audio and plays every chunk
    in order without skipping; a chunk's lag is when it starts playing minus when its last word
    arrived, and the player's gaps are the time it waited for audio (underruns);
  - the cost of extending the cache per turn against prefilling the whole rebuilt prompt of that
    turn (what one would do without the incremental API), and their ratio.
It asserts nothing; other jobs on the machine change the figures, so compare within one run.
"""

from __future__ import annotations

import argparse
import queue
import threading
import time

import torch
from transformers import AutoModel, AutoProcessor

from transformers_drama3.codec.take_audio import AudioChunk
from transformers_drama3.decoding.loop import DecodeRun
from transformers_drama3.generation.live_text import ChunkSpoken, ChunkStarted
from transformers_drama3.prompting import Reference, StreamingScript
from transformers_drama3.tiny.shipped import TINY_MODEL_PATH, reference_voice

TEXT = (
    "Once upon a time there was a small fox who lived at the edge of a quiet forest. Every morning she "
    "walked down to the river to drink, and every evening she climbed the hill to watch the sun go down. "
    "One day a heavy storm rolled in from the sea. The river rose over its banks, and the path to the hill "
    "was lost under the water. The fox waited for three long days. When the sky cleared at last, she found "
    "a new path through the tall grass, and it led her to a meadow full of flowers she had never seen before."
)


def feed(words: list[str], rate: float, pieces: queue.Queue, arrivals: list[float], start: float) -> None:
    """Put word i on the queue at `start` + i / rate seconds; the arrival times are noted (seconds
    from `start`)."""
    for index, word in enumerate(words):
        delay = start + index / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        arrivals.append(time.perf_counter() - start)
        pieces.put(word)
    pieces.put(None)


def from_queue(pieces: queue.Queue, first_read: list[float]):
    """The pieces as `stream_text` reads them; notes when it reads the first (its clock starts there)."""
    while (piece := pieces.get()) is not None:
        if not first_read:
            first_read.append(time.perf_counter())
        yield piece


def timed_extend(model) -> list[float]:
    """Record how long each `model.extend` call takes (seconds)."""
    durations: list[float] = []
    extend = model.extend

    def timed(*args, **kwargs):
        started = time.perf_counter()
        hidden = extend(*args, **kwargs)
        durations.append(time.perf_counter() - started)
        return hidden

    model.extend = timed
    return durations


@torch.no_grad()
def rebuilt_prefill_seconds(model, processor, references, chunks, takes) -> list[float]:
    """Seconds to prefill each turn's whole rebuilt prompt (a fresh cache each time)."""
    seconds = []
    for turn in range(len(takes)):
        script = StreamingScript(chunks[: turn + 2], references, spoken=takes[:turn])
        rows = processor(script, return_labels=False)
        started = time.perf_counter()
        DecodeRun.prefilled(model, rows["input_ids"], rows["audio_codes"], rows["attention_mask"], None,
                            torch.zeros(1, dtype=torch.long))
        seconds.append(time.perf_counter() - started)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--words-per-second", type=float, default=5.0)
    parser.add_argument("--chunk-bytes", type=int, default=60)
    parser.add_argument("--voice", default="B")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--words", type=int, default=None, help="feed only the first N words of the text")
    args = parser.parse_args()

    model = AutoModel.from_pretrained(TINY_MODEL_PATH, dtype="float32").eval()
    processor = AutoProcessor.from_pretrained(TINY_MODEL_PATH)
    audio, words_said = reference_voice(args.voice)
    references = [Reference(words_said, audio)]
    extends = timed_extend(model)
    text = " ".join(TEXT.split()[: args.words])
    words = [word + " " for word in text.split()]
    pieces, arrivals = queue.Queue(), []
    start = time.perf_counter()
    producer = threading.Thread(target=feed, args=(words, args.words_per_second, pieces, arrivals, start), daemon=True)
    first_read: list[float] = []
    rate = processor.sampling_rate

    started, spoken, audio_at = {}, [], []  # audio_at: (seconds since the first piece, samples)
    producer.start()
    for item in model.stream_text(from_queue(pieces, first_read), processor=processor, references=references,
                                  codec=processor.codec, seed=args.seed, max_bytes=args.chunk_bytes):
        if isinstance(item, ChunkStarted):
            started[item.index] = item
        elif isinstance(item, ChunkSpoken):
            spoken.append(item)
        elif isinstance(item, AudioChunk) and item.audio.numel():
            audio_at.append((item.elapsed, item.audio.numel(), len(spoken)))
    producer.join()
    # stream_text's times count from its reading the first piece (after it prefilled the references):
    # move them to the producer's clock
    offset = first_read[0] - start
    audio_at = [(at + offset, samples, chunk) for at, samples, chunk in audio_at]
    for event in spoken:
        event.final_at += offset
        event.started_at += offset
        event.first_audio_at = None if event.first_audio_at is None else event.first_audio_at + offset

    # the player: starts at the first audio, plays each audio chunk when it is out and the previous one has ended
    playback, gaps, last_end = {}, 0.0, None
    for at, samples, chunk in audio_at:
        begin = at if last_end is None else max(last_end, at)
        if last_end is not None:
            gaps += max(0.0, at - last_end)
        playback.setdefault(chunk, begin)
        last_end = begin + samples / rate

    words_before = 0
    print(f"drama3-tiny, {len(words)} words fed at {args.words_per_second:g} words/s, chunks of ~{args.chunk_bytes} bytes")
    print(f"time from the first text piece to the first audio: {audio_at[0][0]:.2f} s "
          f"(the text was complete at {arrivals[-1]:.2f} s; the references' prefill ended at {offset:.2f} s)")
    # piece in: when the piece that made the chunk final arrived (the producer's clock); read: when
    # stream_text read it (it reads text only when a turn needs more); delay: first audio - piece in
    print(f"\n{'chunk':>5} {'words':>5} {'piece in':>8} {'read':>6} {'turn':>6} {'audio':>6} {'delay':>6} "
          f"{'secs':>5} {'last word':>9} {'plays':>6} {'lag':>6}")
    for event in spoken:
        count = len(event.text.split()) - 1  # without the speaker tag
        last_word = arrivals[min(words_before + count, len(arrivals)) - 1]
        words_before += count
        piece_in = arrivals[min(event.piece, len(arrivals) - 1)]
        delay = None if event.first_audio_at is None else event.first_audio_at - piece_in
        plays = playback.get(event.index)
        lag = None if plays is None else plays - last_word
        seconds = event.frames / model.config.frame_rate
        print(f"{event.index:>5} {count:>5} {piece_in:8.2f} {event.final_at:6.2f} {event.started_at:6.2f} "
              f"{_f(event.first_audio_at)} {_f(delay)} {seconds:5.2f} {last_word:9.2f} {_f(plays)} {_f(lag)}")
    frames = sum(event.frames for event in spoken)
    print(f"\nspeed: {frames} frames by {audio_at[-1][0]:.1f} s = {frames / audio_at[-1][0]:.1f} frames/s "
          f"({frames / audio_at[-1][0] / model.config.frame_rate:.2f}x real time)")
    total_audio = sum(samples for _, samples, _ in audio_at) / rate
    print(f"\naudio {total_audio:.2f} s; the player waited {gaps:.2f} s for audio after it started "
          f"(underruns); the last chunk started playing {playback[spoken[-1].index] - arrivals[-1]:.2f} s after the last word")

    chunks = list(StreamingScript.from_text(text, max_bytes=args.chunk_bytes).chunks)
    takes = [event.take.T for event in spoken]
    rebuilt = rebuilt_prefill_seconds(model, processor, references, chunks, takes)
    turn_extends = extends[: len(spoken)]
    print(f"\nper turn: extend the cache {1000 * sum(turn_extends) / len(turn_extends):.1f} ms (mean), "
          f"prefill the rebuilt prompt {1000 * sum(rebuilt) / len(rebuilt):.1f} ms (mean; {1000 * rebuilt[-1]:.1f} ms "
          f"at the last turn): rebuilding costs {sum(rebuilt) / sum(turn_extends):.1f}x the extensions")


def _f(value) -> str:
    return "     -" if value is None else f"{value:6.2f}"


if __name__ == "__main__":
    main()
