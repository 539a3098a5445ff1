"""Load on the speech server: N concurrent streaming clients on loopback, with and without the
voice-prefix cache.

    PYTHONPATH=src python benchmarks/serve_load.py [--clients 64] [--frames 64] [--time-limit 120]
                                                   [--max-batch 16] [--model PATH] [--device cuda] [--compile]
    PYTHONPATH=src python benchmarks/serve_load.py --random-model published --device cuda --realtime --clients 32

First times the prefill of one voice prompt whole and from its cached voice prefix. Then starts
`drama3 serve`'s app in this process (drama3-tiny by default) on 127.0.0.1, once with the
voice-prefix cache and once without. Each run first times one stream alone, then starts
`--clients` streaming requests at once (each `--frames` frames at most, seeds and voices
varied); no client starts after `--time-limit` seconds and every client gives up at it. Prints
per run: errors (must be 0), time to first audio p50/p95, aggregate frames/s and its ratio to the
single stream's frames/s, the engine's batch occupancy (mean requests per decode step), and how many
streams ran faster than real time: a player that starts on a stream's first chunk never waits
(every chunk arrives before the audio received before it has played out, at the codec's rate:
real time is 21.5 frames/s for the S2 codec).

`--realtime` runs the concurrent real-time streams instead: 1, 2, 4, ... up to `--clients`
streams at once (each `--frames` frames), one level after another on one server; per level it
prints errors, time to first audio p50/p95, the slowest stream's speed against real time and
whether every stream was faster than real time, then "concurrent real-time streams: N", the most
streams at once of the levels run that were all faster than real time (0 when even one alone was not).

`--device` (default cpu) and `--compile` (the engine steps the compiled decode step in batch-size
buckets: the first bucket's graph, then one with symbolic sizes for the others; CUDA graphs on a
GPU) are `drama3 serve`'s. `--random-model published` serves
the published model at `--layers` backbone layers (default 40) with random weights, built in
memory on `--device` (the meta-device build of `benchmarks/gpu.py`; nothing to download or load:
the GPU machine holds no checkpoint), with a tokenizer carrying every Drama 3 special token and a
random S2 codec at the published shape, and one voice "A" from a synthetic clip; `--random-model
tiny` is the same at `benchmarks/gpu.py --dry-run`'s width (a CPU check).

`--attack` runs the attack mix instead (issues 47, 58): `--streams` streams run (`--frames` frames
each); a second later `--long-prompts` requests of 4,096 characters of input and 4,096 of
instructions (one frame each) arrive with `--clients` fresh short streams, all at once or, with
`--sequential`, one after the answer to the last, and the same round runs again without the long
prompts. Prints per round: the worst gap between two chunks of a running stream, the fresh
streams' time to first audio p50/p95, the long prompts' time, and the engine's decode steps per
second and share of its time spent prefilling from the long prompts' arrival until the running
streams or the long prompts end (whichever is first; the round without long prompts over the same
seconds), with the ratios of the round with long prompts to the round without. `--prefill-chunk`
and `--prefill-share` are `drama3 serve`'s. Then the body attack (issue 58), unless
`--attack-bodies 0`: one stream of `--frames` frames runs while /health is asked every 0.1 s, and a
second in `--attack-bodies` bodies of ~30 MiB of `[[],[],...]` are posted at once (then, in another
round, one body of 2.9 M keys; and a round of none). Prints per round: the bodies' statuses and
slowest answer, the worst /health latency, the stream's worst gap between chunks and the server's
(this process's) peak resident memory growth.

`--adapters N` runs the fine-tuned-voice mix instead (issue 48): N random "light" LoRA adapters of
the model (rank `--adapter-rank`) are served as voices, each with voice A's reference clip, and
`--clients` streams run with 0, 1, 4, 16 (up to N) distinct adapters in the mix (client i speaks
with adapter i mod k; 0: every client on the base model, the adapter slots installed), against
the same streams on the base model served without adapter slots (voice A: the same prompts), run
before and after the mixes. Prints per mix: errors, time to first audio p50/p95, aggregate
frames/s, and the ratios of time to first audio and frames/s to the base alone (the mean of its
two runs).

Prints only; asserts nothing.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import httpx
import numpy as np
import torch
import uvicorn

from transformers_drama3.serving.app import ServerSettings, SpeechService, create_app
from transformers_drama3.serving.output_audio import OPENAI_PCM_RATE as PCM_RATE
from transformers_drama3.tiny import shipped

TEXTS = [
    "Hello there, how are you today?",
    "If the barrel is sturdy, Delia will polish the rabbit.",
    "The weather is lovely this morning.",
    "Please read the next line slowly and clearly.",
]
VOICES = sorted(shipped.voices()) or ["A"]  # drama3-tiny's bundled voices; a random model's one voice "A"
RANDOM_MODELS = ("published", "tiny")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(service: SpeechService):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(lambda: service, ServerSettings()), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}"


def stream_samples_per_frame(service) -> float:
    """The samples of one frame in the streams' pcm (OpenAI's 24 kHz, not the model's rate)."""
    return service.processor.samples_per_frame * PCM_RATE / service.processor.sampling_rate


