"""Speed and memory of the full-size S2 codec on this CPU (random weights).

    PYTHONPATH=src python benchmarks/codec.py [--seconds 10] [--memory-seconds 2.5 5] [--threads N]

Prints, for `--seconds` of noise at 44.1 kHz:
  - encode and decode real-time factors (RTF = compute time / audio duration; below 1 is faster
    than real time), offline (one call) and streaming (encoder fed `--encode-chunk-frames`
    frames per push, decoder fed the serving windows 10, 10, 12, 32, 64, ... frames), plus the
    streaming decoder's time to first audio;
  - peak resident memory above the loaded model for each case, and for offline calls on
    `--memory-seconds` as well, to show how it grows with duration (offline: linearly;
    streaming: flat).
Each case runs in a fresh process (after a one-frame warm-up) so its peak memory is its own.
Prints only; asserts nothing. With the defaults it takes a few minutes on 2 cores (~10 s of
compute per second of audio, encode + decode, on a contended 2-core machine).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _read_status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process; False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def _measure(run):
    """Run `run()`; return (seconds, peak RSS above the RSS before it in MiB, or None)."""
    can_reset = _reset_peak()
    before = _read_status_kib("VmRSS")
    start = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - start
    peak = (_read_status_kib("VmHWM") - before) / 1024 if can_reset else None
    return result, seconds, peak


def child(model_dir: str, mode: str, seconds: float, encode_chunk_frames: int) -> None:
    """One measured case, in its own process; prints one JSON line."""
    import torch

    from transformers_drama3.codec import Drama3CodecModel
    from transformers_drama3.codec.streaming import stream_decode_windows

    codec = Drama3CodecModel.from_pretrained(model_dir).eval()
    audio = torch.randn(1, int(seconds * codec.sampling_rate), generator=torch.Generator().manual_seed(0)) * 0.1
    report = {"mode": mode, "seconds": seconds}
    # Warm up: page in the memory-mapped weights and let torch pick its kernels before measuring.
    codec.decode(codec.encode(audio[:, : codec.hop_length], sampling_rate=codec.sampling_rate).audio_codes)

    if mode == "offline":
        codes, report["encode_s"], report["encode_peak_mib"] = _measure(
            lambda: codec.encode(audio, sampling_rate=codec.sampling_rate).audio_codes
        )
        _, report["decode_s"], report["decode_peak_mib"] = _measure(lambda: codec.decode(codes).audio_values)
    else:

        def encode_stream():
            stream = codec.streaming_encoder()
            step = encode_chunk_frames * codec.hop_length
            pieces = [stream.push(audio[:, i : i + step]) for i in range(0, audio.shape[-1], step)]
            return torch.cat([*pieces, stream.flush()], dim=-1)

        def decode_stream():
            stream = codec.streaming_decoder()
            first_audio, start, frame = None, time.perf_counter(), 0
            for window in stream_decode_windows():
                if frame >= codes.shape[-1]:
                    break
                stream.push(codes[..., frame : frame + window])
                frame += window
                first_audio = first_audio or time.perf_counter() - start
            stream.flush()
            return first_audio

        # Weight norm computed once per stream, not once per push (see streaming.py).
        with torch.nn.utils.parametrize.cached():
            codes, report["encode_s"], report["encode_peak_mib"] = _measure(encode_stream)
            report["first_audio_s"], report["decode_s"], report["decode_peak_mib"] = _measure(decode_stream)
    print(json.dumps(report), flush=True)


def run_case(model_dir, mode, seconds, arguments) -> dict:
    command = [sys.executable, __file__, "--child", model_dir, mode, str(seconds)]
    command += ["--encode-chunk-frames", str(arguments.encode_chunk_frames), "--threads", str(arguments.threads)]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def build_random_codec(directory: str) -> None:
    import torch

    from transformers_drama3.codec import Drama3CodecConfig, Drama3CodecModel

    torch.manual_seed(0)
    Drama3CodecModel(Drama3CodecConfig()).save_pretrained(directory)


def _fmt(value, unit="") -> str:
    return "n/a" if value is None else f"{value:.2f}{unit}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="audio duration for the RTF cases")
    parser.add_argument("--memory-seconds", type=float, nargs="*", default=[2.5, 5.0], help="extra offline durations")
    parser.add_argument("--encode-chunk-frames", type=int, default=8, help="frames per streaming encoder push")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch CPU threads")
    parser.add_argument("--child", nargs=3, metavar=("MODEL_DIR", "MODE", "SECONDS"), help=argparse.SUPPRESS)
    arguments = parser.parse_args()

    import torch

    torch.set_num_threads(arguments.threads)
    if arguments.child:
        model_dir, mode, seconds = arguments.child
        child(model_dir, mode, float(seconds), arguments.encode_chunk_frames)
        return

    print(f"S2 codec, full size, random weights, float32, {arguments.threads} CPU threads, torch {torch.__version__}")
    cases = [("offline", arguments.seconds), ("streaming", arguments.seconds)]
    cases += [("offline", s) for s in arguments.memory_seconds if s != arguments.seconds]
    cases += [("streaming", min(arguments.memory_seconds))] if arguments.memory_seconds else []
    with tempfile.TemporaryDirectory() as model_dir:
        started = time.perf_counter()
        build_random_codec(model_dir)
        print(f"built and saved the random codec in {time.perf_counter() - started:.1f} s")
        header = f"{'mode':<10}{'audio s':>8}{'enc s':>9}{'enc RTF':>9}{'dec s':>9}{'dec RTF':>9}{'1st audio s':>13}{'enc peak MiB':>14}{'dec peak MiB':>14}"
        print(header)
        for mode, seconds in cases:
            r = run_case(model_dir, mode, seconds, arguments)
            print(
                f"{mode:<10}{seconds:>8.1f}{r['encode_s']:>9.2f}{r['encode_s'] / seconds:>9.2f}"
                f"{r['decode_s']:>9.2f}{r['decode_s'] / seconds:>9.2f}{_fmt(r.get('first_audio_s')):>13}"
                f"{_fmt(r['encode_peak_mib']):>14}{_fmt(r['decode_peak_mib']):>14}",
                flush=True,
            )
    print("RTF = compute seconds / audio seconds (lower is faster). Peak MiB = peak RSS above the loaded model.")


if __name__ == "__main__":
    main()
