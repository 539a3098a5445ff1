"""What the `drama3` command does, once its arguments are parsed (`runtime.command_line`).

The console script is `drama3_cli:main`, beside the package: it parses the command line without
importing torch (so `drama3 --help` and argument errors answer at once), then calls `run` here.
`main(argv)` does both, for Python callers and tests. Each subcommand is a `run_<name>(args)` in
`HANDLERS` and a parser in `runtime.command_line`. `eval` measures whether a model says the words (`evaluation`, the [eval]
extra); drama3-tiny's full evaluation (voice, directions, DTW on the corpus's held-out split) is
research code and runs from the source tree: `python -m recipes.drama3_tiny.evaluation`.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import asdict

import numpy as np
import soundfile
import torch

from .placement.accounting import account, format_table
from .runtime.command_line import EVAL_OPTIONS, SAY_OPTIONS, SWITCH_WORDS, build_parser
from .configuration_drama3 import Drama3Config
from .evaluation import asr
from .evaluation.espeak import INSTALL_HINT as ESPEAK_HINT
from .evaluation.espeak import espeak_available
from .evaluation.intelligibility import HELDOUT_SENTENCES, check_sentences, check_voices, measure_intelligibility
from .output_files import atomic_output, check_output_path, same_file, write_text_atomic
from .runtime.command_line import EXIT_BIND, EXIT_LOAD
from .runtime.loading import DEFAULT_MODEL, CommandError, load_model_and_processor, resolve_device
from .runtime.long_form import generate_long_form
from .placement.planning import fitting, format_plans, load_code, plan_options, refusal
from .decoding.alignment import resolve_alignment
from .decoding.options import Option
from .prompting import parse_text
from .tiny import shipped


# ----------------------------------------------------------------------------- say


class FileStreamer:
    """Writes waveform chunks to a WAV/FLAC file as they arrive; reports the time to first audio.
    `path` is a temporary file (see `files.atomic_output`): the user's file is replaced only
    once the whole take is written."""

    def __init__(self, path: str, sampling_rate: int, started: float):
        self.file = soundfile.SoundFile(path, mode="w", samplerate=sampling_rate, channels=1, subtype="PCM_16")
        self.started, self.first, self.samples = started, None, 0

    def put(self, value) -> None:
        samples = value.detach().to("cpu").float().numpy().reshape(-1)
        if self.first is None and samples.size:
            self.first = time.perf_counter() - self.started
        self.file.write(np.clip(samples, -1.0, 1.0))
        self.samples += samples.size

    def end(self) -> None:
        self.file.close()


def run_say(args) -> int:
    options = _check_say_arguments(args)
    source, references, transcripts, speakers = _resolve_model_and_voice(args)
    _check_every_speaker_has_a_reference(args, references, speakers)
    model, processor = load_model_and_processor(source, args.device, args.dtype, progress=not args.quiet, quant=args.quant,
                                                offload=args.offload_experts)
    started = time.perf_counter()
    try:
        with atomic_output(args.output) as temporary:
            streamer = FileStreamer(temporary, processor.sampling_rate, started) if args.stream else None
            try:
                output = generate_long_form(
                    model,
                    processor,
                    args.text,
                    reference_audio=references or None,
                    reference_text=transcripts or None,
                    reference_speaker=speakers,
                    streamer=streamer,
                    progress=not args.quiet,
                    scene=None if args.scene == "auto" else args.scene,
                    threads=args.threads,
                    **options,
                )
            finally:
                if streamer is not None:
                    streamer.end()
            if streamer is None:
                processor.save_audio(output.audio.cpu(), temporary)
    except ValueError as error:
        raise CommandError(str(error)) from None
    except (OSError, soundfile.SoundFileError) as error:  # disk full, folder removed meanwhile, ...
        raise CommandError(f"-o {args.output}: could not write it ({error}); the file was left as it was") from None
    elapsed = time.perf_counter() - started
    seconds = output.audio_codes.shape[0] / processor.frame_rate
    report = f"wrote {args.output}: {seconds:.2f} s of audio in {elapsed:.2f} s, {len(output.chunks)} chunk(s)"
    if output.turns is not None:
        report += f", {len(output.turns)} turn(s)"
    if streamer is not None and streamer.first is not None:
        report += f", first audio after {streamer.first:.3f} s"
    print(report)
    for index, anomalies in enumerate(output.anomalies):
        if anomalies:
            print(f"warning: chunk {index}: {', '.join(anomalies)}", file=sys.stderr)
    return 0


def option_values(args, options: tuple[Option, ...]) -> dict:
    """The request options given on the command line (`runtime.command_line.add_option_flags`), by option
    name, each checked by the option schema's one check (the one `generate()`, the server and the
    demo run) before anything is loaded; the message names the flag."""
    values = {}
    for option in options:
        value = getattr(args, option.name, None)
        if value is None:
            continue
        if option.kind is bool:
            value = SWITCH_WORDS[value]
        if not option.accepts(value):
            raise CommandError(f"{option.cli_flag} {value}: expected {option.expected()}")
        values[option.name] = value
    return values


def _check_say_arguments(args) -> dict:
    """Refuse what `say` cannot do before anything is loaded or written (bad numbers, an -o that
    cannot be written or is a reference); returns generate()'s keyword arguments."""
    extension = os.path.splitext(args.output)[1].lower()
    if extension not in (".wav", ".flac"):
        raise CommandError(f"-o {args.output}: write a .wav or .flac file")
    if args.max_chars < 1:
        raise CommandError(f"--max-chars {args.max_chars}: expected a positive number of characters")
    options = option_values(args, SAY_OPTIONS)
    if len(args.text) > args.max_chars:
        raise CommandError(
            f"text: {len(args.text)} characters, over the --max-chars limit of {args.max_chars}; "
            f"split it, or raise --max-chars"
        )
    if len(args.reference) != len(args.reference_text):
        raise CommandError(
            f"--reference given {len(args.reference)} time(s) but --reference-text {len(args.reference_text)}; "
            f"each reference audio needs its transcript"
        )
    for path in args.reference:
        if not os.path.isfile(path):
            raise CommandError(f"--reference {path}: no such file")
        if same_file(path, args.output):
            raise CommandError(f"-o {args.output} is the --reference {path}: writing the take would destroy the recording")
    if args.reference_speaker and len(args.reference_speaker) != len(args.reference):
        raise CommandError(
            f"--reference-speaker given {len(args.reference_speaker)} time(s) but --reference {len(args.reference)}; "
            f"give one speaker per reference, or none for all speaker 0"
        )
    for speaker in args.reference_speaker:
        if speaker < 0:
            raise CommandError(f"--reference-speaker {speaker}: speakers are numbered from 0")
    if args.stream and options.get("regenerate_on_anomaly"):
        raise CommandError("--stream and --regenerate cannot be combined: streamed audio cannot be taken back")
    try:
        check_output_path(args.output, "-o")
    except ValueError as error:
        raise CommandError(str(error)) from None
    return options