def one_stream(base: str, index: int, frames: int, deadline: float, samples_per_frame: float, voices=VOICES,
               text: str | None = None) -> dict:
    """Stream one request (`text`, else one of `TEXTS`; pcm at `PCM_RATE`, `samples_per_frame` at
    that rate); returns its time to first audio, frames received and error (if any)."""
    body = {
        "model": "drama3", "input": text or TEXTS[index % len(TEXTS)], "voice": voices[index % len(voices)],
        "response_format": "pcm", "stream_format": "audio", "seed": index, "max_new_tokens": frames,
    }
    started = time.perf_counter()
    first, received, last, worst_gap, chunks = None, 0, None, 0.0, []
    try:
        timeout = max(1.0, deadline - time.perf_counter())
        with httpx.stream("POST", base + "/v1/audio/speech", json=body, timeout=timeout) as response:
            if response.status_code != 200:
                return {"error": f"status {response.status_code}"}
            for chunk in response.iter_bytes():
                now = time.perf_counter()
                if chunk and first is None:
                    first = now - started
                if chunk:
                    worst_gap, last = (max(worst_gap, now - last) if last is not None else 0.0), now
                    chunks.append((now - started, len(chunk)))
                received += len(chunk)
                if time.perf_counter() > deadline:
                    return {"error": "time limit"}
    except httpx.HTTPError as error:
        return {"error": type(error).__name__}
    return {"ttfa": first, "frames": received / 2 / samples_per_frame, "seconds": time.perf_counter() - started,
            "worst_gap": worst_gap, "chunks": chunks, "ended": time.perf_counter()}


def playback_stall(result: dict, sampling_rate: float) -> float:
    """The longest a player of the stream would have waited for audio, in seconds: playing from the
    first chunk's arrival, each chunk (16-bit PCM at `sampling_rate`) must arrive before the audio
    received before it has played out. <= 0: the stream ran faster than real time, never stalling;
    inf for a stream that failed."""
    if "error" in result or not result.get("chunks"):
        return float("inf")
    first_arrival, buffered, worst = result["chunks"][0][0], 0.0, float("-inf")
    for arrival, size in result["chunks"]:
        worst = max(worst, (arrival - first_arrival) - buffered)
        buffered += size / 2 / sampling_rate
    return worst


def realtime_streams(results: list[dict], sampling_rate: float) -> int:
    """How many of `results` (streams that ran at once) ran faster than real time (no stall)."""
    return sum(playback_stall(result, sampling_rate) <= 0 for result in results)


def voices_of(service: SpeechService) -> list[str]:
    return sorted(service.voices.ids())


# ----------------------------------------------------------------------------- the served model


@lru_cache(maxsize=1)
def random_model_and_processor(width: str, layers: int, device: str):
    """(model, processor) of random weights built in memory: the published config (`width`
    "published") or the dry run's tiny width ("tiny") of `benchmarks/gpu.py`, at `layers` backbone
    layers, with token ids from a tokenizer carrying every Drama 3 special token (a small text
    vocabulary: its embedding and head are smaller than the published ones, the semantic band and
    eos are the same size) and a random S2 codec (`gpu.codec_of`)."""
    import gpu  # benchmarks/gpu.py, this script's neighbour: the same config, meta-device build and codec

    from transformers_drama3 import Drama3Config, Drama3Processor
    from transformers_drama3.prompting.tokenizer_build import build_drama3_tokenizer

    tiny = width == "tiny"
    shape = gpu.published_config(layers, dry_run=tiny)
    codebook_size = shape.codebook_size
    tokenizer = build_drama3_tokenizer(codebook_size=codebook_size)
    codec = gpu.codec_of(tiny, device)
    start = tokenizer.convert_tokens_to_ids("<|semantic:0|>")
    config = Drama3Config(
        text_config={**(gpu.DRY_RUN_TEXT if tiny else {}), "num_hidden_layers": layers, "vocab_size": len(tokenizer)},
        audio_decoder_config=gpu.DRY_RUN_TOWER if tiny else None,
        semantic_start_token_id=start, semantic_end_token_id=start + codebook_size - 1,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        sampling_rate=codec.sampling_rate, frame_size=codec.hop_length,
    )
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = gpu.materialised(config, device, dtype)
    processor = Drama3Processor(tokenizer, codec=codec, codebook_size=codebook_size, min_reference_fraction=0.0)
    return model, processor


