"""Loading a Drama 3 model for a command, and the error a user can fix.

    model, processor = load_model_and_processor("fishaudio/drama-3", device="auto", dtype="auto")

Shared by the `drama3` command (cli.py) and the scripts beside the package (the drama3-tiny
recipe's evaluation), so neither imports the other. A `CommandError` is printed as one message,
without a traceback, and the command exits with `EXIT_USAGE`.
"""

from __future__ import annotations

import contextlib
import os

import torch
from transformers.utils import logging as hf_logging

from .command_line import DEFAULT_MODEL, EXIT_USAGE  # noqa: F401  (the command line's, one source)
from ..checkpoint.quantization.quantized_loading import QuantizationRefused, quantization_config_for
from ..configuration_drama3 import Drama3Config
from ..modeling_drama3 import Drama3ForSpeechGeneration
from ..layers.offloaded_experts import offload_experts
from ..processing_drama3 import Drama3Processor


class CommandError(Exception):
    """An error the user can fix; printed as one message, without a traceback; the command exits
    with `exit_code` (`EXIT_USAGE` unless the error says otherwise)."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE):
        super().__init__(message)
        self.exit_code = exit_code


def load_model_and_processor(source: str, device: str, dtype: str, progress: bool = True, quant: str | None = None,
                             offload: int | None = None):
    """The model and processor (with its codec) from a folder or a Hub repo id; a CommandError
    naming `source` (or `--device` / `--dtype` / `--quant`) when there is none or it cannot be used.
    Without `progress`, transformers' loading bars stay quiet. `quant`: one of
    `checkpoint.quantization.WEIGHT_OPTIONS` (int8, int4, nf4, bnb-int8) to load the weights
    quantised (`quantization_config_for`), placed on `device` as they load. `offload`
    (`--offload-experts K`): the routed experts kept in CPU RAM with K of each layer cached on
    `device` (`offload.offload_experts`); not with `quant`."""
    if offload is not None and (isinstance(offload, bool) or not isinstance(offload, int) or offload < 1):
        raise CommandError(f"--offload-experts {offload}: expected a whole number of experts per layer, at least 1")
    if offload is not None and quant is not None:
        raise CommandError(f"--offload-experts with --quant {quant}: the offloaded experts are the unquantised ones; "
                           "drop one of them (drama3 plan says what fits)")
    if os.path.isdir(source) and not os.path.isfile(os.path.join(source, "config.json")):
        raise CommandError(f"--model {source}: the folder has no config.json; expected a Drama 3 checkpoint folder")
    looks_like_repo_id = source.count("/") == 1 and not source.startswith((".", "/", "~"))
    if not os.path.isdir(source) and not looks_like_repo_id:
        raise CommandError(_missing_model_message(source, "no such folder"))
    device = resolve_device(device)
    dtypes = {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32,
              "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise CommandError(f"--dtype {dtype}: expected one of {', '.join(dtypes)}")
    try:
        with _progress_bars(progress):
            if offload is not None:  # loaded in CPU RAM, then all but the routed experts moved to the device
                model = offload_experts(Drama3ForSpeechGeneration.from_pretrained(source, dtype=dtypes[dtype]).eval(),
                                        cache_experts=offload, device=device)
            elif quant is None:
                model = Drama3ForSpeechGeneration.from_pretrained(source, dtype=dtypes[dtype]).to(device).eval()
            else:
                model = _load_quantized(source, device, dtypes[dtype], quant)
            processor = Drama3Processor.from_pretrained(source)
    except QuantizationRefused as error:
        raise CommandError(f"--quant {quant}: {error}") from None
    except (OSError, ValueError) as error:
        if os.path.isdir(source):  # found the folder: what failed is its content, say that
            raise CommandError(f"--model {source}: {error}") from None
        # OSError: not found locally nor on the Hub (or offline); ValueError: not a valid repo id
        raise CommandError(_missing_model_message(source, str(error).splitlines()[0])) from None
    if processor.codec is None:
        raise CommandError(
            f"--model {source}: found the model but no codec (looked for codec/ and codec.pth beside it); "
            f"download the full checkpoint folder"
        )
    processor.codec.to(device)
    return model, processor


def _load_quantized(source: str, device: str, dtype: torch.dtype, quant: str):
    """The model with its weights quantised under `quant` as they load, on `device`."""
    config = Drama3Config.from_pretrained(source)
    quantization_config = quantization_config_for(quant, config, device=device, dtype=dtype)
    return Drama3ForSpeechGeneration.from_pretrained(
        source, dtype=dtype, quantization_config=quantization_config, device_map={"": device}
    ).eval()


@contextlib.contextmanager
def _progress_bars(shown: bool):
    """transformers' progress bars on or off inside the block, as they were after it."""
    was_shown = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if shown else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was_shown else hf_logging.disable_progress_bar)()


def resolve_device(device: str) -> str:
    """`--device` as a torch device string ("auto": cuda when available, else cpu), or a
    CommandError when it is malformed or names hardware this machine lacks."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise CommandError(f"--device {device}: not a device; expected cpu, cuda, cuda:N, mps or auto") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise CommandError(f"--device {device}: this machine has no CUDA GPU (torch sees none); use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise CommandError(f"--device {device}: there are only {torch.cuda.device_count()} CUDA device(s)")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise CommandError(f"--device {device}: MPS is not available on this machine; use --device cpu")
    elif parsed.type not in ("cpu", "cuda", "mps"):
        raise CommandError(f"--device {device}: expected cpu, cuda, cuda:N, mps or auto")
    return str(parsed)


def _missing_model_message(source: str, reason: str) -> str:
    return (
        f"no Drama 3 model at {source!r} ({reason}).\n"
        f"Looked for a local folder with config.json, then the Hugging Face Hub repo {source!r}.\n"
        f"Get the published model with:  huggingface-cli download {DEFAULT_MODEL} --local-dir drama-3\n"
        f"then run with --model drama-3 (or pass --model PATH to your own checkpoint folder)."
    )