def _resolve_model_and_voice(args) -> tuple[str, list[str], list[str], list[int] | None]:
    """The model to load and the references to clone (audio, transcripts, speakers): `--model`, or
    the bundled drama3-tiny (said on stderr) with bundled voices when no `--reference` is given."""
    if args.model is not None:
        if args.voice is not None:
            raise CommandError("--voice picks a bundled drama3-tiny voice; with --model give --reference instead")
        return args.model, args.reference, args.reference_text, args.reference_speaker or None
    if not shipped.is_available():
        raise CommandError(f"this installation carries no drama3-tiny; pass --model (e.g. --model {DEFAULT_MODEL})")
    print(
        f"drama3 say: no --model given; using drama3-tiny, the small espeak-trained model bundled with the "
        f"package ({shipped.TINY_MODEL_PATH}). For the published model pass --model {DEFAULT_MODEL}.",
        file=sys.stderr,
    )
    if args.reference:
        if args.voice is not None:
            raise CommandError("give either --voice or --reference, not both")
        return shipped.TINY_MODEL_PATH, args.reference, args.reference_text, args.reference_speaker or None
    names = [name.strip() for name in (args.voice or shipped.DEFAULT_VOICE).split(",")]
    if not all(names):
        raise CommandError(f"--voice {args.voice}: expected voice names separated by commas, like A,B")
    references, transcripts = [], []
    for voice in names:
        try:
            audio, transcript = shipped.reference_voice(voice)
        except ValueError as error:
            raise CommandError(f"--voice {voice}: {error}") from None
        references.append(audio)
        transcripts.append(transcript)
    if len(names) == 1:
        cloned = f"voice {names[0]}"
    else:
        cloned = "voices " + ", ".join(f"{voice} (speaker {speaker})" for speaker, voice in enumerate(names))
    print(f"drama3 say: cloning drama3-tiny's bundled {cloned} (pass --reference to clone another)", file=sys.stderr)
    return shipped.TINY_MODEL_PATH, references, transcripts, list(range(len(names)))