def synthetic_clip(folder: str, sampling_rate: int, seconds: float = 3.0) -> str:
    """A voiced-sounding clip (harmonics under a syllable-rate envelope) and its transcript in
    `folder`, as a `--voice` spec "A=clip.wav:clip.txt"."""
    import soundfile

    time_axis = np.arange(int(seconds * sampling_rate)) / sampling_rate
    tone = sum(np.sin(2 * np.pi * 140 * harmonic * time_axis) / harmonic for harmonic in range(1, 8))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * time_axis)
    soundfile.write(f"{folder}/A.wav", (0.2 * tone * envelope).astype(np.float32), sampling_rate)
    with open(f"{folder}/A.txt", "w", encoding="utf-8") as writer:
        writer.write(TEXTS[0])
    return f"A={folder}/A.wav:{folder}/A.txt"


def load_service(args, voices_dir: str, **options) -> SpeechService:
    """`SpeechService.load` of `--model` (or of `--random-model`, built in memory and handed to the
    same load in place of the checkpoint it would read) on `--device`, compiled with `--compile`."""
    options.update(device=args.device, compile=args.compile)
    if args.random_model is None:
        return SpeechService.load(args.model, voices_dir, **options)
    from transformers_drama3.serving import service as service_module

    model, processor = random_model_and_processor(args.random_model, args.layers, args.device)
    loader = service_module.load_model_and_processor  # AttributeError here if the service stops loading this way
    service_module.load_model_and_processor = lambda source, device, dtype, **kwargs: (model, processor)
    try:
        with tempfile.TemporaryDirectory() as clip_folder:
            voice = synthetic_clip(clip_folder, processor.sampling_rate)
            return SpeechService.load(f"random-{args.random_model}", voices_dir, voice_specs=[voice], **options)
    finally:
        service_module.load_model_and_processor = loader


LONG_CHARS = 4096


class EngineCounters:
    """The engine's decode steps and prefill seconds, sampled every `period` seconds in a thread
    while the block runs: `rates(start, end)` gives steps per second and the fraction of time spent
    prefilling between two moments (`time.perf_counter()`)."""

    def __init__(self, engine, period: float = 0.05):
        self.engine, self.period, self.samples = engine, period, []
        self._stop = threading.Event()

    def __enter__(self):
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _sample(self):
        while True:
            stats = self.engine.stats
            self.samples.append((time.perf_counter(), stats.steps, stats.prefill_seconds))
            if self._stop.wait(self.period):
                return

    def rates(self, start: float, end: float) -> tuple[float, float]:
        inside = [sample for sample in self.samples if start <= sample[0] <= end]
        if len(inside) < 2:
            return float("nan"), float("nan")
        (t0, steps0, prefill0), (t1, steps1, prefill1) = inside[0], inside[-1]
        return (steps1 - steps0) / (t1 - t0), (prefill1 - prefill0) / (t1 - t0)


def long_prompts(base: str, count: int, deadline: float, sequential: bool, pool, voices=VOICES) -> list[dict]:
    """`count` long prompts at once, or one after the answer to the last (`sequential`)."""
    if sequential:
        return [long_prompt(base, index, deadline, voices) for index in range(count)]
    return [future.result() for future in [pool.submit(long_prompt, base, i, deadline, voices) for i in range(count)]]


def long_prompt(base: str, index: int, deadline: float, voices=VOICES) -> dict:
    """One attack request: 4,096 characters of input and 4,096 of instructions, one frame."""
    text = " ".join(TEXTS[(index + n) % len(TEXTS)] for n in range(200))[:LONG_CHARS]
    body = {"input": text, "instructions": ("Slowly, warmly, " * 300)[:LONG_CHARS], "voice": voices[0],
            "response_format": "pcm", "max_new_tokens": 1, "seed": index}
    started = time.perf_counter()
    try:
        response = httpx.post(base + "/v1/audio/speech", json=body, timeout=max(1.0, deadline - started))
    except httpx.HTTPError as error:
        return {"error": type(error).__name__}
    if response.status_code != 200:
        return {"error": f"status {response.status_code}"}
    return {"seconds": time.perf_counter() - started, "ended": time.perf_counter()}


