"""What the reward group does with rows, wherever it sits (with the critic, or on a pool of its own):
each row's token-level score, ReMax's greedy baseline, and the validation set's scores. The
reward itself (rule, custom function or reward model) is spmdsplit/roles/reward*.py."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from spmdsplit.batch import Batch
from spmdsplit.distributed import pool_reduce_metrics


def score_rollout(reward, part: Batch, timer=None, step: int = 0, chunk: int = 0) -> Batch:
    """The columns scoring adds to a chunk of the rollout: `token_level_scores` (the score on each
    response's last policy token), the judge's verdict texts with a judge (roles/reward.py
    VERDICT_TEXT) and, with ReMax, `reward_baselines`. `timer`: the judge's time goes into the
    timeline as `reward/judge` (inside the caller's `reward` phase). Extras such as "acc" stay
    with the reward, for pop_extra_metrics."""
    scores, _ = reward.compute(part, keep_extras=True)
    columns = {"token_level_scores": scores}
    texts = reward.text_columns()  # the judge's verdicts, before ReMax's baselines are scored
    if "baseline_responses" in part:  # ReMax
        columns["reward_baselines"] = score_baselines(reward, part)
    for start, end in reward.pop_judge_spans():
        if timer is not None:
            timer.record_span("reward/judge", step, start, end, chunk=chunk)
    return Batch(columns, texts)


@contextmanager
def judge_asleep(reward, timer, step: int):
    """The block (the critic's update) with the reward's LLM judge asleep, where it sleeps
    (roles/build.py judge_sleeps): the critic trains on its device. Timed as reward/judge/sleep and
    reward/judge/wake."""
    judge = reward.judge if reward is not None else None
    if judge is None or not judge.sleeps:
        yield
        return
    with timer.phase("reward/judge/sleep", step):
        judge.sleep()
    yield
    with timer.phase("reward/judge/wake", step):
        judge.wake()


def score_baselines(reward, part: Batch) -> torch.Tensor:
    """ReMax's `reward_baselines`: the reward of each row's greedy response to its prompt,
    scored once per prompt group (its rows share the greedy response) by the same reward."""
    first_of = {}
    for i, uid in enumerate(part["uid"]):
        first_of.setdefault(uid, i)
    firsts = part.index(list(first_of.values()))
    P = firsts["input_ids"].shape[1] - firsts["responses"].shape[1]
    responses, mask = firsts["baseline_responses"], firsts["baseline_response_mask"]
    greedy = Batch({"responses": responses, "response_mask": mask,
                    "input_ids": torch.cat([firsts["input_ids"][:, :P], responses], dim=1),
                    "attention_mask": torch.cat([firsts["attention_mask"][:, :P], mask], dim=1)},
                   {k: firsts[k] for k in ("data_source", "ground_truth", "extra_info")})
    _, scores = reward.compute(greedy)
    group = {uid: g for g, uid in enumerate(first_of)}
    return scores[torch.tensor([group[uid] for uid in part["uid"]], device=scores.device)]


def score_validation(pools, reward, channel, timer, step: int, val_set, dump=None) -> dict[str, float]:
    """The validation responses in (VAL_ROWS), scored: verl's val-core/<data_source>/reward/mean@n,
    reduced over the reward group's pool (generation.validation.ValidationSet: every rank the same keys);
    `dump`: trainer.validation_data_dir's (dumps.RowDump)."""
    n = val_set.n
    batch = channel.recv_val_rows(step, val_set.responses)
    with timer.phase("val_reward", step):
        _, scores = reward.compute(batch)
    if dump is not None:
        with timer.phase("dump", step):
            dump.write(step, batch, scores)
    sums = {f"val-core/{ds}/reward/mean@{n}": 0.0 for ds in val_set.sources}
    counts = dict.fromkeys(sums, 0.0)
    for ds, score in zip(batch["data_source"], scores.tolist()):
        sums[f"val-core/{ds}/reward/mean@{n}"] += score
        counts[f"val-core/{ds}/reward/mean@{n}"] += 1
    return pool_reduce_metrics(sums, counts, pools.group("reward"), pools.device)