def _check_every_speaker_has_a_reference(args, references, speakers) -> None:
    """With references given, every speaker of the text needs one (in the command's own words:
    generate's error names Python arguments)."""
    if not references:
        return
    try:
        used = sorted({line.speaker for line in parse_text(args.text, "text")})
    except ValueError as error:
        raise CommandError(str(error)) from None
    cloned = set(speakers if speakers is not None else [0] * len(references))
    missing = [speaker for speaker in used if speaker not in cloned]
    if missing:
        how = (f"--voice with one bundled voice per speaker (e.g. --voice {','.join('ABDF'[: max(used) + 1])})"
               if args.model is None and not args.reference else
               f"a --reference and --reference-text for it with --reference-speaker {missing[0]}")
        raise CommandError(
            f"text: speaker {missing[0]} has no reference (the references clone speaker(s) "
            f"{', '.join(map(str, sorted(cloned)))}); give {how}"
        )


# ----------------------------------------------------------------------------- table, serve

def run_table(args) -> int:
    config = None
    if args.config:
        if not os.path.isfile(args.config):
            raise CommandError(f"--config {args.config}: no such file")
        try:
            config = Drama3Config.from_json_file(args.config)
        except (ValueError, TypeError) as error:  # broken JSON, no text_config, unknown or wrong sizes
            raise CommandError(f"--config {args.config}: {error}") from None
    print(format_table(account(config)))
    return 0


