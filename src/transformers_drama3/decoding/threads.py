"""How many CPU threads a decode uses: chosen from the model's size, the cores and their load.

A decode step on the CPU is hundreds of small matrix products and thousands of small ops. Splitting
an op over threads pays only when the op is large: below a few hundred megabytes of weights per
frame the threads spend the step waiting for each other, and when another process holds a core,
a thread scheduled behind it stalls every op of the step (the barrier at the end of each parallel
op waits for the slowest thread), which made two threads 3-4x slower than one on a 2-core machine
with one busy core. So:

    threads = min(cores not busy with other processes, weight bytes read per frame / BYTES_PER_THREAD)

at least 1. `BYTES_PER_THREAD` is a first setting, not yet measured on an idle machine: the 68 MB
per frame small config never gained from a second thread here (on a shared machine), drama3-tiny
not even on a quiet 2-core machine, and the benchmark
(benchmarks/generate.py prints 1 vs default vs chosen) is how to move it. Busy cores are counted
from the kernel's count of runnable tasks, sampled a few times, less this process's own runnable
threads. On CUDA the count is left alone (the CPU only launches kernels).

`decode_threads(model)` is the choice; `torch_threads(count)` applies a count to a block in the
calling thread and restores the previous one after it (torch keeps the count per thread). An int
given by the user (`generate(threads=...)`, `drama3 say --threads`) is used as it is.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch

BYTES_PER_THREAD = 256 * 2**20
"""Weight bytes read per frame that keep one more decode thread busy enough to pay for itself."""
LOAD_SAMPLES = 5
LOAD_SAMPLE_SECONDS = 0.002
AUTO = "auto"


def available_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota if one is set."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(cores, quota)) if quota is not None else max(1, cores)


def cgroup_cpu_quota(path: str = "/sys/fs/cgroup/cpu.max") -> int | None:
    """Whole cores a cgroup v2 quota allows ("max 100000" or absent: None)."""
    try:
        with open(path, encoding="ascii") as file:
            quota, period = file.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, -(-int(quota) // int(period)))


def runnable_tasks(path: str = "/proc/loadavg") -> int | None:
    """Tasks the kernel counts as running or ready to run now (the 4th field of /proc/loadavg,
    "running/total"); None where there is no such file."""
    try:
        with open(path, encoding="ascii") as file:
            return int(file.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def own_runnable_threads(task_dir: str = "/proc/self/task") -> int:
    """Threads of this process running or ready to run now (state R in /proc/self/task/*/stat)."""
    count = 0
    try:
        tasks = os.listdir(task_dir)
    except OSError:
        return 1
    for task in tasks:
        try:
            with open(os.path.join(task_dir, task, "stat"), encoding="ascii", errors="replace") as file:
                state = file.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        count += state == "R"
    return max(count, 1)  # the thread reading this is running


def busy_cores_elsewhere(samples: int = LOAD_SAMPLES, pause: float = LOAD_SAMPLE_SECONDS) -> int:
    """Cores other processes keep busy now: the median over a few snapshots of runnable tasks less
    this process's own runnable threads (0 where the system does not say)."""
    counts = []
    for index in range(samples):
        total = runnable_tasks()
        if total is None:
            return 0
        counts.append(max(0, total - own_runnable_threads()))
        if index + 1 < samples:
            time.sleep(pause)
    return int(statistics.median_low(counts))


def weight_bytes_per_frame(model) -> int:
    """Bytes of weights one decode step reads: every matrix but the embedding tables (one row
    each is read), the routed experts at the share a token is routed to, and of `lm_head` the
    restricted rows (semantic band + eos)."""
    text = model.config.text_config
    routed_share = text.num_experts_per_tok / text.num_experts
    total = 0.0
    for name, parameter in model.named_parameters():
        size = parameter.numel() * parameter.element_size()
        if "embed" in name:
            total += parameter.shape[-1] * parameter.element_size()
        elif ".mlp.experts." in name:
            total += size * routed_share
        elif name.startswith("lm_head"):
            total += size * (model.config.codebook_size + 1) / parameter.shape[0]
        else:
            total += size
    return int(total)


def threads_for(weight_bytes: int, cores: int, busy: int) -> int:
    """The decode thread count for `weight_bytes` read per frame on `cores` cores of which `busy`
    are taken by other processes: at least 1."""
    by_size = weight_bytes // BYTES_PER_THREAD
    return max(1, min(cores - busy, by_size))


def decode_threads(model) -> int | None:
    """The thread count to decode `model` with now, or None on CUDA (leave torch's alone)."""
    if next(model.parameters()).device.type != "cpu":
        return None
    weight_bytes = weight_bytes_per_frame(model)
    if weight_bytes < 2 * BYTES_PER_THREAD:  # one thread whatever the load: skip sampling it
        return 1
    return threads_for(weight_bytes, available_cores(), busy_cores_elsewhere())


def check_threads(threads, location: str = "threads") -> None:
    """`threads` is "auto", None (leave torch's count alone) or a positive int; a ValueError naming
    `location` otherwise."""
    if threads is None or threads == AUTO:
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"{location}={threads!r}: expected a positive number of threads or 'auto'")


def resolve_threads(model, threads) -> int | None:
    """The thread count a call decodes with: `decode_threads(model)` for "auto", the user's int as
    given, None (torch's count unchanged) for None."""
    check_threads(threads)
    if threads == AUTO:
        return decode_threads(model)
    return threads


@contextlib.contextmanager
def torch_threads(count: int | None):
    """Run the block with `count` torch intra-op threads in this thread (None: unchanged), then
    restore the previous count."""
    if count is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
