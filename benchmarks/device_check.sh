#!/usr/bin/env bash
# The one prepared check for a GPU machine (one H200): the full-depth decode benchmark (block-FP8
# experts as published, then bf16 experts; batches 1 and 32 first, the issue's two targets, then 8
# and 64; compiled, then eager), the CUDA tests, and the served published model's concurrent
# real-time streams. Each part is bounded by `timeout` so the whole takes at most about 9 minutes;
# a part cut short keeps what it printed and wrote. The bf16 experts alone are 60 GiB: on an
# 80 GB H100 gpu.py leaves out the batch sizes that do not fit (a "NOT MEASURED" line each); ask
# for the H200 where one is lent.
#
# On the GPU machine, from the repository root (the wheels the project needs in .device-kit/):
#     source .device-kit/env.sh && bash benchmarks/device_check.sh
#
# Everything printed goes to "$OUT/log.txt" (OUT: the folder whose files come back; ./device-check
# when unset), the benchmarks' numbers to "$OUT/gpu_bf16.json" and "$OUT/gpu_fp8.json". The end
# of the log repeats every "skipping cudagraphs" line torch printed and every "NOT CAPTURED" line of
# the benchmark (a CUDA graph torch did not capture), and each part's exit status (124: time limit).
set -u
OUT=${OUT:-device-check}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
cd "$(dirname "$0")/.."
started=$(date +%s)
statuses=()

part() {  # part NAME SECONDS COMMAND...: run COMMAND bounded by SECONDS, note its exit status
  local name=$1 seconds=$2
  shift 2
  echo "=== $name (at most ${seconds} s; $(( $(date +%s) - started )) s so far)"
  timeout -k 10 "$seconds" "$@"
  local status=$?
  statuses+=("$name: $status")
  echo "=== $name: exit $status"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__)"

# 1. The published model at all 40 layers: FP8 experts, then bf16 experts (a new process each);
#    per batch size compiled first, then eager (seconds). inductor took minutes per compile even at
#    4 and 8 layers: batch 1 compiles a graph of its shapes, batch 32 one with the batch size
#    symbolic, which batches 8 and 64 run (automatic dynamic shapes: no compile, a CUDA graph each).
part "gpu.py fp8" 220 python3 benchmarks/gpu.py --experts fp8 --batches 1 32 8 64 --modes compiled eager \
  --frames 40 --json "$OUT/gpu_fp8.json"
part "gpu.py bf16" 150 python3 benchmarks/gpu.py --experts bf16 --batches 1 32 8 64 --modes compiled eager \
  --frames 40 --json "$OUT/gpu_bf16.json"

# 2. The CUDA tests: in every test file that asks for CUDA, the tests marked gpu or skipped without CUDA.
plugin=$(mktemp -d)
cat > "$plugin/cuda_tests_only.py" <<'PLUGIN'
def _needs_cuda(item):
    if item.get_closest_marker("gpu") is not None:
        return True
    return any("cuda" in str(mark.kwargs.get("reason", "")).lower() for mark in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config, items):
    deselected = [item for item in items if not _needs_cuda(item)]
    items[:] = [item for item in items if _needs_cuda(item)]
    config.hook.pytest_deselected(items=deselected)
PLUGIN
mapfile -t cuda_files < <(grep -l "cuda.is_available" tests/test_*.py)
PYTHONPATH="$plugin:${PYTHONPATH:-}" part "CUDA tests" 80 python3 -m pytest -q -rs -m "not slow" -p cuda_tests_only \
  --maxfail 10 "${cuda_files[@]}"

# 3. The served model (published shape, 40 layers, random weights, eager engine): 1, 2, 4, ... 32
#    streams at once, how many ran faster than real time, time to first audio p50 / p95.
part "serve_load.py realtime" 90 python3 benchmarks/serve_load.py --random-model published --layers 40 --device cuda \
  --realtime --clients 32 --max-batch 32 --frames 32 --time-limit 20

echo "=== summary ($(( $(date +%s) - started )) s)"
printf '  %s\n' "${statuses[@]}"
echo "--- skipping cudagraphs / NOT CAPTURED lines:"
grep -a -e "skipping cudagraphs" -e "NOT CAPTURED" "$OUT/log.txt" | grep -v -e "^--- skipping" || echo "  none"