def attack_round(base: str, args, samples_per_frame: int, count: int, engine, window: float | None = None,
                 voices=VOICES) -> dict:
    """Running streams, then (a second later) `count` long prompts and fresh short streams. The
    engine's rates are taken from the long prompts' arrival for `window` seconds (None: until the
    running streams or the long prompts end, whichever is first)."""
    deadline = time.perf_counter() + args.time_limit
    with ThreadPoolExecutor(args.streams + count + args.clients + 1) as pool, EngineCounters(engine) as counters:
        running = [pool.submit(one_stream, base, 200 + i, args.frames, deadline, samples_per_frame, voices)
                   for i in range(args.streams)]
        time.sleep(1.0)
        arrival = time.perf_counter()
        longs = pool.submit(long_prompts, base, count, deadline, args.sequential, pool, voices)
        fresh = [pool.submit(one_stream, base, 300 + i, 8, deadline, samples_per_frame, voices) for i in range(args.clients)]
        running, fresh = ([f.result() for f in group] for group in (running, fresh))
        longs = longs.result()
    errors = [r["error"] for r in running + longs + fresh if "error" in r]
    ttfa = np.array([r["ttfa"] for r in fresh if r.get("ttfa") is not None])
    if window is None:
        ends = [r["ended"] for r in running if "ended" in r] or [arrival]
        window = min(max(ends), max((r["ended"] for r in longs if "ended" in r), default=max(ends))) - arrival
    steps, prefilling = counters.rates(arrival, arrival + window)
    return {
        "errors": errors,
        "worst_gap": max((r.get("worst_gap", 0.0) for r in running), default=float("nan")),
        "ttfa": (np.percentile(ttfa, 50), np.percentile(ttfa, 95)) if ttfa.size else (float("nan"),) * 2,
        "long": max((r["seconds"] for r in longs if "seconds" in r), default=float("nan")),
        "window": window, "steps_per_second": steps, "prefilling": prefilling,
    }


def attack(args) -> None:
    options = {} if args.prefill_share is None else {"prefill_share": args.prefill_share}
    with tempfile.TemporaryDirectory() as voices:
        service = load_service(args, voices, max_batch=args.max_batch, max_queue=64, prefill_chunk=args.prefill_chunk,
                               **options)
        server, thread, base = start_server(service)
        try:
            spf, names, engine = stream_samples_per_frame(service), voices_of(service), service.engine
            one_stream(base, 0, 4, time.perf_counter() + args.time_limit, spf, names)  # warm-up
            attacked = attack_round(base, args, spf, args.long_prompts, engine, voices=names)
            quiet = attack_round(base, args, spf, 0, engine, window=attacked["window"], voices=names)
            if args.attack_bodies:
                body_attack(base, args, spf, names)
        finally:
            server.should_exit = True
            thread.join(timeout=10)
            service.engine.stop()
    arrival = "one after another" if args.sequential else "at once"
    print(f"attack mix: {args.streams} running streams of {args.frames} frames, then {args.long_prompts} prompts of "
          f"{LONG_CHARS} + {LONG_CHARS} characters ({arrival}) and {args.clients} fresh streams; max batch "
          f"{args.max_batch}, prefill chunk {engine.prefill_chunk} rows, prefill share {engine.prefill_share}")
    for label, result in (("without long prompts", quiet), (f"with {args.long_prompts} long prompts", attacked)):
        print(f"  {label}: errors {len(result['errors'])} {sorted(set(result['errors'])) or ''}; worst gap between "
              f"chunks of a running stream {result['worst_gap']:.3f} s; fresh streams' time to first audio p50 "
              f"{result['ttfa'][0]:.3f} s, p95 {result['ttfa'][1]:.3f} s; longest long prompt {result['long']:.2f} s; "
              f"engine {result['steps_per_second']:.1f} steps/s, {100 * result['prefilling']:.0f}% of its time "
              f"prefilling (the {attacked['window']:.1f} s after the long prompts' arrival)")
    print(f"  ratios (with / without): worst gap {attacked['worst_gap'] / quiet['worst_gap']:.2f}x, time to first "
          f"audio p50 {attacked['ttfa'][0] / quiet['ttfa'][0]:.2f}x, p95 {attacked['ttfa'][1] / quiet['ttfa'][1]:.2f}x, "
          f"engine steps/s {attacked['steps_per_second'] / quiet['steps_per_second']:.2f}x")


HOSTILE_BODIES = ("nested", "keys")
"""The bodies of the body attack: ~30 MiB of `[[],[],...]` (10 M empty lists), and an object of
2.9 M distinct keys (~29 MiB)."""


def hostile_body(kind: str) -> bytes:
    """One body of the body attack (`HOSTILE_BODIES`), under the server's default 32 MiB."""
    if kind == "nested":
        return b"[" + b"[]," * 10_000_000 + b"[]]"
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"

    def key(number: int) -> str:
        text = ""
        while True:
            number, digit = divmod(number, 36)
            text = digits[digit] + text
            if not number:
                return text

    return ("{" + ",".join(f'"{key(number)}":0' for number in range(2_900_000)) + "}").encode()


