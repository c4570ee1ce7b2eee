"""Checkpoints that survive a crash at any moment: layout, atomic publishing, resume lookup.

    <default_local_dir>/
        global_step_40/                    a complete checkpoint (published by a rename)
            actor/engine/                  the actor's weights, optimizer, LR schedule (DCP)
            actor/rank_0.pt ...            per-rank state: RNG, step, data position
            critic/engine/ ...             the critic's; critic/rank_2.pt ... (KL controller too)
            rollout/rank_1.pt ...          a rollout pool of its own: the batches generated ahead
            reward/rank_3.pt ...           a reward pool of its own: RNG, step
            meta.json                      step, each role group's ranks, config; written just before publishing
        global_step_60.partial/            being written (or left by a crash: never read)
        latest_checkpointed_iteration.txt  "60", replaced atomically after the rename

Each role group's program writes its part, inside its pool's group, at its own pace. World rank 0
(the actor pool's first rank) publishes once every other pool's first rank reports its parts
written (a point-to-point message, so no world collective): rename `.partial` to the final name, then
replace the pointer. A crash before the rename leaves a `.partial` nobody reads; a crash
between rename and pointer leaves the pointer on the previous checkpoint, which is whole.
The pointer is what `trainer.resume=auto` trusts. Names follow verl's.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch

LATEST = "latest_checkpointed_iteration.txt"
STEP_DIR = re.compile(r"^global_step_(\d+)$")
PARTIAL_DIR = re.compile(r"^global_step_(\d+)\.partial$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (the message says which and why)."""


class ResumeDisagreement(CheckpointError):
    """The ranks chose different checkpoints to resume from (train.agree_on_resume): raised on
    every rank alike, so they leave together."""


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"global_step_{step}")


def partial_dir(root: str, step: int) -> str:
    return step_dir(root, step) + ".partial"


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "meta.json"))


def read_meta(path: str) -> dict:
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


def saved_ranks(meta: dict) -> dict[str, list[int]]:
    """Each role group's ranks when the checkpoint was written (checkpoints before the reward group
    had its own key kept the actor's, critic's and rollout's; reward sat with the critic)."""
    if "ranks" in meta:
        return meta["ranks"]
    return {"rollout": meta.get("rollout_ranks", meta["actor_ranks"]), "actor": meta["actor_ranks"],
            "critic": meta["critic_ranks"], "reward": meta["critic_ranks"]}


def find_resume(resume: str, root: str) -> str | None:
    """The checkpoint folder to resume from, or None to start fresh. Pure file reads, so every
    rank decides alike before the world forms. `resume`: auto | disable | a checkpoint folder."""
    if resume == "disable":
        return None
    if resume != "auto":
        path = os.path.abspath(os.path.expanduser(resume))
        if not is_complete(path):
            why = "no such folder" if not os.path.isdir(path) else "it has no meta.json (an incomplete checkpoint?)"
            raise CheckpointError(f"trainer.resume={resume!r}: not a complete checkpoint: {why}")
        return path
    pointer = os.path.join(root, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{pointer}: expected a step number, found {text!r}")
    path = step_dir(root, int(text))
    if not is_complete(path):
        raise CheckpointError(
            f"{pointer} names step {text} but {path} is not a complete checkpoint; "
            "pass trainer.resume=<a checkpoint folder> or trainer.resume=disable"
        )
    return path


def find_resume_after_restart(resume: str, root: str, restarts: int) -> str | None:
    """As find_resume; but a job that Slurm restarted (`restarts` = SLURM_RESTART_COUNT > 0:
    a requeue or preemption reruns the submitted arguments) goes on from its own latest
    checkpoint, not back to the folder or the fresh start its first run was given."""
    if restarts > 0 and resume != "auto":
        latest = find_resume("auto", root)
        if latest:
            return latest
    return find_resume(resume, root)


def resume_disagreement(choices: list[str | None]) -> str | None:
    """None when every rank chose the same checkpoint (`choices[rank]`: find_resume's answer on
    that rank, None for a fresh start); else one line saying which ranks chose what."""
    if len(set(choices)) <= 1:
        return None
    ranks: dict[str | None, list[int]] = {}
    for rank, choice in enumerate(choices):
        ranks.setdefault(choice, []).append(rank)
    seen = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {choice or 'no checkpoint (a fresh start)'}"
                     for choice, r in ranks.items())
    return (f"the ranks do not agree on the checkpoint to resume from ({seen}): every node must see the same, "
            "up-to-date trainer.default_local_dir (a shared filesystem whose view lags on some node?); "
            "or name one with trainer.resume=<a checkpoint folder>")


def publish(root: str, step: int, meta: dict, max_to_keep: int) -> str:
    """World rank 0, once every pool wrote its parts: meta, rename, pointer, pruning."""
    partial, final = partial_dir(root, step), step_dir(root, step)
    write_atomic(os.path.join(partial, "meta.json"), json.dumps(meta, indent=1))
    if os.path.exists(final):
        # Only possible after a resume from an older checkpoint: the old step-`step` is replaced.
        # It is not the pointer's target (that is older), so losing it mid-way loses nothing.
        shutil.rmtree(final)
    os.replace(partial, final)
    write_atomic(os.path.join(root, LATEST), str(step))
    prune(root, max_to_keep, keep=step)
    return final


def folder_bytes(path: str) -> int:
    """What a checkpoint takes on disk: the size of every file under `path`."""
    return sum(os.path.getsize(os.path.join(folder, name)) for folder, _, names in os.walk(path) for name in names)


def prune(root: str, max_to_keep: int, keep: int) -> None:
    """Deletes the oldest published checkpoints beyond `max_to_keep` (0 = keep all) and the
    `.partial` folders of earlier steps (left by a crash). Never the one just published, nor a
    later `.partial`: with save_freq=1 the critic pool may already be writing the next step's."""
    steps = sorted(int(m.group(1)) for name in os.listdir(root) if (m := STEP_DIR.match(name)))
    if max_to_keep > 0:
        for old in [s for s in steps if s != keep][: max(0, len(steps) - max_to_keep)]:
            shutil.rmtree(step_dir(root, old), ignore_errors=True)
    for name in os.listdir(root):
        m = PARTIAL_DIR.match(name)
        if m and int(m.group(1)) < keep:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_rank_state(path: str, state: dict) -> None:
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_rank_state(path: str) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
