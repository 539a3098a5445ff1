"""Every Triton kernel of the package compiled ahead of time for a GPU, on a machine without one.

    python tests/triton_targets.py --arch 90 --json kernels.json     # sm_90: H100 / H200

Each kernel is launched the way the package launches it: the public launchers
(`fused_step.*_triton`, `fp8_expert_gemm.fp8_experts_triton_rows` / `_tiles`,
`recurrent_decode.gated_delta_rule_decode_triton`, `short_conv.short_conv_update_triton`) run on
`meta` tensors of the published model's shapes (no memory, no data), with every kernel object of
their modules replaced by a recorder that keeps the launch's arguments instead of running it. Each
recorded launch is then specialised as Triton's launcher specialises it (argument types, 16-byte
divisibility, integers equal to 1 made constant) and compiled by `triton.compile` for
`GPUTarget("cuda", arch, 32)` once per autotuning config, through ptxas (which ships in the triton
wheel). The JSON lists, per compiled variant: kernel, config, launch, shared memory bytes, and
the type of every pointer offset in its Triton IR that depends on the program id (a row index:
32-bit offsets overflow past 2^31 elements).

Kernels are only defined where Triton can run them, or with `DRAMA3_TRITON_KERNELS=1`
(`fused_step.kernels_wanted`), which this script needs; and without Triton's interpreter, whose
`triton.jit` functions are interpreted ones that nothing can compile. The test runs it in a process
of its own for both.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field

SM90_SHARED_MEMORY = 227 * 1024
"""The most shared memory one block may use on sm_90 (H100 / H200): 227 KiB."""


@dataclass
class Launch:
    """One recorded kernel launch: `kernel` is the module's kernel object (an autotuner or a
    `triton.jit` function), `arguments` its arguments by name, `variant` what the launch stands for."""

    module: str
    name: str
    kernel: object
    arguments: dict
    variant: str


@dataclass
class Compiled:
    kernel: str
    variant: str
    config: str
    shared_bytes: int
    seconds: float
    row_offsets: list[str] = field(default_factory=list)
    """The types of the pointer offsets (`tt.addptr` operands) that depend on the program id."""
    error: str | None = None


class Recorder:
    """Stands in for a kernel object: `recorder[grid](*args, **kwargs)` records the launch."""

    def __init__(self, module: str, name: str, kernel, launches: list, variant: list):
        self.module, self.name, self.kernel, self.launches, self.variant = module, name, kernel, launches, variant

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            function = jit_function(self.kernel)
            arguments = dict(zip(function.arg_names, args))
            arguments.update(kwargs)
            self.launches.append(Launch(self.module, self.name, self.kernel, arguments, self.variant[0]))

        return launch


def jit_function(kernel):
    """The `triton.jit` function under an autotuner (or the function itself)."""
    return kernel.fn if hasattr(kernel, "configs") else kernel


def kernel_modules():
    """The package's kernel modules, with their kernels defined (see the module docstring)."""
    from transformers_drama3.kernels import fp8_expert_gemm, fused_step, recurrent_decode, short_conv

    for module in (fp8_expert_gemm, fused_step, recurrent_decode, short_conv):
        if module.triton is None:
            raise SystemExit(f"{module.__name__}: no kernels defined; install the [gpu] extra and set "
                             f"{fused_step.TRITON_KERNELS_ENV}=1")
    return fused_step, fp8_expert_gemm, recurrent_decode, short_conv


def published_shapes() -> dict:
    """The published model's sizes the kernels see (`planning.published_config`)."""
    from transformers_drama3.placement.planning import FP8_BLOCK, published_config

    config = published_config()
    text, tower = config.text_config, config.audio_decoder_config
    return dict(
        hidden=text.hidden_size, vocab=text.vocab_size, experts=text.num_experts, top_k=text.num_experts_per_tok,
        intermediate=text.moe_intermediate_size, key_heads=text.linear_num_key_heads,
        value_heads=text.linear_num_value_heads, key_dim=text.linear_key_head_dim, value_dim=text.linear_value_head_dim,
        conv_width=text.linear_conv_kernel_dim, codebooks=tower.num_codebooks, codebook_size=tower.vocab_size,
        backbone_codebooks=tower.vq_backbone_codebooks, tower_dim=tower.dim, block=FP8_BLOCK,
        semantic_start=config.semantic_start_token_id, semantic_end=config.semantic_end_token_id,
    )