def peak_rss_reset() -> None:
    """Start this process's peak resident memory (VmHWM) afresh (Linux; elsewhere nothing happens)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    """This process's peak resident memory since the last `peak_rss_reset`, in MB (nan off Linux)."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def health_latencies(base: str, stop: threading.Event, every: float = 0.1) -> list[float]:
    """Seconds each GET /health took, one every `every` s, until `stop` is set."""
    latencies = []
    with httpx.Client(base_url=base, timeout=120) as client:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                client.get("/health")
            except httpx.HTTPError:
                latencies.append(float("inf"))
                continue
            latencies.append(time.perf_counter() - started)
            stop.wait(every)
    return latencies


def post_body(base: str, body: bytes, deadline: float) -> dict:
    """POST one hostile body to /v1/audio/speech; its status and how long the answer took."""
    started = time.perf_counter()
    try:
        response = httpx.post(base + "/v1/audio/speech", content=body, headers={"Content-Type": "application/json"},
                              timeout=max(1.0, deadline - started))
    except httpx.HTTPError as error:
        return {"error": type(error).__name__}
    return {"status": response.status_code, "seconds": time.perf_counter() - started}


def body_round(base: str, args, samples_per_frame: int, kind: str | None, count: int, voices=VOICES) -> dict:
    """One stream of `--frames` frames runs, /health is asked every 0.1 s; a second in, `count`
    hostile bodies of `kind` (None: none) are posted at once. Returns the worst /health latency,
    the stream's worst gap between chunks, the bodies' statuses and slowest answer, and this
    process's (the server's) peak resident memory during the round."""
    deadline = time.perf_counter() + args.time_limit
    bodies = [hostile_body(kind)] * count if kind is not None else []
    stop = threading.Event()
    peak_rss_reset()
    before = peak_rss_mb()
    with ThreadPoolExecutor(2 + count) as pool:
        health = pool.submit(health_latencies, base, stop)
        stream = pool.submit(one_stream, base, 400, args.frames, deadline, samples_per_frame, voices, " ".join(TEXTS * 6))
        time.sleep(1.0)
        answers = [future.result() for future in [pool.submit(post_body, base, body, deadline) for body in bodies]]
        stream = stream.result()
        stop.set()
        health = health.result()
    return {
        "health": max(health, default=float("nan")), "gap": stream.get("worst_gap", float("nan")),
        "stream_error": stream.get("error"), "statuses": sorted(a.get("status", a.get("error")) for a in answers),
        "answer": max((a["seconds"] for a in answers if "seconds" in a), default=float("nan")),
        "rss": peak_rss_mb() - before,
    }


def body_attack(base: str, args, samples_per_frame: int, voices=VOICES) -> None:
    """The body attack (issue 58): a quiet round, `--attack-bodies` bodies of nested lists at once,
    one body of 2.9 M keys; printed as a table."""
    rounds = [("none", None, 0), (f"{args.attack_bodies} x ~30 MiB [[],[],...]", "nested", args.attack_bodies),
              ("1 x 2.9 M keys", "keys", 1)]
    print(f"body attack: one stream of {args.frames} frames, /health every 0.1 s, hostile bodies a second in")
    print("| bodies | answers | slowest answer | worst /health | stream's worst gap | peak RSS growth |")
    print("|---|---|---|---|---|---|")
    for label, kind, count in rounds:
        result = body_round(base, args, samples_per_frame, kind, count, voices)
        error = f" (stream: {result['stream_error']})" if result["stream_error"] else ""
        print(f"| {label} | {result['statuses'] or '-'} | {result['answer']:.2f} s | {result['health']:.3f} s | "
              f"{result['gap']:.3f} s{error} | {result['rss']:.0f} MB |")


def batch_occupancy(base: str) -> float:
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith("drama3_batch_occupancy "):
            return float(line.split()[1])
    return float("nan")


def prefill_times(args, repeats: int = 5) -> None:
    """Median time to prefill one voice prompt whole, and from the voice's cached prefix (warm)."""
    import torch

    from transformers_drama3.serving.engine import prefill_alone
    from transformers_drama3.serving.prefix_cache import PrefixCache
    from transformers_drama3.serving.protocol import Limits, parse_speech

    with tempfile.TemporaryDirectory() as voices:
        service = load_service(args, voices, max_batch=1, prefix_cache=False)
        service.engine.stop()
        params = parse_speech({"input": TEXTS[1], "voice": voices_of(service)[0]}, Limits(), lambda voice: voice in service.voices)
        job = service.job(params, None)
        cache = PrefixCache()
        cache.prefill(service.model, job)  # warm

        def median(function) -> float:
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                with torch.no_grad():
                    function(service.model, job)
                times.append(time.perf_counter() - started)
            return float(np.median(times))

        whole, cached = median(prefill_alone), median(cache.prefill)
    rows = job.input_ids.shape[1]
    print(f"prefill of one voice-A prompt ({rows} rows): whole {whole * 1e3:.1f} ms, from the cached voice prefix "
          f"{cached * 1e3:.1f} ms ({whole / cached:.2f}x)")


