"""Where world rank 0 sends a run's metrics: the sinks trainer.logger chooses (a console line and
progress bar, TensorBoard, Weights & Biases, MLflow), behind MetricsLogger, which also keeps their
history for the end-of-run report."""

from __future__ import annotations

import os
import sys

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