def record_launches() -> tuple[list[tuple[str, str]], list[Launch]]:
    """(every kernel the kernel modules define, as (module, name); every launch the package makes
    at the published shapes, one per variant that compiles differently: constexpr values, tile
    sizes; decode rows and prefills, bf16)."""
    import torch

    fused_step, fp8_expert_gemm, recurrent_decode, short_conv = kernel_modules()
    shapes = published_shapes()
    defined, launches, variant = [], [], ["?"]
    for module in (fused_step, fp8_expert_gemm, recurrent_decode, short_conv):
        for name in dir(module):
            kernel = getattr(module, name)
            if name.startswith("_") and name.endswith("_kernel") and hasattr(jit_function(kernel), "arg_names"):
                short = module.__name__.rpartition(".")[2]
                defined.append((short, name))
                setattr(module, name, Recorder(short, name, kernel, launches, variant))

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device="meta")

    def ids(*shape):
        return meta(*shape, dtype=torch.long)

    dim = shapes["hidden"]
    rows = 64  # a batch of decode rows; the kernels' constants do not depend on the row count
    variant[0] = "decode rows"
    fused_step.partial_codebook_fusion_triton(
        meta(shapes["vocab"], dim), meta(shapes["codebooks"] * shapes["codebook_size"], dim), ids(rows, 1),
        ids(rows, 1, shapes["backbone_codebooks"]), shapes["semantic_start"], shapes["semantic_end"],
        shapes["codebook_size"])
    tower = shapes["tower_dim"]
    for extra in (meta(rows, 1, tower), None):
        variant[0] = "with extra" if extra is not None else "without extra"
        fused_step.tower_injection_triton(meta(shapes["codebook_size"], tower), ids(rows, 1), meta(rows, 1, 1), extra,
                                          meta(rows, 1, tower), meta(tower), meta(tower), 1e-6)
    for keep_crossing in (False, True):
        variant[0] = "codebook heads" if not keep_crossing else "main token (keep crossing)"
        fused_step.filtered_race_triton(meta(rows, shapes["codebook_size"]), meta(rows, shapes["codebook_size"],
                                        dtype=torch.float32), 1.0, 30, 0.9, keep_crossing)

    experts, top_k, intermediate, block = shapes["experts"], shapes["top_k"], shapes["intermediate"], shapes["block"]
    fp8 = torch.float8_e4m3fn
    weights = (meta(experts, 2 * intermediate, dim, dtype=fp8),
               meta(experts, 2 * -(-intermediate // block[0]), -(-dim // block[1]), dtype=torch.float32),
               meta(experts, dim, intermediate, dtype=fp8),
               meta(experts, -(-dim // block[0]), -(-intermediate // block[1]), dtype=torch.float32))
    variant[0] = "rows layout (a decode step)"
    fp8_expert_gemm.fp8_experts_triton_rows(meta(16, dim), ids(16, top_k), meta(16, top_k), *weights, block)
    # the tiles layout's BLOCK_M follows the rows an expert gets: 16, 32, 64 rows a tile
    for tokens in (512, 1024, 4096):
        block_m = fp8_expert_gemm.rows_per_tile(tokens * top_k, experts)
        variant[0] = f"tiles layout, {tokens}-row prefill (BLOCK_M {block_m})"
        fp8_expert_gemm.fp8_experts_triton_tiles(meta(tokens, dim), ids(tokens, top_k), meta(tokens, top_k), *weights, block)

    heads, value_heads, key_dim, value_dim = shapes["key_heads"], shapes["value_heads"], shapes["key_dim"], shapes["value_dim"]
    batch = 8
    for state in (meta(batch, value_heads, key_dim, value_dim, dtype=torch.float32), None):
        variant[0] = "with a state" if state is not None else "from zeros"
        recurrent_decode.gated_delta_rule_decode_triton(
            meta(batch, 1, heads, key_dim), meta(batch, 1, heads, key_dim), meta(batch, 1, value_heads, value_dim),
            meta(batch, 1, value_heads, dtype=torch.float32), meta(batch, 1, value_heads), state, True)
    channels = 2 * heads * key_dim + value_heads * value_dim
    variant[0] = "decode row, SiLU, no bias"
    short_conv.short_conv_update_triton(meta(batch, channels, 1), meta(batch, channels, shapes["conv_width"] - 1),
                                        meta(channels, shapes["conv_width"]), None, "silu")
    return defined, launches


def specialised(function, arguments: dict, config_kwargs: dict):
    """(signature, constexprs, attrs) of a launch, as Triton's launcher specialises its arguments."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    values = {**arguments, **config_kwargs}
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(function.arg_names):
        parameter = function.params[index]
        value = values[name]
        if parameter.is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
            continue
        kind, specialisation = native_specialize_impl(BaseBackend, value, False, not parameter.do_not_specialize, True)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = specialisation
        elif specialisation:
            attrs[(index,)] = BaseBackend.parse_attr(specialisation)
    return signature, constexprs, attrs


OFFSET = re.compile(r"tt\.addptr\s+(%[\w#]+),\s*(%[\w#]+)\s*:\s*[^,]+,\s*(.+)$")
DEFINITION = re.compile(r"^\s*(%[\w#:]+)(?:\s*,\s*%[\w#:]+)*\s*=\s*(.*)$")


def row_offset_types(ttir: str) -> list[str]:
    """The types of the `tt.addptr` offsets of `ttir` that depend on `tt.get_program_id`: a
    forward pass marking every value computed from a marked one."""
    marked: set[str] = set()
    types = []
    for line in ttir.splitlines():
        definition = DEFINITION.match(line)
        body = definition.group(2) if definition else line
        operands = set(re.findall(r"%[\w#]+", body))
        depends = "tt.get_program_id" in body or bool(operands & marked)
        if definition and depends:
            marked.add(definition.group(1).split(":")[0])
        offset = OFFSET.search(line)
        if offset and offset.group(2) in marked:
            types.append(re.sub(r"\s*loc\(.*\)$", "", offset.group(3)).strip())
    return types


def compile_launch(launch: Launch, arch: int) -> list[Compiled]:
    """`launch` compiled for sm_`arch` once per autotuning config (one without an autotuner)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    function = jit_function(launch.kernel)
    configs = getattr(launch.kernel, "configs", None) or [None]
    compiled = []
    for config in configs:
        kwargs = dict(config.kwargs) if config is not None else {}
        options = {}
        if config is not None:
            options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        else:
            options = {key: launch.arguments[key] for key in ("num_warps", "num_stages") if key in launch.arguments}
        label = ", ".join(f"{key}={value}" for key, value in {**kwargs, **options}.items()) or "default"
        started = time.perf_counter()
        try:
            signature, constexprs, attrs = specialised(function, launch.arguments, kwargs)
            kernel = triton.compile(ASTSource(function, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                                    options=options)
            compiled.append(Compiled(f"{launch.module}.{launch.name}", launch.variant, label, kernel.metadata.shared,
                                     time.perf_counter() - started, row_offset_types(kernel.asm["ttir"])))
        except Exception as error:  # reported, not raised: the test names every variant that fails
            compiled.append(Compiled(f"{launch.module}.{launch.name}", launch.variant, label, -1,
                                     time.perf_counter() - started, error=f"{type(error).__name__}: {error}"))
    return compiled


_LAUNCHES: list[Launch] = []


def _compile_one(job: tuple[int, int]) -> list[Compiled]:
    index, arch = job
    return compile_launch(_LAUNCHES[index], arch)


def compiled_in_parallel(launches: list[Launch], arch: int, workers: int) -> list[list[Compiled]]:
    """`compile_launch` of each launch, in `workers` forked processes (each compile is a
    single-threaded pass and a ptxas run: the cores divide the time)."""
    if workers <= 1:
        return [compile_launch(launch, arch) for launch in launches]
    import multiprocessing

    _LAUNCHES[:] = launches  # the forked workers inherit the kernel objects, which do not pickle
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return pool.map(_compile_one, [(index, arch) for index in range(len(launches))], chunksize=1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="the CUDA compute capability, e.g. 90 (sm_90)")
    parser.add_argument("--json", required=True, help="where to write the compiled variants")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                        help="processes compiling at once (default: the cores, at most 4)")
    arguments = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("run without TRITON_INTERPRET: interpreted kernels cannot be compiled")
    defined, launches = record_launches()
    results, summary = [], []
    for launch, compiled in zip(launches, compiled_in_parallel(launches, arguments.arch, arguments.workers)):
        results += compiled
        summary.append({"kernel": f"{launch.module}.{launch.name}", "variant": launch.variant,
                        "configs": len(getattr(launch.kernel, "configs", None) or [None]),
                        "compiled": sum(result.error is None for result in compiled)})
    with open(arguments.json, "w", encoding="utf-8") as writer:
        json.dump({"arch": arguments.arch, "kernels": defined, "launches": summary,
                   "variants": [asdict(result) for result in results]}, writer, indent=1)
    for result in results:
        status = result.error or f"{result.shared_bytes / 1024:.1f} KiB shared, {result.seconds:.1f} s"
        print(f"{result.kernel} [{result.variant}; {result.config}]: {status}", file=sys.stderr)


if __name__ == "__main__":
    main()