def run_serve(args) -> int:
    """Check the flags, bind the address (`listen`), load the model in the background and serve
    (`run_server`) until stopped: exit 0; `EXIT_BIND` when the address cannot be bound, `EXIT_LOAD`
    when the model, a voice or an adapter fails to load, each said in one line."""
    try:  # fastapi and uvicorn come with the optional [serve] extra: import them only here
        from .serving.app import ServerSettings, create_app, is_loopback, serve_in_background
        from .serving.keys import resolve_api_key
        from .serving.openai_names import VoiceAliases
        from .serving.protocol import Limits
        from .serving.request_guard import allowed_hosts_for, origin_of
        from .serving.voices import reference_file_voice
    except ImportError as error:
        raise CommandError(f"serving needs the [serve] extra ({error}); pip install 'transformers-drama3[serve]'") from None
    if args.prefill_chunk is not None and args.prefill_chunk < 2:
        raise CommandError(f"--prefill-chunk {args.prefill_chunk}: expected at least 2 rows")
    if args.prefill_share is not None and not 0.0 < args.prefill_share <= 1.0:
        raise CommandError(f"--prefill-share {args.prefill_share}: expected a fraction in (0, 1]")
    for name, value in (("--max-batch", args.max_batch), ("--port", args.port), ("--max-input-chars", args.max_input_chars),
                        ("--max-body-mb", args.max_body_mb), ("--max-text-streams", args.max_text_streams)):
        if value < 1:
            raise CommandError(f"{name} {value}: expected a positive number")
    if args.max_queue < 0:
        raise CommandError(f"--max-queue {args.max_queue}: expected 0 or more")
    for spec in args.voice:
        try:
            reference_file_voice(spec)
        except ValueError as error:
            raise CommandError(str(error)) from None
    check_adapter_flags(args)
    if args.quant is not None and (args.adapter or args.adapter_root is not None):
        raise CommandError(f"--quant {args.quant} with --adapter / --adapter-root: adapter voices are served on "
                           "unquantised weights only; drop one of them")
    if args.offload_experts is not None and (args.compile or args.quant is not None or args.offload_experts < 1):
        raise CommandError(f"--offload-experts {args.offload_experts}: expected at least 1 expert per layer, without "
                           "--compile (the compiled step cannot copy experts in) and without --quant")
    for name, value in (("--body-timeout", args.body_timeout), ("--stream-idle-timeout", args.stream_idle_timeout),
                        ("--header-timeout", args.header_timeout)):
        if not value > 0:
            raise CommandError(f"{name} {value}: expected a positive number of seconds")
    try:
        api_key = resolve_api_key(args.api_key, args.api_key_file)
        aliases = VoiceAliases.from_specs(args.voice_alias)
        origins = tuple(origin_of(origin) for origin in _listed(args.allowed_origins))
    except ValueError as error:
        raise CommandError(str(error)) from None
    hosts = allowed_hosts_for(args.host, _listed(args.allowed_hosts))
    device = resolve_device(args.device)
    listener = listen(args.host, args.port)  # a port in use is said now, not after minutes of loading
    loading = LoadWatch()
    get_service, _ = serve_in_background(
        args.model, args.voices_dir, on_failure=loading.failed, device=device, max_batch=args.max_batch,
        max_queue=args.max_queue, voice_specs=args.voice, prefix_cache=not args.no_prefix_cache, threads=args.threads,
        compile=args.compile, adapter_specs=args.adapter, adapter_root=args.adapter_root, max_adapters=args.max_adapters,
        adapter_rank=args.adapter_rank, quant=args.quant, offload=args.offload_experts, prefill_chunk=args.prefill_chunk,
        prefill_share=args.prefill_share,
    )
    settings = ServerSettings(api_key=api_key, open_listings=args.open_listings, request_timeout=args.timeout,
                              body_timeout=args.body_timeout, stream_idle_timeout=args.stream_idle_timeout,
                              voice_aliases=aliases, limits=Limits(max_input_chars=args.max_input_chars),
                              max_body_bytes=args.max_body_mb * 2**20, max_text_streams=args.max_text_streams,
                              allowed_hosts=hosts, allowed_origins=origins)
    app = create_app(get_service, settings)
    if args.log_requests:
        log_requests_to_stderr()
    print(f"drama3 serve: http://{args.host}:{args.port}/v1/audio/speech (model: {args.model or 'drama3-tiny'})", file=sys.stderr)
    if api_key is None and not is_loopback(args.host):
        print(f"drama3 serve: warning: --host {args.host} serves every route, voice create and delete included, to "
              "anyone who can reach it, without a key; set DRAMA3_API_KEY (or --api-key-file)", file=sys.stderr)
    if "*" not in hosts and not is_loopback(args.host):
        print(f"drama3 serve: requests must name this server as one of {', '.join(hosts)} (the Host header); give the "
              "names clients use with --allowed-hosts", file=sys.stderr)
    run_server(app, listener, args.header_timeout, loading)
    if loading.message is not None:
        raise CommandError(loading.message, exit_code=EXIT_LOAD)
    return 0


def _listed(values) -> list[str]:
    """Values of a repeatable flag that also takes comma-separated lists, blanks left out."""
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


class LoadWatch:
    """Whether the model's background load failed (its one-line message), and how to stop the
    server then: whichever of the two comes first, the server stops."""

    def __init__(self):
        self.message: str | None = None
        self._stop = None
        self._lock = threading.Lock()

    def failed(self, message: str) -> None:
        with self._lock:
            self.message = message.replace("\n", " ")
            stop = self._stop
        if stop is not None:
            stop()

    def stop_with(self, stop) -> None:
        """Call `stop()` when the load fails (now, if it has failed already)."""
        with self._lock:
            self._stop = stop
            failed = self.message is not None
        if failed:
            stop()


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to `host`:`port` (uvicorn listens on it); CommandError `EXIT_BIND` naming the
    address when it cannot be bound (in use, not this machine's, not permitted)."""
    address = host.strip("[]")
    listener = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((address, port))
    except OSError as error:
        listener.close()
        reason = error.strerror or str(error)
        raise CommandError(f"cannot listen on {host}:{port}: {reason.lower()} (choose another --port or --host)",
                           exit_code=EXIT_BIND) from None
    return listener


def run_server(app, listener: socket.socket, header_timeout: float, loading: LoadWatch) -> None:
    """uvicorn serving `app` on `listener` (request heads held to `header_timeout` seconds) until it
    is stopped, or `loading` fails."""
    import uvicorn

    from .serving.connections import header_timeout_protocol

    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=header_timeout_protocol(header_timeout)))
    loading.stop_with(lambda: setattr(server, "should_exit", True))
    server.run(sockets=[listener])