def run(args, prefix_cache: bool) -> None:
    with tempfile.TemporaryDirectory() as voices:
        service = load_service(args, voices, max_batch=args.max_batch, max_queue=max(64, args.clients),
                               prefix_cache=prefix_cache)
        server, thread, base = start_server(service)
        try:
            spf, names, rate = stream_samples_per_frame(service), voices_of(service), PCM_RATE
            deadline = time.perf_counter() + args.time_limit
            one_stream(base, 0, args.frames, deadline, spf, names)  # warm-up (and the voice's prefix, when cached)
            alone = one_stream(base, 1, args.frames, deadline, spf, names)
            single_rate = alone.get("frames", 0) / alone["seconds"] if "seconds" in alone else float("nan")
            steps_before = service.engine.stats.steps, service.engine.stats.occupied
            started = time.perf_counter()
            with ThreadPoolExecutor(args.clients) as pool:
                results = list(pool.map(lambda i: one_stream(base, 100 + i, args.frames, deadline, spf, names),
                                        range(args.clients)))
            elapsed = time.perf_counter() - started
            stats = service.engine.stats
            steps = stats.steps - steps_before[0]
            occupancy = (stats.occupied - steps_before[1]) / steps if steps else float("nan")
        finally:
            server.should_exit = True
            thread.join(timeout=10)
            service.engine.stop()
    errors = [r["error"] for r in results if "error" in r]
    ttfa = np.array([r["ttfa"] for r in results if r.get("ttfa") is not None])
    frames = sum(r.get("frames", 0) for r in results)
    aggregate = frames / elapsed
    label = "with the voice-prefix cache" if prefix_cache else "without the voice-prefix cache"
    print(f"{label}: {args.clients} clients, {args.frames} frames each at most, max batch {args.max_batch}")
    print(f"  errors: {len(errors)} {sorted(set(errors)) if errors else ''}")
    if ttfa.size:
        print(f"  time to first audio: p50 {np.percentile(ttfa, 50):.3f} s, p95 {np.percentile(ttfa, 95):.3f} s; "
              f"one stream alone {alone.get('ttfa', float('nan')):.3f} s")
    print(f"  frames/s: {aggregate:.1f} aggregate vs {single_rate:.1f} one stream ({aggregate / single_rate:.2f}x)")
    print(f"  batch occupancy: {occupancy:.2f} requests per decode step")
    worst = max((playback_stall(result, rate) for result in results), default=float("nan"))
    print(f"  faster than real time (never stalling a player): {realtime_streams(results, rate)} of {args.clients} "
          f"streams at once; worst playback stall {max(worst, 0.0):.3f} s")


def realtime_levels(clients: int) -> list[int]:
    """1, 2, 4, ... below `clients`, then `clients`."""
    levels = [1]
    while levels[-1] * 2 < clients:
        levels.append(levels[-1] * 2)
    return sorted(set(levels) | {clients})


def most_realtime_streams(levels: dict[int, list[dict]], sampling_rate: float) -> int:
    """The most streams at once, of the levels run (level -> its streams' results), that all ran
    faster than real time with no error; 0 when no level did."""
    return max((level for level, results in levels.items()
                if len(results) == level and realtime_streams(results, sampling_rate) == level), default=0)


def realtime(args) -> None:
    """Concurrent real-time streams: levels of 1, 2, 4, ... `--clients` streams at once on one server."""
    with tempfile.TemporaryDirectory() as voices:
        service = load_service(args, voices, max_batch=args.max_batch, max_queue=max(64, args.clients))
        server, thread, base = start_server(service)
        try:
            spf, names, rate = stream_samples_per_frame(service), voices_of(service), PCM_RATE
            one_stream(base, 0, args.frames, time.perf_counter() + args.time_limit, spf, names)  # warm-up
            levels = {}
            for level in realtime_levels(args.clients):
                deadline = time.perf_counter() + args.time_limit
                with ThreadPoolExecutor(level) as pool:
                    levels[level] = list(pool.map(lambda i: one_stream(base, 100 + i, args.frames, deadline, spf, names),
                                                  range(level)))
        finally:
            server.should_exit = True
            thread.join(timeout=10)
            service.engine.stop()
    print(f"concurrent streams of {args.frames} frames on {args.device}{' (compiled step)' if args.compile else ''}, "
          f"max batch {args.max_batch}; real time: {rate / spf:.2f} frames/s")
    print("| streams at once | errors | time to first audio p50 / p95 | worst playback stall | all faster than real time |")
    print("|---|---|---|---|---|")
    for level, results in levels.items():
        ttfa = np.array([r["ttfa"] for r in results if r.get("ttfa") is not None])
        p50, p95 = (np.percentile(ttfa, 50), np.percentile(ttfa, 95)) if ttfa.size else (float("nan"),) * 2
        worst = max(playback_stall(result, rate) for result in results)
        every = realtime_streams(results, rate) == level
        print(f"| {level} | {sum('error' in r for r in results)} | {p50:.3f} s / {p95:.3f} s | {max(worst, 0.0):.3f} s | "
              f"{'yes' if every else 'no'} |")
    print(f"concurrent real-time streams: {most_realtime_streams(levels, rate)} (the most streams at once, of the "
          f"levels run, that all ran faster than real time)")


