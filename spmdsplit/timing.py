"""Where a rank's time goes: each phase timed (its `timing_s/<name>` metric and a trace event),
trainer.profile_steps's torch.profiler trace, and the per-rank phase timeline written as
Chrome-trace JSON (opens in Perfetto)."""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager

import torch

from spmdsplit import failure

# The phases' ranges in a torch.profiler trace: "phase:gen", "phase:update_actor", ...
PHASE_RANGE = "phase:"


class PhaseTimer:
    """Times named phases on one rank: their last durations feed `timing_s/<name>`, and every
    occurrence becomes a complete ("X") trace event. Wall-clock microseconds (time.time_ns), the
    one clock all ranks of a machine share (across nodes, as good as their NTP sync)."""

    def __init__(self, rank: int, device: torch.device):
        self.rank, self.device = rank, device
        self.events: list[dict] = []
        self.durations: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str, step: int, **args):
        """Times the block; the dict it yields may be filled with more event args (bytes, ...).
        Under torch.profiler (trainer.profile_steps) the block, its closing synchronize included,
        is also a range `phase:<name>` of the profile (record_function: a few µs when no profiler
        runs), so that kernels are told apart by phase (tools/plan/efficiency.py)."""
        args = {"step": step, **args}
        with torch.profiler.record_function(PHASE_RANGE + name):
            start = time.time_ns()
            try:
                yield args
            except BaseException:
                failure.note_phase(name, step)  # the error report says where it happened
                raise
            finally:
                if self.device.type == "cuda":
                    # Time the kernels, not their launch: the current stream only. A device-wide
                    # synchronize would also wait for NCCL's point-to-point streams, so every
                    # non-blocking send would block here until the other pool posts its receive.
                    torch.cuda.current_stream(self.device).synchronize()
                end = time.time_ns()
                self.durations[name] = self.durations.get(name, 0.0) + (end - start) / 1e9
                self.events.append(
                    {"name": name, "ph": "X", "pid": self.rank, "tid": 0, "ts": start // 1000,
                     "dur": max(1, (end - start) // 1000), "args": args}
                )

    def record_span(self, name: str, step: int, start_ns: int, end_ns: int, **args) -> None:
        """A phase timed by someone else (time.time_ns at its start and end), as `phase` records
        one: its duration into `timing_s/<name>`, and a trace event."""
        self.durations[name] = self.durations.get(name, 0.0) + (end_ns - start_ns) / 1e9
        self.events.append({"name": name, "ph": "X", "pid": self.rank, "tid": 0, "ts": start_ns // 1000,
                            "dur": max(1, (end_ns - start_ns) // 1000), "args": {"step": step, **args}})

    def record_peak_memory(self, name: str = "peak_memory") -> None:
        """A counter event with this rank's peak memory so far: RSS (Linux reports ru_maxrss in KiB)
        and, on GPUs, the CUDA caching allocator's peak. `peak_memory` at the end of a job; the
        trainer also records `memory_before_models` once the process is up and before any model is
        built (the interpreter, torch, transformers: what a CPU rank's RSS holds besides the job's own)."""
        import resource

        cuda = torch.cuda.max_memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else 0.0
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        self.events.append({"name": name, "ph": "C", "pid": self.rank, "tid": 0, "ts": time.time_ns() // 1000,
                            "args": {"rss_mb": rss, "cuda_max_allocated_mb": cuda}})

    def device_in_use(self) -> dict[str, float]:
        """On a GPU, what the whole device holds now (total - free, as the driver counts it): the
        trainer's tensors, what its allocator caches, and memory mapped by others in the process,
        such as a woken vLLM engine, which torch's allocator statistics do not see. For an event's args."""
        if self.device.type != "cuda":
            return {}
        free, total = torch.cuda.mem_get_info(self.device)
        return {"device_used_mb": (total - free) / 2**20}

    def pop_timings(self) -> dict[str, float]:
        timings = {f"timing_s/{k}": v for k, v in self.durations.items()}
        self.durations = {}
        return timings


class StepProfiler:
    """trainer.profile_steps (verl 0.4's key): torch.profiler over those steps of this rank, its
    Chrome trace written to `<trainer.profile_dir>/rank<r>.json.gz` when the last of them ends
    (Perfetto opens it; the phases are its `phase:<name>` ranges). CPU ops always; on a GPU also
    CUDA activity, which torch.profiler (torch/profiler/profiler.py -> autograd/profiler.py, with
    ProfilerActivity.CUDA in kineto's activities) takes from CUPTI's activity records: every
    kernel, memcpy and memset with its start and end on the GPU, which kineto converts from
    CUPTI's clock to time since the Unix epoch, the CPU events' base (torch's own trace validator,
    profiler/_trace_validator.py, compares a kernel's start with its `cudaLaunchKernel`'s), and
    links to that launch by a correlation id ("External id"). Without CUPTI, torch falls back to
    legacy CUDA events (profiler.supported_activities) and the trace holds no kernels."""

    def __init__(self, steps, folder: str, rank: int, device: torch.device):
        self.steps = sorted(steps)
        self.path = os.path.join(folder, f"rank{rank}.json.gz")
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = None

    @contextmanager
    def step(self, step: int):
        """Starts the profiler at the first profiled step (or the first one a resumed job runs),
        and stops it and writes the trace after the last. A step that fails writes nothing."""
        if self.profiler is None and self.steps and self.steps[0] <= step <= self.steps[-1]:
            self.profiler = torch.profiler.profile(activities=self.activities)
            self.profiler.start()
        yield
        if self.steps and step >= self.steps[-1]:
            self.stop()

    def stop(self) -> None:
        """Ends a running profile and writes its trace (also for a job stopped inside the steps)."""
        if self.profiler is None:
            return
        self.profiler.stop()
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self.profiler.export_chrome_trace(self.path)  # gzip-compressed: the name ends in .gz
        self.profiler = None


def write_timeline(path: str, events_per_rank: list[list[dict]], roles_per_rank: list[str]) -> None:
    trace = []
    for rank, role in enumerate(roles_per_rank):
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank} ({role})"}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
    for events in events_per_rank:
        trace.extend(events)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
    os.replace(tmp, path)