def log_requests_to_stderr() -> None:
    """`--log-requests`: the request log (`serving.request_log`) printed to stderr, a line per request."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("drama3 serve: %(message)s"))
    request_log = logging.getLogger("transformers_drama3.serving.requests")
    request_log.addHandler(handler)
    request_log.setLevel(logging.INFO)
    request_log.propagate = False


def check_adapter_flags(args) -> None:
    """`drama3 serve --adapter NAME=PATH ...`: well-formed, existing folders, positive limits (the
    adapters themselves are checked against the model once it has loaded)."""
    for name, value in (("--max-adapters", args.max_adapters), ("--adapter-rank", args.adapter_rank)):
        if value < 1:
            raise CommandError(f"{name} {value}: expected a positive number")
    check_adapter_specs(args.adapter)
    if args.adapter_root is not None and not os.path.isdir(args.adapter_root):
        raise CommandError(f"--adapter-root {args.adapter_root}: not a folder")


def check_adapter_specs(specs) -> None:
    """`--adapter NAME=PATH` values: the form, and a folder at PATH."""
    if not specs:
        return
    from .serving.adapters import parse_adapter_spec  # the adapter code loads only for a server given adapters

    for spec in specs:
        try:
            _, path = parse_adapter_spec(spec)
        except ValueError as error:
            raise CommandError(str(error)) from None
        if not os.path.isdir(path):
            raise CommandError(f"--adapter {spec}: {path} is not a folder")


def run_demo(args) -> int:
    for name, value in (("--max-batch", args.max_batch), ("--port", args.port)):
        if value < 1:
            raise CommandError(f"{name} {value}: expected a positive number")
    try:  # gradio comes with the optional [demo] extra: import it only here
        from .serving.demo import launch
    except ImportError as error:
        raise CommandError(f"the demo needs the [demo] extra ({error}); pip install 'transformers-drama3[demo]'") from None
    check_adapter_specs(args.adapter)
    launch(args.model, args.host, args.port, args.share, args.device, args.max_batch, adapter_specs=args.adapter)
    return 0


# ----------------------------------------------------------------------------- eval


def _eval_sentences(args) -> list[str]:
    """The sentences `eval` speaks: the first `--sentences` held-out ones, or `--sentences-file`'s lines."""
    if args.sentences is not None and args.sentences_file is not None:
        raise CommandError("give either --sentences or --sentences-file, not both")
    if args.sentences_file is not None:
        try:
            with open(args.sentences_file, encoding="utf-8") as handle:
                lines = [line.strip() for line in handle if line.strip()]
        except (OSError, UnicodeDecodeError) as error:
            raise CommandError(f"--sentences-file {args.sentences_file}: could not read it ({error})") from None
        try:
            return check_sentences(lines)
        except ValueError as error:
            raise CommandError(f"--sentences-file {args.sentences_file}: {error}") from None
    count = len(HELDOUT_SENTENCES) if args.sentences is None else args.sentences
    if not 1 <= count <= len(HELDOUT_SENTENCES):
        raise CommandError(f"--sentences {count}: expected 1 to {len(HELDOUT_SENTENCES)} (the held-out sentences)")
    return list(HELDOUT_SENTENCES[:count])


def _eval_references(voice_list: str | None) -> dict[str, tuple[str, str]]:
    """Voice name -> (bundled reference clip, its transcript), for `--voice A,B,...` (None: every
    bundled voice)."""
    if not shipped.is_available():
        raise CommandError("this installation carries no drama3-tiny, whose bundled voices eval clones")
    if voice_list is None:
        voice_list = ",".join(shipped.voices())
    try:
        names = check_voices([name.strip() for name in voice_list.split(",") if name.strip()])
        return {name: shipped.reference_voice(name) for name in names}
    except ValueError as error:
        raise CommandError(f"--voice {voice_list}: {error}") from None


