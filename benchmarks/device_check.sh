#!/usr/bin/env bash
# The one prepared check for a GPU machine, inside 9 minutes (DEVICE_CHECK_SECONDS, default 540):
#
#   0. the versions it runs on (Python, torch, CUDA, triton, transformers, the GPU), before anything;
#   1. a smoke part of at most 2 minutes: benchmarks/gpu.py at 4 layers of the published width,
#      FP8 experts, batch 1, compiled (every CUDA graph captured, asserted: gpu.py exits 1 naming
#      a graph that is not) then eager, with the profiled step's kernels listed by name. If it
#      fails, nothing else runs: a check that cannot capture 4 layers learns nothing at 40;
#   2. the full-depth parts, planned from what the smoke part measured (benchmarks/device_budget.py:
#      start, build, compile and run times scaled to 40 layers), most wanted first: gpu.py with FP8
#      experts (batch 1, then 32, 8, 64, as many as fit), the CUDA tests, the served published
#      model's concurrent real-time streams, gpu.py with bf16 experts. Each part is bounded by its
#      limit and by the time left; a part whose estimate no longer fits is skipped, named.
#
# On the GPU machine, from the repository root (the wheels the project needs in .device-kit/):
#     source .device-kit/env.sh && bash benchmarks/device_check.sh
# On a CPU, the same parts at a tiny width (gpu.py --dry-run; the structure is what is checked):
#     bash benchmarks/device_check.sh --dry-run
#
# Everything printed goes to "$OUT/log.txt" as it is printed (OUT: the folder whose files come back;
# ./device-check when unset); gpu.py rewrites "$OUT/smoke.json", "$OUT/gpu_fp8.json" and
# "$OUT/gpu_bf16.json" after every row it measures, so a part cut short keeps its rows. The end of
# the log repeats every "skipping cudagraphs" line torch printed, every "NOT CAPTURED" line of the
# benchmark, and each part's exit status (124: its time limit).
set -u
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
  DRY_RUN=1
elif [ $# -gt 0 ]; then
  echo "usage: bash benchmarks/device_check.sh [--dry-run]" >&2
  exit 2
fi
OUT=${OUT:-device-check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee -a "$OUT/log.txt") 2>&1
cd "$(dirname "$0")/.."
LIMIT=${DEVICE_CHECK_SECONDS:-540}
RESERVE=10  # the summary at the end
SMOKE_SECONDS=120
started=$(date +%s)
statuses=()

elapsed() { echo $(( $(date +%s) - started )); }

run_part() {  # run_part NAME SECONDS COMMAND...: run COMMAND bounded by SECONDS, note its exit status
  local name=$1 seconds=$2
  shift 2
  echo "=== $name (at most ${seconds} s; $(elapsed) s so far)"
  local part_started
  part_started=$(date +%s)
  timeout -k 10 "$seconds" "$@"
  local status=$?
  part_wall=$(( $(date +%s) - part_started ))
  statuses+=("$name: exit $status, ${part_wall} s")
  echo "=== $name: exit $status after ${part_wall} s"
  return $status
}

part() {  # part NAME ESTIMATE LIMIT COMMAND...: as run_part, unless fewer than ESTIMATE seconds are left
  local name=$1 estimate=$2 limit=$3
  shift 3
  local left=$(( LIMIT - RESERVE - $(elapsed) ))
  if [ "$left" -lt "$estimate" ]; then
    echo "=== $name: skipped (needs about ${estimate} s, ${left} s left)"
    statuses+=("$name: skipped (needs about ${estimate} s, ${left} s left)")
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  run_part "$name" "$limit" "$@"
}

skip() {  # skip NAME WHY: a part the plan left out
  echo "=== $1: skipped ($2)"
  statuses+=("$1: skipped ($2)")
}

summary() {
  echo "=== summary ($(elapsed) s of ${LIMIT})"
  printf '  %s\n' "${statuses[@]}"
  echo "--- skipping cudagraphs / NOT CAPTURED lines:"
  grep -a -e "skipping cudagraphs" -e "NOT CAPTURED" "$OUT/log.txt" | grep -v -e "^--- skipping" || echo "  none"
}

# 0. The versions, before anything else.
python3 -c "import platform, sys, torch; print('python', platform.python_version(), '| torch', torch.__version__, \
'| cuda', torch.version.cuda)"
python3 -c "import triton; print('triton', triton.__version__)" 2>/dev/null || echo "triton: not installed"
python3 -c "import transformers; print('transformers', transformers.__version__)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "GPU: none (nvidia-smi)"

# 1. The smoke part: 4 layers, batch 1, compiled (capture asserted) and eager, kernels listed.
dry=()
# on a CPU the smoke part's compile (dynamo and AOT autograd, single-threaded) takes longer than 2 minutes may
[ "$DRY_RUN" -eq 1 ] && dry=(--dry-run) && SMOKE_SECONDS=300
if ! run_part "smoke: gpu.py fp8 (4 layers)" "$SMOKE_SECONDS" python3 benchmarks/gpu.py --experts fp8 --layers 4 \
    --batches 1 --modes compiled eager --frames 12 --prompt-rows 32 --list-kernels --json "$OUT/smoke.json" "${dry[@]}"; then
  echo "=== the smoke part failed: the full-depth parts are not run"
  summary
  exit 1
fi

# 2. The full-depth parts, planned from the smoke part's measurements.
plan_args=(--smoke "$OUT/smoke.json" --smoke-wall "$part_wall" --left $(( LIMIT - RESERVE - $(elapsed) )) --out "$OUT")
[ "$DRY_RUN" -eq 1 ] && plan_args+=(--dry-run)
if ! plan=$(python3 benchmarks/device_budget.py "${plan_args[@]}"); then
  echo "=== no plan could be made from the smoke part"
  summary
  exit 1
fi
echo "$plan" | tee "$OUT/plan.txt"

# The CUDA tests part runs, in every test file that asks for CUDA, the tests marked gpu or skipped without CUDA.
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
export PYTHONPATH="$plugin:${PYTHONPATH:-}"

while IFS= read -r line; do
  case "$line" in
    part\ *|skip\ *) eval "$line" ;;
  esac
done <<< "$plan"

summary