def write_adapters(model_source, folder, count: int, rank: int) -> list[str]:
    """`count` "light" adapters of the model with random (non-zero) weights, saved under `folder`."""
    import copy
    import json

    import torch

    from transformers_drama3 import Drama3ForSpeechGeneration
    from transformers_drama3.serving.adapter_layers import BASE_FILE, base_fingerprint
    from transformers_drama3.training.lora import apply_lora

    base = Drama3ForSpeechGeneration.from_pretrained(model_source or shipped.TINY_MODEL_PATH)
    specs = []
    for index in range(count):
        peft = apply_lora(copy.deepcopy(base), "light", r=rank)
        generator = torch.Generator().manual_seed(index)
        with torch.no_grad():
            for _, parameter in peft.named_parameters():
                if parameter.requires_grad:
                    parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02)
        path = f"{folder}/adapter{index}"
        peft.save_pretrained(path)
        with open(f"{path}/{BASE_FILE}", "w") as handle:
            json.dump(base_fingerprint(base.config), handle)
        specs.append(f"v{index}={path}")
    return specs


def mix_run(args, voices: list[str], **load) -> dict:
    """`--clients` streams at once, client i with voice voices[i mod len(voices)] (each voice warmed first)."""
    with tempfile.TemporaryDirectory() as stored:
        service = load_service(args, stored, max_batch=args.max_batch, max_queue=max(64, args.clients), **load)
        server, thread, base = start_server(service)
        try:
            spf = stream_samples_per_frame(service)
            deadline = time.perf_counter() + args.time_limit
            for voice in voices:  # warm-up: each voice's prefix cached, each adapter loaded
                mixed_stream(base, 0, voice, 4, deadline, spf)
            started = time.perf_counter()
            with ThreadPoolExecutor(args.clients) as pool:
                results = list(pool.map(lambda i: mixed_stream(base, 100 + i, voices[i % len(voices)], args.frames, deadline, spf),
                                        range(args.clients)))
            elapsed = time.perf_counter() - started
        finally:
            server.should_exit = True
            thread.join(timeout=10)
            service.engine.stop()
    ttfa = np.array([r["ttfa"] for r in results if r.get("ttfa") is not None])
    return {"errors": [r["error"] for r in results if "error" in r],
            "ttfa": (np.percentile(ttfa, 50), np.percentile(ttfa, 95)) if ttfa.size else (float("nan"),) * 2,
            "rate": sum(r.get("frames", 0) for r in results) / elapsed}


def mixed_stream(base: str, index: int, voice: str, frames: int, deadline: float, samples_per_frame: int) -> dict:
    """`one_stream` with a given voice and one text for every client (the same prompt length)."""
    body = {"model": "drama3", "input": TEXTS[1], "voice": voice, "response_format": "pcm", "stream_format": "audio",
            "seed": index, "max_new_tokens": frames}
    started, first, received = time.perf_counter(), None, 0
    try:
        with httpx.stream("POST", base + "/v1/audio/speech", json=body, timeout=max(1.0, deadline - started)) as response:
            if response.status_code != 200:
                return {"error": f"status {response.status_code}"}
            for chunk in response.iter_bytes():
                if chunk and first is None:
                    first = time.perf_counter() - started
                received += len(chunk)
    except httpx.HTTPError as error:
        return {"error": type(error).__name__}
    return {"ttfa": first, "frames": received / 2 / samples_per_frame}