def _eval_seeds(args) -> int | list[int]:
    """`--seed N` (default 0), or `--seeds A,B,...` (distinct integers)."""
    if args.seeds is None:
        return 0 if args.seed is None else args.seed
    if args.seed is not None:
        raise CommandError("give either --seed or --seeds, not both")
    try:
        seeds = [int(part) for part in args.seeds.split(",")]
    except ValueError:
        raise CommandError(f"--seeds {args.seeds}: expected integers separated by commas, e.g. 0,100,200") from None
    if len(set(seeds)) != len(seeds):
        raise CommandError(f"--seeds {args.seeds}: each seed once")
    return seeds


def run_eval(args) -> int:
    """Check everything, load the recogniser (it says at once when the [eval] extra is missing),
    then the model; speak, transcribe, print the table."""
    sentences = _eval_sentences(args)
    references = _eval_references(args.voice)
    seeds = _eval_seeds(args)
    sampling = option_values(args, EVAL_OPTIONS)
    if args.json:
        try:
            check_output_path(args.json, "--json")
        except ValueError as error:
            raise CommandError(str(error)) from None
    if not espeak_available():
        raise CommandError(f"eval renders its originals with espeak-ng, which is not on PATH; {ESPEAK_HINT}")
    try:
        asr.whisper_model()
    except ImportError as error:
        raise CommandError(str(error)) from None
    model, processor = load_model_and_processor(args.model or shipped.TINY_MODEL_PATH, args.device, "float32",
                                                progress=not args.quiet, quant=args.quant)
    sampling["threads"] = args.threads
    try:
        aligned = resolve_alignment(model, [sampling]) is not None
    except ValueError as error:
        raise CommandError(str(error)) from None
    report = measure_intelligibility(model, processor, references, sentences, seed=seeds,
                                     progress=not args.quiet, **sampling)
    print(f"model outputs decoded {'phoneme-aligned' if aligned else 'freely (no phoneme alignment)'}"
          + (f", weights quantised: {args.quant}" if args.quant else ""))
    print(report.table())
    if args.json:
        write_text_atomic(args.json, json.dumps(asdict(report), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


# ----------------------------------------------------------------------------- plan


def run_plan(args) -> int:
    """Print the plan of every option (or of --quant); exit 1 when what was asked does not fit."""
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    try:
        options = plan_options(args.model, args.gpu_gb, streams=args.streams, context=args.context, dtype=dtype,
                               prefill_rows=args.prefill_rows)
    except ValueError as error:
        raise CommandError(str(error)) from None
    asked = [plan for plan in options if plan.offload is None and plan.quantization == args.quant]
    print(format_plans(asked or options))
    if args.gpu_gb is None:
        return 0
    fit = fitting(options)
    if asked and not asked[0].fits:
        print(f"drama3 plan: {refusal(options, asked[0])}", file=sys.stderr)
        return 1
    if not fit:
        print(f"drama3 plan: {refusal(options)}", file=sys.stderr)
        return 1
    best = asked[0] if asked else fit[0]
    print(f"fits: {best.label}; load with: {load_code(best, args.model)}")
    return 0


HANDLERS = {"say": run_say, "table": run_table, "serve": run_serve, "demo": run_demo, "eval": run_eval,
            "plan": run_plan}
"""Each subcommand's work, given its parsed arguments (`runtime.command_line`); returns the exit code."""


def run(args) -> int:
    """Run the parsed command; an error the user can fix is one line on stderr and its exit code
    (`EXIT_USAGE`, or e.g. `EXIT_BIND` / `EXIT_LOAD` of `drama3 serve`)."""
    try:
        return HANDLERS[args.command](args)
    except CommandError as error:
        print(f"drama3 {args.command}: {error}", file=sys.stderr)
        return error.exit_code


def main(argv: list[str] | None = None) -> int:
    """`drama3 ARGV`: parse (`runtime.command_line`), run here."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
