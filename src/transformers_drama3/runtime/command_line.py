"""The `drama3` command line's arguments: the parser, its subcommands and their defaults.

    drama3 say "text" -o out.wav [--reference a.wav --reference-text "..." [--reference-speaker N]] [--model PATH_OR_REPO]
                                 [--voice A[,D...]] [--scene auto|joint|turns] [--stream] [--seed N]
                                 [--preset serving|paper-eval] ...
    drama3 table [--config config.json]
    drama3 serve [--model PATH_OR_REPO] [--host] [--port] [--max-batch] [--voice NAME=clip.wav:text.txt] [--api-key]
    drama3 demo [--model PATH_OR_REPO] [--host] [--port] [--share]
    drama3 eval [--model PATH_OR_REPO] [--voice A,B] [--sentences N | --sentences-file FILE] [--json out.json]
    drama3 plan [--model PATH_OR_REPO] [--quant none|fp8|int8|nf4|int4] [--gpu-gb 24] [--streams N] [--context T]
                [--prefill-rows R]

Without `--model`, `say` uses drama3-tiny, the small model shipped inside the package (trained on
espeak-ng speech; see model_card.md), and without `--reference` it clones drama3-tiny's bundled
voices (`--voice`, default A; `--voice A,B` gives speaker 0 voice A and speaker 1 voice B). Each
`--reference` clones speaker 0 unless its `--reference-speaker` says otherwise.

The request options of `say` (sampling, seed, frame cap, switches, preset, regeneration) and the
sampling options of `eval` are not listed here: each is a flag made from its entry of the option
schema (`decoding.options`: name, type, range, help), and `cli.option_values` reads them back.

This module imports only the standard library and the option schema (itself standard library
only), nothing else of the package nor torch: the console script (`drama3_cli`, beside the package)
loads the two alone, without the package's `__init__`, so that `--help` and a mistyped flag answer
before torch and transformers are imported (seconds). A parsed command is run by `cli.run`.
Subcommands are registered in `SUBCOMMANDS`: each is a function `add_<name>(subparsers)` that adds
its parser; its work is `cli.HANDLERS[name]`.
"""

from __future__ import annotations

import argparse

from ..checkpoint.quantization.schemes import PLAN_OPTIONS, WEIGHT_OPTIONS
from ..decoding.options import CLI, Option, options_for

DEFAULT_MODEL = "fishaudio/drama-3"
EXIT_USAGE = 2
"""A flag or input the user can fix (also argparse's own)."""
EXIT_LOAD = 3
"""`drama3 serve`: the model, a voice or an adapter could not be loaded."""
EXIT_BIND = 4
"""`drama3 serve`: the address could not be bound (the port in use, an address not this machine's)."""
MAX_CHARS = 4096
"""Default cap of `say`'s text, in characters (OpenAI's speech endpoint has the same)."""
THREADS_HELP = (
    "CPU threads to decode with: auto (default) picks them from the model's size and the cores other "
    "programs leave idle (one thread for drama3-tiny, or on a busy machine); N uses N"
)


SAY_OPTIONS = options_for(CLI)
"""The request options `say` takes, one flag each (`decoding.options`)."""
EVAL_OPTIONS = tuple(option for option in SAY_OPTIONS if option.sampling or option.kind is bool)
"""The options `eval` takes: how a take is drawn (its sampling and switches), not how long it may be
or how many are drawn (eval sets those, and its seeds, itself)."""
SWITCH_WORDS = {"on": True, "off": False}
"""How a switch (a bool option) is said on the command line."""


def add_option_flags(parser, options: tuple[Option, ...]) -> None:
    """One flag per option (`Option.cli_flag`, into `args.<option name>`), typed and explained by its
    entry: a switch takes on / off, a choice its choices, a number its kind. Unset (None) by
    default: the option is left to the model's generation config (or the preset)."""
    for option in options:
        help_text = f"{option.help} (default: {option.unset})"
        if option.kind is bool:
            parser.add_argument(option.cli_flag, dest=option.name, choices=list(SWITCH_WORDS), default=None, help=help_text)
        elif option.choices:
            parser.add_argument(option.cli_flag, dest=option.name, choices=list(option.choices), default=None,
                                help=help_text)
        else:
            metavar = option.cli_flag.lstrip("-").replace("-", "_").upper()
            parser.add_argument(option.cli_flag, dest=option.name, type=option.kind, default=None, metavar=metavar,
                                help=help_text)


