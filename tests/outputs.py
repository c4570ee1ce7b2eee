"""Reads what a job leaves behind: TensorBoard, wandb and MLflow scalars, its timeline (tests/launch.py starts it)."""

from __future__ import annotations

import glob
import json
import os


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
