"""What a run reports: verl's metric names, sent by world rank 0 to the sinks trainer.logger
chooses (a console line and progress bar, TensorBoard, Weights & Biases, MLflow), and a per-rank
phase timeline written as Chrome-trace JSON (opens in Perfetto)."""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager

import torch

from spmdsplit import algo, failure
from spmdsplit.batch import Batch
from spmdsplit.distributed import pool_max_min, pool_reduce_metrics, pool_sum


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
        runs), so that kernels are told apart by phase (tools/efficiency.py)."""
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


@torch.no_grad()
def compute_data_metrics(batch: Batch, group, device, max_response_length: int) -> dict[str, float]:
    """verl's data metrics (critic/score, rewards, advantages, returns, values, response and
    prompt lengths) over the pool's whole global batch, from one SUM and one MAX all-reduce.
    `max_response_length`: data.max_response_length, what a clipped response ran to (the batch
    is only as wide as its longest response)."""
    response_mask = batch["response_mask"].float()
    prompt_mask = batch["attention_mask"][:, : -response_mask.shape[1]].float()
    response_length = response_mask.sum(-1)
    prompt_length = prompt_mask.sum(-1)
    ones = torch.ones_like(response_length)
    n_valid = response_mask.sum().item()
    per_token = {k: batch[k] for k in ("advantages", "returns", "values") if k in batch}  # no values without a critic
    per_seq = {
        "critic/score": batch["token_level_scores"].sum(-1),
        "critic/rewards": batch["token_level_rewards"].sum(-1),
        "response_length": response_length,
        "prompt_length": prompt_length,
    }
    sums, counts, maxes, mins = {}, {}, {}, {}
    for name, x in per_seq.items():
        sums[f"{name}/mean"], counts[f"{name}/mean"] = x.sum().item(), len(x)
        maxes[f"{name}/max"], mins[f"{name}/min"] = x.max().item(), x.min().item()
    for name, x in per_token.items():
        key = f"critic/{name}"
        sums[f"{key}/mean"], counts[f"{key}/mean"] = (x * response_mask).sum().item(), n_valid
        valid = x[response_mask.bool()]
        maxes[f"{key}/max"] = valid.max().item() if valid.numel() else float("-inf")
        mins[f"{key}/min"] = valid.min().item() if valid.numel() else float("inf")
    sums["response_length/clip_ratio"] = (response_length >= max_response_length).float().sum().item()
    counts["response_length/clip_ratio"] = len(response_length)
    if "num_turns" in batch:  # multi-turn: verl's num_turns/*, and the tool calls per step
        agent_metrics(batch, group, sums, counts, maxes, mins)
    metrics = pool_reduce_metrics(sums, counts, group, device)
    maxes, mins = pool_max_min(maxes, mins, group, device)
    metrics.update(maxes)
    metrics.update(mins)
    if "values" in batch:
        metrics["critic/vf_explained_var"] = algo.compute_explained_variance(
            batch["values"], batch["returns"], batch["response_mask"], reduce_sum=pool_sum(group)
        )
    return metrics


def agent_metrics(batch: Batch, group, sums: dict, counts: dict, maxes: dict, mins: dict) -> None:
    """verl's num_turns/{mean,max,min} (the prompt, assistant turns and tool rounds of an episode),
    and per step: tool/calls, tool/errors and each error kind (summed over the pool: a count of
    the step, sent as a "mean" over one), and response_length's share that the tools wrote.
    (response_length/* above counts the policy's tokens only: the response_mask.)"""
    import torch.distributed as dist

    from spmdsplit.agent.tools import ERROR_KINDS

    turns = batch["num_turns"].float()
    sums["num_turns/mean"], counts["num_turns/mean"] = turns.sum().item(), len(turns)
    maxes["num_turns/max"], mins["num_turns/min"] = turns.max().item(), turns.min().item()
    errors = batch["tool_errors"].sum(0).tolist()
    ranks = dist.get_world_size(group) if dist.is_initialized() else 1
    for key, value in [("tool/calls", batch["tool_calls"].sum().item()), ("tool/errors", sum(errors)),
                       *((f"tool/errors/{kind}", n) for kind, n in zip(ERROR_KINDS, errors))]:
        sums[key], counts[key] = float(value), 1.0 / ranks  # weights summing to 1: the pool's total
    R = batch["response_mask"].shape[1]
    tool_tokens = (batch["attention_mask"][:, -R:] - batch["response_mask"]).sum(-1).float()
    sums["tool/response_tokens/mean"], counts["tool/response_tokens/mean"] = tool_tokens.sum().item(), len(tool_tokens)


def rollout_probs_diff_metrics(rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                               response_mask: torch.Tensor, group, device) -> dict[str, float]:
    """verl's training/rollout_probs_diff_{max,mean} over the pool's valid tokens (the math:
    spmdsplit/rollout/base.py rollout_probs_diff)."""
    from spmdsplit.rollout.base import rollout_probs_diff

    total, count, largest = rollout_probs_diff(rollout_log_probs, old_log_probs, response_mask)
    means = pool_reduce_metrics({"training/rollout_probs_diff_mean": total.item()},
                                {"training/rollout_probs_diff_mean": count.item()}, group, device)
    maxes, _ = pool_max_min({"training/rollout_probs_diff_max": largest.item()}, {}, group, device)
    return {**means, **maxes}


def rollout_correction_metrics(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                               response_mask: torch.Tensor, rollout_is: str | None, rollout_is_threshold: float,
                               group, device) -> dict[str, float]:
    """verl's rollout_corr/* over the pool's rows (the math: algo.rollout_correction_stats)."""
    means, maxes, mins = algo.rollout_correction_stats(old_log_probs, rollout_log_probs, response_mask,
                                                       rollout_is, rollout_is_threshold)
    reduced = pool_reduce_metrics({k: s for k, (s, _) in means.items()}, {k: w for k, (_, w) in means.items()},
                                  group, device)
    maxes, mins = pool_max_min(maxes, mins, group, device)
    return algo.finish_rollout_correction_metrics(reduced, maxes, mins)


def rollout_correction(rollout: Batch, corr, group, device, weights: bool = True) -> dict[str, float]:
    """The engine's own log-probs against the actor's old ones (every engine returns them):
    verl's training/rollout_probs_diff_* and rollout_corr/* metrics; with
    algorithm.rollout_correction.rollout_is (`corr`) and `weights`, the truncated importance weights
    the policy loss takes, as a column of the rows, so they follow them into every micro-batch."""
    if "rollout_log_probs" not in rollout:
        return {}
    engine, actor, mask = rollout["rollout_log_probs"], rollout["old_log_probs"], rollout["response_mask"]
    metrics = rollout_probs_diff_metrics(engine, actor, mask, group, device)
    metrics.update(rollout_correction_metrics(actor, engine, mask, corr.rollout_is, corr.rollout_is_threshold,
                                              group, device))
    if corr.rollout_is and weights:
        rollout["rollout_is_weights"] = algo.compute_rollout_is_weights(actor, engine, mask, corr.rollout_is,
                                                                        corr.rollout_is_threshold)
    return metrics


def token_staleness(rollout: Batch, step: int, group, device) -> dict[str, float]:
    """How stale the trained tokens were (continuous generation: each response token records the
    version it was sampled with, `token_weights_version`): update `step` trains with the policy of
    version step-1, so a token's staleness is step-1 minus its version. Over the pool's tokens."""
    if "token_weights_version" not in rollout:
        return {}
    mask = rollout["response_mask"].bool()
    per_token = rollout["token_weights_version"]
    versions = per_token[mask].double()
    staleness = (step - 1) - versions
    big = float(2**31)
    row_max = per_token.masked_fill(~mask, -2**31).max(1).values
    row_min = per_token.masked_fill(~mask, 2**31).min(1).values
    sums = {"rollout/token_staleness_mean": staleness.sum().item(),
            "rollout/mixed_version_rows": (row_max > row_min).sum().item()}
    counts = {"rollout/token_staleness_mean": staleness.numel(), "rollout/mixed_version_rows": len(per_token)}
    # The tokens sampled with the policy the actor now holds (version step-1): the engine's log-probs
    # of them must be the actor's (as rollout_probs_diff in on-policy runs), which holds only if
    # each token's recorded version is the one it was sampled with.
    current = mask & (per_token == step - 1)
    sums["rollout/current_version_tokens"], counts["rollout/current_version_tokens"] = current.sum().item(), mask.sum().item()
    extra_max = {}
    if "old_log_probs" in rollout:
        from spmdsplit.rollout.base import rollout_probs_diff

        _, _, largest = rollout_probs_diff(rollout["rollout_log_probs"], rollout["old_log_probs"], current)
        extra_max["rollout/current_version_probs_diff_max"] = largest.item()
    means = pool_reduce_metrics(sums, counts, group, device)
    maxes, mins = pool_max_min({**extra_max,
                                "rollout/token_staleness_max": staleness.max().item() if staleness.numel() else 0.0,
                                "rollout/weights_version_max": versions.max().item() if versions.numel() else -big},
                               {"rollout/weights_version_min": versions.min().item() if versions.numel() else big},
                               group, device)
    return {**means, **maxes, **mins}


# The module each optional sink of trainer.logger imports (only when chosen).
OPTIONAL_LOGGER_MODULES = {"wandb": "wandb", "mlflow": "mlflow"}


def missing_logger(chosen) -> str | None:
    """One line naming the first chosen sink whose package is not installed, or None; checked on
    every rank before the world forms, so a missing package does not fail rank 0 alone mid-job."""
    import importlib.util

    for name in chosen:
        module = OPTIONAL_LOGGER_MODULES.get(name)
        if module and importlib.util.find_spec(module) is None:
            return f'trainer.logger: {name} is not installed (pip install -e ".[{name}]")'
    return None


def mlflow_metric_name(key: str) -> str:
    """MLflow takes only alphanumerics, `_ - . / :` and spaces in a name; verl's validation names
    end in `@n` (val-core/<source>/reward/mean@1), so `@` becomes `_at_` there, as verl maps it.
    Every other sink gets the names unchanged."""
    return key.replace("@", "_at_")


def run_output_dir(log_dir: str) -> str:
    """Where wandb and MLflow write when their own environment variables do not say: beside the
    TensorBoard folder (outputs/ by default), so one run's records stay together."""
    return os.path.dirname(os.path.abspath(log_dir)) if log_dir else os.path.abspath("outputs")


class Sink:
    """One destination of the metrics. `log_validation` is for metrics outside a step's own line;
    only the console formats those differently."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def log_validation(self, step: int, metrics: dict[str, float]) -> None:
        self.log(step, metrics)

    def run_id(self) -> str | None:
        """The tracking run this sink writes to, for a resumed job to go on in (None: no run)."""
        return None

    def close(self) -> None:
        pass


class ConsoleSink(Sink):
    """One line per step (tests and the README parse `step N: score=...`), and a progress bar."""

    KEYS = ("critic/score/mean", "actor/pg_loss", "critic/vf_loss", "actor/entropy", "timing_s/step")

    def __init__(self, total_steps: int, progress_bar: bool, first_step: int):
        from tqdm import tqdm

        # A bar only on a terminal: in a log file (Slurm, CI) its redraws would bury the step lines.
        show_bar = progress_bar and sys.stderr.isatty()
        self.bar = tqdm(total=total_steps, initial=first_step - 1, desc="ppo", unit="step", dynamic_ncols=True) if show_bar else None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        line = f"step {step}: " + "  ".join(
            f"{k.split('/')[-2] if k.endswith('/mean') else k.split('/')[-1]}={metrics[k]:.4g}"
            for k in self.KEYS if k in metrics
        )
        if self.bar:
            self.bar.write(line)
            self.bar.update(1)
        else:
            print(line, flush=True)

    def log_validation(self, step: int, metrics: dict[str, float]) -> None:
        line = f"step {step}: " + "  ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))
        (self.bar.write if self.bar else print)(line)

    def close(self) -> None:
        if self.bar:
            self.bar.close()


class TensorBoardSink(Sink):
    def __init__(self, log_dir: str, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run purges what the stopped one logged after its checkpoint, so TensorBoard
        # shows each step once.
        self.writer = SummaryWriter(log_dir=log_dir, purge_step=first_step if first_step > 1 else None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in sorted(metrics.items()):
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink(Sink):
    """A Weights & Biases run named trainer.experiment_name in trainer.project_name. wandb's own
    environment decides the rest: WANDB_MODE=offline writes without a network (`wandb sync`
    uploads later), WANDB_DIR moves its files (default: beside trainer.log_dir). A resumed job
    goes on in the run its checkpoint names (`run_id`), as one run."""

    name = "wandb"

    def __init__(self, project: str, experiment: str, config: dict, default_dir: str, run_id: str | None = None):
        import wandb

        directory = os.environ.get("WANDB_DIR") or default_dir
        os.makedirs(directory, exist_ok=True)
        resume = {"id": run_id, "resume": "allow"} if run_id else {}
        self.run = wandb.init(project=project, name=experiment, config=config, dir=directory, **resume)

    def run_id(self) -> str:
        return self.run.id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """The config as MLflow params: dotted keys, values as text (MLflow keeps at most 6000
    characters of a param)."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_params(value, name + "."))
        else:
            out[name] = str(value)[:6000]
    return out


class MlflowSink(Sink):
    """An MLflow run named trainer.experiment_name in the experiment trainer.project_name, at
    MLFLOW_TRACKING_URI (a server, or a store) or else a local file store beside trainer.log_dir.
    The resolved config becomes the run's params, as verl's tracking logs it; a resumed job goes
    on in the run its checkpoint names (params are MLflow's to keep: they are logged once)."""

    name = "mlflow"

    def __init__(self, project: str, experiment: str, config: dict, default_dir: str, run_id: str | None = None):
        import mlflow

        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri("file:" + os.path.join(default_dir, "mlruns"))
        # MLflow 3 refuses its file store (a folder, no server, no SQLAlchemy: what mlflow-skinny
        # can write) unless opted in; a user who sets this to false gets MLflow's own refusal.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_experiment(project)
        self.mlflow = mlflow
        if run_id:
            try:
                self.run = mlflow.start_run(run_id=run_id)
                return
            except mlflow.exceptions.MlflowException as e:  # another store than the stopped job's
                print(f"spmdsplit: warning: MLflow run {run_id} of the checkpoint not found at "
                      f"{mlflow.get_tracking_uri()} ({str(e).splitlines()[0]}); starting a new run", flush=True)
        self.run = mlflow.start_run(run_name=experiment)
        mlflow.log_params(flat_params(config))

    def run_id(self) -> str:
        return self.run.info.run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.mlflow.log_metrics({mlflow_metric_name(k): v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def make_sinks(trainer, config: dict, first_step: int, run_ids: dict[str, str]) -> list[Sink]:
    """The sinks trainer.logger names, in its order; `run_ids` (from the checkpoint a job resumes
    from) names the wandb / MLflow runs to go on in."""
    default_dir = run_output_dir(trainer.log_dir)
    make = {
        "console": lambda: ConsoleSink(trainer.total_steps, trainer.progress_bar, first_step),
        # trainer.log_dir="" turned TensorBoard off before trainer.logger existed; it still does.
        "tensorboard": lambda: TensorBoardSink(trainer.log_dir, first_step) if trainer.log_dir else None,
        "wandb": lambda: WandbSink(trainer.project_name, trainer.experiment_name, config, default_dir,
                                   run_ids.get("wandb")),
        "mlflow": lambda: MlflowSink(trainer.project_name, trainer.experiment_name, config, default_dir,
                                     run_ids.get("mlflow")),
    }
    return [sink for sink in (make[name]() for name in trainer.logger) if sink]


class MetricsLogger:
    """World rank 0 only: every step's metrics to each sink of trainer.logger, and a history of
    them for the end-of-run report."""

    def __init__(self, trainer, config: dict | None = None, first_step: int = 1, run_ids: dict | None = None):
        self.sinks = make_sinks(trainer, config or {}, first_step, run_ids or {})
        self.history: list[dict[str, float]] = []
        self.validation: list[dict[str, float]] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.history.append({"step": step, **metrics})
        for sink in self.sinks:
            sink.log(step, metrics)

    def run_ids(self) -> dict[str, str]:
        """The tracking runs to go on in after a resume (saved with each checkpoint)."""
        return {sink.name: sink.run_id() for sink in self.sinks if sink.run_id()}

    def log_scalars(self, step: int, metrics: dict[str, float]) -> None:
        """Metrics outside the step's own line (validation)."""
        for sink in self.sinks:
            sink.log_validation(step, metrics)
        self.validation.append({"step": step, **metrics})

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