def adapter_mix(args) -> None:
    import os

    counts = sorted({count for count in (0, 1, 4, 16) if count <= args.adapters} | {args.adapters})
    clip = os.path.join(shipped.TINY_MODEL_PATH, "voices")
    with tempfile.TemporaryDirectory() as folder:
        specs = write_adapters(args.model, folder, args.adapters, args.adapter_rank)
        names = [spec.split("=")[0] for spec in specs]
        references = [f"{name}={clip}/A.wav:{clip}/A.txt" for name in names]
        slots = dict(adapter_specs=specs, voice_specs=references, max_adapters=max(1, args.adapters),
                     adapter_rank=args.adapter_rank)
        first = mix_run(args, ["A"])  # the base alone before and after the mixes: the machine's drift shows
        mixes = {count: mix_run(args, names[:count] or ["A"], **slots) for count in counts}
        last = mix_run(args, ["A"])
    alone = {"ttfa": [(a + b) / 2 for a, b in zip(first["ttfa"], last["ttfa"])], "rate": (first["rate"] + last["rate"]) / 2}
    print(f"fine-tuned voices: {args.clients} clients, {args.frames} frames each at most, max batch {args.max_batch}, "
          f"LoRA rank {args.adapter_rank} on the light preset's layers")
    print("(ratios against the mean of the two runs of the base alone, served without adapter slots)")
    print("| adapters in the mix | errors | time to first audio p50 / p95 | frames/s | TTFA p50 vs base | frames/s vs base |")
    print("|---|---|---|---|---|---|")
    rows = [("base alone, first", first)] + [(f"{count}" + (" (slots installed)" if count == 0 else ""), mixes[count])
                                                         for count in counts] + [("base alone, last", last)]
    for label, result in rows:
        print(f"| {label} | {len(result['errors'])} | {result['ttfa'][0]:.3f} s / {result['ttfa'][1]:.3f} s | "
              f"{result['rate']:.1f} | {result['ttfa'][0] / alone['ttfa'][0]:.2f}x | {result['rate'] / alone['rate']:.2f}x |")


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--frames", type=int, default=64, help="max_new_tokens of each request")
    parser.add_argument("--time-limit", type=float, default=120.0, help="seconds per run, all clients together")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--model", default=None, help="checkpoint (default: the bundled drama3-tiny)")
    parser.add_argument("--attack", action="store_true", help="run the attack mix (long prompts beside streams)")
    parser.add_argument("--streams", type=int, default=4, help="--attack: streams running when the long prompts come")
    parser.add_argument("--long-prompts", type=int, default=3, help="--attack: long prompts sent together")
    parser.add_argument("--attack-bodies", type=int, default=4,
                        help="--attack: hostile ~30 MiB bodies posted at once beside a stream (0: no body attack)")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="--attack: the engine's prefill_chunk (rows per step; default: the server's for the device)")
    parser.add_argument("--prefill-share", type=float, default=None,
                        help="--attack: the engine's prefill_share (fraction of its time; default: the server's)")
    parser.add_argument("--sequential", action="store_true",
                        help="--attack: send the long prompts one after the answer to the last, not all at once")
    parser.add_argument("--adapters", type=int, default=None,
                        help="run the fine-tuned-voice mix: N adapters, mixes of 0, 1, 4, 16 (up to N) against the base")
    parser.add_argument("--adapter-rank", type=int, default=16, help="--adapters: the adapters' LoRA rank")
    parser.add_argument("--realtime", action="store_true",
                        help="run the concurrent real-time streams: 1, 2, 4, ... --clients streams at once")
    parser.add_argument("--device", default="cpu", help="where the model runs (drama3 serve's --device): cpu, cuda")
    parser.add_argument("--compile", action="store_true", help="the engine steps the compiled decode step")
    parser.add_argument("--random-model", choices=RANDOM_MODELS, default=None,
                        help="serve a model of random weights built in memory instead of --model")
    parser.add_argument("--layers", type=int, default=40, help="--random-model: backbone layers (4 to 40)")
    args = parser.parse_args(argv)
    if not 1 <= args.clients <= 1024:
        parser.error(f"--clients {args.clients}: expected 1..1024")
    if args.attack:
        for name, value in (("--streams", args.streams), ("--long-prompts", args.long_prompts)):
            if not 1 <= value <= 64:
                parser.error(f"{name} {value}: expected 1..64")
        if not 0 <= args.attack_bodies <= 8:
            parser.error(f"--attack-bodies {args.attack_bodies}: expected 0..8")
    if args.prefill_share is not None and not 0.0 < args.prefill_share <= 1.0:
        parser.error(f"--prefill-share {args.prefill_share}: expected a fraction in (0, 1]")
    if args.adapters is not None and not 1 <= args.adapters <= 64:
        parser.error(f"--adapters {args.adapters}: expected 1..64")
    if args.random_model is not None and args.model is not None:
        parser.error("--random-model with --model: serve one of them")
    if args.random_model is not None and args.adapters is not None:
        parser.error("--random-model with --adapters: the adapters are made from a checkpoint (--model)")
    if not 4 <= args.layers <= 40:
        parser.error(f"--layers {args.layers}: expected 4 to 40 (the decode cache needs a full-attention layer)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here")
    return args


def main(argv=None) -> None:
    args = parse_arguments(argv)
    if args.realtime:
        realtime(args)
        return
    if args.attack:
        attack(args)
        return
    if args.adapters is not None:
        adapter_mix(args)
        return
    prefill_times(args)
    for prefix_cache in (True, False):
        run(args, prefix_cache)


if __name__ == "__main__":
    main()
