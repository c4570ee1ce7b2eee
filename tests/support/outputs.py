"""Reads what a job leaves behind: TensorBoard, wandb and MLflow scalars, its timeline (tests/support/launch.py
starts it); and compares two runs' scalars (a resumed run with the uninterrupted one, one sink with another)."""

from __future__ import annotations

import glob
import json
import math
import os

import numpy as np


def scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_offline_runs(wandb_dir: str) -> list[str]:
    """The run id of each offline run directory under `wandb_dir` (offline-run-<time>-<id>), oldest first."""
    return [os.path.basename(d).rsplit("-", 1)[1] for d in sorted(glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*")))]


def wandb_offline_scalars(wandb_dir: str) -> dict[str, list[tuple[int, float]]]:
    """The step metrics of the offline runs under `wandb_dir` (one job, or a job and its resumed
    parts), read from their .wandb files: wandb has no public reader of offline runs (wandb.Api
    reads the server), so this walks each file's LevelDB-log framing (a 7-byte header, 32 KiB
    blocks of checksum/length/type-framed chunks) and parses each record with wandb's own protobuf
    schema."""
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "*.wandb"))):
        for key, points in _wandb_file_scalars(path).items():
            out.setdefault(key, []).extend(points)
    return out


def _wandb_file_scalars(path: str) -> dict[str, list[tuple[int, float]]]:
    import struct

    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", data[:7]
    block, pos, chunk, out = 32768, 7, b"", {}
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # the padding at a block's end
            pos += left
            continue
        chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a FULL record, or the LAST chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                for key, value in row.items():
                    if not key.startswith("_"):  # wandb's own _step, _runtime, _timestamp
                        out.setdefault(key, []).append((row["_step"], value))
    return out


def mlflow_scalars(tracking_uri: str) -> dict[str, list[tuple[int, float]]]:
    """Every metric's history of the one MLflow run at `tracking_uri`."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return {key: [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]
            for key in run.data.metrics}


def timeline_events(path: str) -> list[dict]:
    with open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def overlapping_steps(events: list[dict], a_name: str, a_ranks, b_name: str, b_ranks) -> list[int]:
    """Steps in which phase `a_name` on some rank of `a_ranks` and `b_name` on some rank of
    `b_ranks` ran at the same time (their [ts, ts+dur) intervals intersect)."""
    def spans(name, ranks):
        out = {}
        for e in events:
            if e["name"] == name and e["pid"] in ranks:
                out.setdefault(e["args"]["step"], []).append((e["ts"], e["ts"] + e["dur"]))
        return out

    a, b = spans(a_name, set(a_ranks)), spans(b_name, set(b_ranks))
    return sorted(
        s for s in a.keys() & b.keys()
        if any(x0 < y1 and y0 < x1 for x0, x1 in a[s] for y0, y1 in b[s])
    )


def assert_repeats(resumed_log_dir, uninterrupted_log_dir) -> None:
    """Every logged scalar but wall-clock ones equal, step for step, to the uninterrupted run's."""
    resumed, uninterrupted = comparable(str(resumed_log_dir)), comparable(str(uninterrupted_log_dir))
    assert resumed.keys() == uninterrupted.keys()
    for tag, values in uninterrupted.items():
        assert resumed[tag] == values, f"{tag} differs after resume"


def comparable(log_dir: str) -> dict[str, dict[int, float]]:
    """Every logged scalar but wall-clock ones, as tag -> {step: value}; each step logged once."""
    out = {}
    for tag, points in scalars(log_dir).items():
        if tag.startswith(("timing_s/", "perf/")):
            continue
        steps = [s for s, _ in points]
        assert len(steps) == len(set(steps)), f"{tag} logged twice for a step: {steps}"
        out[tag] = dict(points)
    return out


def first_and_best_scores(log_dir: str, k: int = 5, key: str = "critic/score/mean") -> tuple[float, float]:
    """The mean score of the first k steps, and the best mean of k steps in a row: what a run that
    ends once it has learned (trainer.stop_at_score) reached within its budget; `key`: another
    score's (a judge's run: the rule's, critic/reward_extra/rule_score/mean)."""
    scores = [v for _, v in scalars(log_dir)[key]]
    return sum(scores[:k]) / k, max(sum(scores[i - k:i]) / k for i in range(k, len(scores) + 1))


def assert_same_scalars(got: dict, tensorboard: dict, sink: str) -> None:
    """The same names, steps and values (TensorBoard keeps float32, the others float64)."""
    assert sorted(got) == sorted(tensorboard), (sink, set(got) ^ set(tensorboard))
    for key, points in tensorboard.items():
        assert [s for s, _ in got[key]] == [s for s, _ in points], (sink, key)
        for (_, value), (_, expected) in zip(got[key], points):
            assert np.float32(value) == np.float32(expected) or (math.isnan(value) and math.isnan(expected)), (sink, key)