def thread_count(value: str):
    """`--threads`: "auto" or a positive number of threads."""
    if value == "auto":
        return value
    try:
        return positive_count(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected auto or a positive number of threads") from None


def add_say(subparsers) -> None:
    parser = subparsers.add_parser("say", help="speak a text into an audio file")
    add_quant_argument(parser)
    add_offload_argument(parser)
    parser.add_argument("text", help="what to say (speaker tags <|speaker:N|>, [directions] and <tags> allowed)")
    parser.add_argument("-o", "--output", required=True, help="audio file to write (.wav or .flac)")
    parser.add_argument(
        "--model", default=None,
        help=f"checkpoint folder or Hub repo, e.g. {DEFAULT_MODEL} (default: the bundled drama3-tiny)",
    )
    parser.add_argument(
        "--voice", default=None,
        help="bundled drama3-tiny voices (A, B) when no --reference is given; a comma list gives "
             "speaker i of the text the i-th voice (--voice A,B)",
    )
    parser.add_argument(
        "--scene", choices=["auto", "joint", "turns"], default="auto",
        help="speak several speakers in one take per chunk (joint) or one speaker turn at a time (turns); "
             "auto: as the model's generation config says, else joint",
    )
    parser.add_argument("--reference", action="append", default=[], help="reference audio file (repeatable)")
    parser.add_argument("--reference-text", action="append", default=[], help="transcript of each --reference")
    parser.add_argument(
        "--reference-speaker", action="append", type=int, default=[],
        help="speaker N (<|speaker:N|>) of each --reference, in the same order (default: all speaker 0)",
    )
    parser.add_argument("--stream", action="store_true", help="write audio as it is generated; print time to first audio")
    add_option_flags(parser, SAY_OPTIONS)
    parser.add_argument(
        "--max-chars", type=int, default=MAX_CHARS,
        help=f"refuse texts longer than this many characters (default {MAX_CHARS}, like OpenAI's speech API; "
             "at the default frame cap 100k characters would take hours on a CPU)",
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--quiet", action="store_true", help="no progress bars (loading or speaking)")
    parser.add_argument("--threads", type=thread_count, default="auto", help=THREADS_HELP)


def add_table(subparsers) -> None:
    parser = subparsers.add_parser(
        "table", help="print the paper's per-frame table computed from the model built on the meta device"
    )
    parser.add_argument("--config", help="a config.json to account instead of the default full-size Drama 3")


def add_serve(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve an OpenAI-compatible /v1/audio/speech endpoint")
    add_quant_argument(parser, "; not with --adapter / --adapter-root")
    add_offload_argument(parser, " or --compile")
    parser.add_argument(
        "--prefill-chunk", type=int, default=None, metavar="ROWS",
        help="rows of prompt prefilled at most between two frames of the running streams; prompts are prefilled in "
             "pieces of this many rows (default 512 on a GPU, 128 on a CPU; smaller: shorter stalls beside a long prompt)",
    )
    parser.add_argument(
        "--prefill-share", type=float, default=None, metavar="FRACTION",
        help="while streams run, the largest fraction of the engine's time spent prefilling new prompts (default 0.5: "
             "running streams keep at least half their frame rate; 1.0: a piece of prefill between every two frames)",
    )
    parser.add_argument("--model", default=None, help="checkpoint folder or Hub repo (default: the bundled drama3-tiny)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch", type=int, default=16, help="requests decoded together")
    parser.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a slot (then 429)")
    parser.add_argument(
        "--voice", action="append", default=[],
        help="register a voice: NAME=clip.wav:transcript.txt (repeatable; NAME=a.wav:a.txt,b.wav:b.txt gives "
             "speakers 0 and 1)",
    )
    parser.add_argument("--voices-dir", default="drama3-voices", help="folder where voices are stored")
    parser.add_argument(
        "--adapter", action="append", default=[], metavar="NAME=PATH",
        help="serve a fine-tuned voice: a LoRA adapter folder (examples/finetune_voice_lora.py's out/adapter) as "
             "voice NAME, on the one base model (repeatable; requests for different adapters share a batch)",
    )
    parser.add_argument(
        "--adapter-root", default=None, metavar="DIR",
        help="let POST /v1/audio/voices register adapter folders of this machine that lie under DIR "
             "(uploaded adapters are always accepted once adapters are on)",
    )
    parser.add_argument("--max-adapters", type=int, default=8,
                        help="adapters loaded at once (the least recently used idle one is unloaded for a new one)")
    parser.add_argument("--adapter-rank", type=int, default=16, help="the largest LoRA rank an adapter may have")
    parser.add_argument(
        "--api-key", default=None,
        help="require Authorization: Bearer KEY on every route but /health (default: --api-key-file's, else "
             "$DRAMA3_API_KEY; both keep the key out of the process list)",
    )
    parser.add_argument("--api-key-file", default=None, help="read the API key from the first line of this file")
    parser.add_argument(
        "--voice-alias", action="append", default=[], metavar="ALIAS=VOICE",
        help="let requests name a stored voice by another name, e.g. alloy=A (repeatable). OpenAI's preset "
             "voices (alloy, ash, ballad, coral, echo, fable, nova, onyx, sage, shimmer, verse, marin, cedar) "
             "not aliased speak with the server's default voice",
    )
    parser.add_argument(
        "--open-listings", action="store_true",
        help="with a key, still answer GET /v1/models, /v1/audio/models and /v1/audio/voices without it "
             "(for front ends such as Open WebUI that list without credentials)",
    )
    parser.add_argument(
        "--allowed-hosts", action="append", default=[], metavar="NAME[,NAME...]",
        help="host names requests may give in their Host header besides localhost, 127.0.0.1, [::1] and the --host "
             "address (repeatable; * allows any). Other names get 403: a web page cannot reach the server by a name "
             "its site resolves to this machine (DNS rebinding)",
    )
    parser.add_argument(
        "--allowed-origins", action="append", default=[], metavar="ORIGIN[,ORIGIN...]",
        help="web pages of these origins may use the server, e.g. https://app.example (repeatable; * allows any; "
             "default none). A browser page of another site gets 403; the server's own pages always may",
    )
    parser.add_argument(
        "--log-requests", action="store_true",
        help="print a line per speech request to stderr: its x-request-id, the voice that spoke, the seed, the "
             "format, rate and speed sent, frames, audio seconds, time to first audio, total time, finish reason",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take")
    parser.add_argument("--body-timeout", type=float, default=30.0,
                        help="seconds a request body may take to arrive whole (then 408)")
    parser.add_argument("--stream-idle-timeout", type=float, default=30.0,
                        help="seconds a text stream waits for its start and each next message (then close code 4408)")
    parser.add_argument("--header-timeout", type=float, default=10.0,
                        help="seconds a request's headers may take to arrive whole (then 408 and the connection closes)")
    parser.add_argument("--max-input-chars", type=int, default=4096,
                        help="characters of input (and of instructions; a text stream's whole text) per request (then 413)")
    parser.add_argument("--max-body-mb", type=int, default=32, help="MiB a request body may hold, counted as it arrives (then 413)")
    parser.add_argument("--max-text-streams", type=int, default=4,
                        help="WebSocket text streams running at once (then close code 4429)")
    parser.add_argument("--no-prefix-cache", action="store_true", help="prefill every prompt whole")
    parser.add_argument(
        "--compile", action="store_true",
        help="compile the decode step (torch.compile: batch-size buckets, the first bucket's graph and one with its "
             "sizes symbolic for the others; a CUDA graph per bucket on a GPU)",
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=thread_count, default="auto", help=THREADS_HELP)


def add_demo(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="open the Gradio demo: direct a scene, hear it stream, revise the take")
    parser.add_argument(
        "--model", default=None,
        help="checkpoint folder or Hub repo (default: $DRAMA3_MODEL, else the bundled drama3-tiny)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--share", action="store_true", help="also open a temporary public gradio.live link")
    parser.add_argument("--max-batch", type=int, default=4, help="takes decoded together (more wait in the queue)")
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--adapter", action="append", default=[], metavar="NAME=PATH",
        help="offer a fine-tuned voice in the voice menus: a LoRA adapter folder as voice NAME (repeatable)",
    )


def add_eval(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval", help="does the model say the words? Whisper WER of espeak originals, codec resyntheses and outputs",
        description="Every voice speaks every held-out sentence; Whisper tiny.en (offline, the [eval] extra) "
                    "writes down what it hears in the espeak-ng original, its codec resynthesis and the model's "
                    "output. Prints a WER table per voice. Needs espeak-ng.",
    )
    parser.add_argument("--model", default=None, help="checkpoint folder or Hub repo (default: the bundled drama3-tiny)")
    parser.add_argument("--voice", default=None, help="bundled drama3-tiny voices to clone (default: all of them, A,B)")
    parser.add_argument("--sentences", type=int, default=None, help="speak only the first N held-out sentences (of 12)")
    parser.add_argument("--sentences-file", default=None, help="a UTF-8 file of sentences to speak instead, one per line")
    parser.add_argument("--seed", type=int, default=None, help="take i of each voice uses seed + i (default 0)")
    parser.add_argument("--seeds", default=None,
                        help="several seeds, e.g. 0,100,200: every sentence spoken once per seed, the WERs pooled "
                             "(the outputs are drawn; one seed's WER moves by several points)")
    add_option_flags(parser, EVAL_OPTIONS)
    parser.add_argument("--threads", type=thread_count, default="auto", help=THREADS_HELP + " (Whisper always uses one)")
    parser.add_argument("--json", default=None, help="also write the numbers and every take's words here")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    add_quant_argument(parser, "; compare with the same command without it")


EVAL_QUANTIZATIONS = WEIGHT_OPTIONS
"""`drama3 eval / say / serve --quant` choices: the schemes loaded on the fly."""


def add_offload_argument(parser, note: str = "") -> None:
    """`--offload-experts K`: the routed experts in CPU RAM, K of each layer cached on the device."""
    parser.add_argument(
        "--offload-experts", type=int, default=None, metavar="K",
        help="keep the routed experts in CPU RAM and K experts of each layer cached on the device (a GPU with less "
             "memory than the model; `drama3 plan` gives K for a card); not with --quant" + note,
    )


def add_quant_argument(parser, note: str = "") -> None:
    """`--quant`: load the weights quantised through transformers' quantisers (`loading.load_model_and_processor`)."""
    parser.add_argument(
        "--quant", choices=EVAL_QUANTIZATIONS, default=None,
        help="load the weights quantised (routed experts and the backbone's dense projections): torchao int8 / "
             "int4, bitsandbytes nf4 / 8-bit (the [quant] extra; `drama3 plan` says what fits)" + note,
    )

PLAN_QUANTIZATIONS = PLAN_OPTIONS
"""`drama3 plan --quant` choices: the schemes a plan is made for."""


def positive_number(value: str) -> float:
    """`--gpu-gb`: a positive finite number."""
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not (number > 0 and number != float("inf")):
        raise argparse.ArgumentTypeError(f"{value!r}: expected a positive number")
    return number


def positive_count(value: str) -> int:
    """`--streams`, `--context`: a positive whole number."""
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a positive whole number")
    return count


def add_plan(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan", help="GPU memory of each part of a model under each quantisation, and what fits (from its config alone)",
        description="Builds the model on the meta device from its config.json (no weight is read) and prints the "
                    "GiB of the routed experts, the dense backbone, the tower, the embeddings and head, the decode "
                    "state of --streams streams of --context rows, the codec, and a prefill's transients and a workspace "
                    "allowance, for each option; with --gpu-gb, "
                    "whether each fits the card less 10%% headroom, and what fits (a smaller option, or the routed "
                    "experts offloaded to CPU RAM with a GPU cache of hot experts). Exits 1 when --quant (or, "
                    "without it, every option) does not fit.",
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL,
        help=f"checkpoint folder, or a Hub repo whose config.json is in the local Hugging Face cache (default "
             f"{DEFAULT_MODEL}: the published shape this package knows when it is not cached)",
    )
    parser.add_argument("--quant", choices=PLAN_QUANTIZATIONS, default=None,
                        help="plan this option only (default: every option, most faithful first)")
    parser.add_argument("--gpu-gb", type=positive_number, default=None,
                        help="the GPU's memory in GiB (a 24 GB card: 24); without it no fit is judged")
    parser.add_argument("--streams", type=positive_count, default=1, help="streams decoded together (default 1)")
    parser.add_argument("--context", type=positive_count, default=4096,
                        help="rows each stream's decode cache holds: prompt, references and frames (default 4096)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="compute dtype of what is not quantised (default bfloat16)")
    parser.add_argument("--prefill-rows", type=positive_count, default=512,
                        help="rows prefilled at once over every stream: the prefill's transients (the expert "
                             "buffers) are planned for them (default 512, drama3 serve's prefill chunk on a "
                             "GPU; generate() of B prompts of P rows prefills B x P)")


SUBCOMMANDS = [add_say, add_table, add_serve, add_demo, add_eval, add_plan]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="drama3", description="Fish Audio Drama 3 text-to-speech")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser
