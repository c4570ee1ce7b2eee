"""The rule reward: decodes each response and scores it with the scorer of its data_source (or
with the custom reward function, which then replaces them all), called with the row's
data_source, ground truth and extra_info.

Responses are decoded as verl's reward managers decode them (`skip_special_tokens=True`), for
verl's scorers and custom functions alike; only the embedded tasks' own scorers read the special
tokens too (rewards/rule.py, SEES_SPECIAL_TOKENS).

How each sample's score is computed (built-in scorers, a custom function of any shape, a reward
server), concurrently and bounded in time, is spmdsplit/rewards/calls.py's. What a sample whose call
raised, overran or returned garbage scores is reward.on_error's: `fail` (the default) stops the job
with a `RewardError` that carries the sample (its data_source, response text and ground truth) and
the original error; the roles let it propagate, the rank exits with it and torchrun ends the job,
so a broken reward never trains silently. A number scores the sample with it, counted per kind in
reward/errors/<kind>; a batch in which every sample failed says so in one line.

DAPO's overlong buffer (reward.overlong_buffer, verl's `overlong_buffer_cfg` of its DAPO reward
manager) shapes the score here, whichever scorer gave it (built-in or custom), for training and
validation alike, as verl's DAPO manager does: `overlong_reward` below.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from typing import Callable, Sequence

import torch

from spmdsplit.batch import Batch
from spmdsplit.errors import ConfigError
from spmdsplit.rewards.calls import RewardCalls, Sample, Scored
from spmdsplit.rewards.rule import SEES_SPECIAL_TOKENS, find_scorer

SHOW_CHARS = 500  # how much of a response an error shows
# The column of rows that carry their response texts, decoded as RuleReward decodes them: dynamic
# sampling (spmdsplit/dynamic_sampling.py) decodes each generated response once, for its filter,
# and the rows it keeps take their texts along (spmdsplit/messages.py), so that scoring them
# again for training decodes nothing.
RESPONSE_TEXT = "response_text"
# The column of scored rows holding each row's judge verdict (reward.judge; "" where no judge
# scored it): the critic group's rollout dumps write it.
VERDICT_TEXT = "judge_verdict"
# reward/judge/* kept as totals over the pool (the others are means).
JUDGE_TOTALS = ("parse_failures", "truncated", "engine_requests", "engine_tokens")


class RewardError(RuntimeError):
    """A reward could not be computed for a sample; the message shows the sample."""


class UnknownDataSourceError(RewardError, KeyError):
    """No built-in scorer for a sample's data_source: a RewardError that is also the KeyError
    `rule.compute_score` raises, so callers may catch either."""

    __str__ = BaseException.__str__  # KeyError's own str() would quote the multi-line message


def _shorten(text: str, limit: int = SHOW_CHARS) -> str:
    """Head and tail of a long text: the start shows what it is, the end holds the final answer."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} [... {len(text) - 2 * half} chars cut ...] {text[-half:]}"


def describe_sample(index: int, response: str, data_source=None, ground_truth=None, prompt: str | None = None) -> str:
    lines = [f"  sample {index} of this rank's batch"]
    if data_source is not None:
        lines.append(f"  data_source: {data_source!r}")
    if prompt is not None:
        lines.append(f"  prompt ({len(prompt)} chars): {_shorten(prompt)!r}")
    lines.append(f"  response ({len(response)} chars): {_shorten(response)!r}")
    if ground_truth is not None:
        lines.append(f"  ground_truth: {_shorten(str(ground_truth))!r}")
    return "\n".join(lines)


def host_lists(*tensors: torch.Tensor) -> list[list]:
    """Each tensor as nested Python lists, copied to the host once (one transfer per tensor)."""
    return [t.cpu().tolist() for t in tensors]


def per_flag(items: list, flags: Sequence[bool], call) -> list:
    """`call(items, flag)` once per value of the items' flags, on the items that have it; the
    results back in the items' order. A tokenizer's batch call takes one flag for all its rows:
    at most two calls for a batch, not one per row."""
    out = [None] * len(items)
    for flag in sorted(set(flags)):
        which = [i for i, f in enumerate(flags) if f == flag]
        for i, result in zip(which, call([items[i] for i in which], flag)):
            out[i] = result
    return out


def decode_rows(tokenizer, rows: list[list[int]], skip_special_tokens: bool | Sequence[bool] = False) -> list[str]:
    """Each row of token ids decoded, in one `batch_decode` per value of `skip_special_tokens` (one
    flag for all rows, or one per row)."""
    flags = [skip_special_tokens] * len(rows) if isinstance(skip_special_tokens, bool) else list(skip_special_tokens)
    return per_flag(rows, flags, lambda some, skip: tokenizer.batch_decode(some, skip_special_tokens=skip))


def decoded_prompts(tokenizer, batch: Batch, skip_special_tokens: bool = False) -> list[str]:
    """Each row's prompt tokens (the columns before its response, the left padding dropped), decoded.
    The columns are copied to the host once, not a row (and a sync) at a time, and decoded in one call."""
    P = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    prompt_ids = [[token for token, kept in zip(ids, keep) if kept]
                  for ids, keep in zip(*host_lists(batch["input_ids"][:, :P], batch["attention_mask"][:, :P]))]
    return decode_rows(tokenizer, prompt_ids, skip_special_tokens)


def response_texts(tokenizer, responses: torch.Tensor, lengths: torch.Tensor, eos_token_ids: set[int],
                   skip_special_tokens: bool | Sequence[bool] = False) -> list[str]:
    """Each response's valid tokens, decoded, without the EOS that ends it. `skip_special_tokens`
    (one flag for all rows, or one per row) drops the other special tokens too, as verl's reward
    managers decode; kept, they show in the text (the reward model reads them)."""
    # One device-to-host copy of each tensor for the whole batch: indexing a GPU tensor row by row
    # (`int(lengths[i])`, `responses[i].tolist()`) would wait on the device twice per row.
    rows, row_lengths = host_lists(responses, lengths)
    valid = []
    for row, length in zip(rows, row_lengths):
        ids = row[:length]
        # Dropped even when the tokenizer does not count it as special: it ends the response,
        # it is not part of the answer.
        if ids and ids[-1] in eos_token_ids:
            ids = ids[:-1]
        valid.append(ids)
    return decode_rows(tokenizer, valid, skip_special_tokens)


def on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B, R] float32 with each row's score on its last valid response token (the policy's last:
    in a multi-turn row the mask has holes where tool responses are), 0 elsewhere (and everywhere
    for an empty response)."""
    R = response_mask.shape[-1]
    columns = torch.arange(R, device=response_mask.device)
    last = torch.where(response_mask.bool(), columns, -1).max(-1).values  # -1: no valid token
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    out[torch.arange(response_mask.shape[0], device=response_mask.device), last.clamp(min=0)] = scores.to(out.device, torch.float32)
    return out * (last >= 0).unsqueeze(-1)


def response_lengths(batch: Batch) -> torch.Tensor:
    """Each response's real tokens (the policy's and, in a multi-turn row, the tools' between
    them): the part of the response its attention mask covers; the scorer reads all of it."""
    R = batch["responses"].shape[1]
    if "attention_mask" in batch:
        return batch["attention_mask"][:, -R:].sum(-1)
    return batch["response_mask"].sum(-1)


def own_copy(extra_info):
    """A row's extra_info as a scorer gets it: its own shallow copy, so that a scorer which adds
    keys (verl's reward managers do) changes neither the batch nor the other rows of its group
    (rollout.n repeats one dict), whichever placement delivered it."""
    return dict(extra_info) if isinstance(extra_info, dict) else extra_info


def overlong_reward(length: int, max_response_length: int, buffer_len: int, penalty_factor: float) -> float:
    """DAPO's soft overlong punishment: 0 up to `max_response_length - buffer_len` tokens, then
    falling linearly to -penalty_factor at max_response_length."""
    exceed = length - (max_response_length - buffer_len)
    if exceed <= 0:
        return 0.0
    return min(-exceed / buffer_len * penalty_factor, 0.0)  # min, as verl: a negative factor never pays for length


def check_overlong_buffer_len(buffer_len: int, max_response_length: int | None) -> None:
    """reward.overlong_buffer.len, when the buffer is on: inside the response's budget, so that
    overlong_reward's ramp has tokens to run over (preflight and RuleReward both ask)."""
    if not (max_response_length and 0 < buffer_len < max_response_length):
        raise ConfigError(f"reward.overlong_buffer.len={buffer_len}: expected > 0 and < data.max_response_length="
                          f"{max_response_length} (the penalty ramps over the last len tokens before the limit)")


def default_reward_config():
    """reward.* as the schema's defaults (a RuleReward made without a job's config)."""
    from omegaconf import OmegaConf

    from spmdsplit.config import RewardConfig

    return OmegaConf.structured(RewardConfig)


class RuleReward:
    def __init__(self, tokenizer, eos_token_ids: list[int] | None = None, custom_fn: Callable | None = None,
                 overlong_buffer=None, max_response_length: int | None = None, calls: RewardCalls | None = None):
        """`overlong_buffer`: reward.overlong_buffer ({enable, len, penalty_factor, log}), with
        `max_response_length` (data.max_response_length); None or enable=false: no shaping.
        `calls`: how the samples are scored (roles/build.py builds it from reward.*); by default
        `custom_fn`, or the built-in scorers, under the schema's defaults."""
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids or [tokenizer.eos_token_id])
        self.calls = calls if calls is not None else RewardCalls(default_reward_config(), custom_fn)
        self.custom_fn = self.calls.custom_fn
        self.on_error = None if self.calls.cfg.on_error == "fail" else float(self.calls.cfg.on_error)
        self.overlong_buffer = overlong_buffer if overlong_buffer is not None and overlong_buffer.enable else None
        if self.overlong_buffer is not None:
            check_overlong_buffer_len(overlong_buffer.len, max_response_length)
        self.max_response_length = max_response_length
        # The extra numbers of the scores computed since the last pop_extra_metrics: key -> [sum, count];
        # and the samples whose call failed, by kind.
        self.extra_sums: dict[str, list[float]] = {}
        self.error_counts: Counter = Counter()

    @torch.no_grad()
    def compute(self, batch: Batch, keep_extras: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (token_level_scores [B, R] with the score on each response's last valid
        token and 0 elsewhere, scores [B]); with keep_extras (training, not validation), keeps
        the extra numbers for `pop_extra_metrics`."""
        token_level_scores, scores, extras = self.compute_with_extras(batch, count_errors=keep_extras)
        for key, values in extras.items() if keep_extras else ():
            acc = self.extra_sums.setdefault(key, [0.0, 0.0])
            numbers = [v for v in values if not math.isnan(v)]
            acc[0] += sum(numbers)
            acc[1] += len(numbers)
        return token_level_scores, scores

    def pop_extra_metrics(self, group, device) -> dict[str, float]:
        """Pool-wide means of the extra numbers a reward function returned in its dict (e.g. "acc")
        since the last call, as `critic/reward_extra/<key>/mean`, and the pool's count of samples
        whose call failed, per kind, as `reward/errors/<kind>` (only kinds seen). A collective over
        the pool's group (every rank of the pool calls it); the ranks agree on the keys first, since
        a rank whose samples gave no "acc" must still join that key's reduction."""
        import torch.distributed as dist

        from spmdsplit.distributed import pool_reduce_metrics

        errors = {f"errors/{kind}" for kind in self.error_counts}
        judge = {f"judge/{k}": v for k, v in self.calls.judge.pop_metrics().items()} if self.calls.judge else {}
        keys = set(self.extra_sums) | errors | set(judge)
        many = dist.is_initialized() and dist.get_world_size(group) > 1
        if many:
            every = [None] * dist.get_world_size(group)
            dist.all_gather_object(every, sorted(keys), group=group)
            keys = set().union(*every)
        first = not many or dist.get_rank(group) == 0
        sums, counts = {}, {}
        for k in keys:
            if k.startswith("errors/"):  # a total: every rank's count, over a weight of 1 in all
                sums[k], counts[k] = self.error_counts.get(k.removeprefix("errors/"), 0), float(first)
            elif k in judge:
                total, weight = judge[k]
                sums[k], counts[k] = total, float(first) if k.removeprefix("judge/") in JUDGE_TOTALS else weight
            else:
                sums[k], counts[k] = self.extra_sums.get(k, [0.0, 0.0])
        self.extra_sums, self.error_counts = {}, Counter()
        reduced = pool_reduce_metrics(sums, counts, group, device)
        return {(f"reward/{k}" if k.startswith(("errors/", "judge/")) else f"critic/reward_extra/{k}/mean"): v
                for k, v in reduced.items()}

    @property
    def judge(self):
        """reward.judge's Judge on this rank (rewards/judge.py), or None."""
        return self.calls.judge

    def close(self) -> None:
        """The judge's engine thread and endpoint stopped, the reward function's workers and loop ended."""
        self.calls.close()

    def pop_judge_spans(self) -> list[tuple[int, int]]:
        """The judge's scoring calls since the last pop, (start, end) in time.time_ns; [] without one."""
        return self.calls.judge.pop_spans() if self.calls.judge is not None else []

    def text_columns(self) -> dict[str, list[str]]:
        """Columns of texts the last `compute` made for the rows: the judge's verdicts (VERDICT_TEXT)."""
        return {VERDICT_TEXT: list(self.calls.verdict_texts)} if self.calls.judge is not None else {}

    def texts(self, batch: Batch) -> list[str]:
        """Each response's text as this reward decodes it: the rows' RESPONSE_TEXT when they carry
        it (decoded where they were generated, for dynamic sampling's filter), else decoded now."""
        if RESPONSE_TEXT in batch:
            return batch[RESPONSE_TEXT]
        return response_texts(self.tokenizer, batch["responses"], response_lengths(batch), self.eos_token_ids,
                              self.skips_special_tokens(batch["data_source"]))

    def skips_special_tokens(self, sources: list[str]) -> list[bool]:
        """Per row, whether its text is decoded as verl decodes it (special tokens dropped): every
        row, except those whose built-in scorer must see them (rule.SEES_SPECIAL_TOKENS)."""
        if self.custom_fn is not None:
            return [True] * len(sources)
        return [source not in SEES_SPECIAL_TOKENS for source in sources]

    @torch.no_grad()
    def compute_with_extras(self, batch: Batch, shaped: bool = True,
                            count_errors: bool = False) -> tuple[torch.Tensor, torch.Tensor, dict[str, list[float]]]:
        """As `compute`, plus the other numbers scorers returned in a dict (e.g. "acc"), one list
        of B floats per key; a sample whose scorer did not give that key has NaN there. `shaped`:
        with the overlong buffer's shaping (false: the scorers' own scores, dynamic sampling's
        metric=score). `count_errors`: failed samples are counted for reward/errors/<kind>."""
        responses, mask = batch["responses"], batch["response_mask"]
        sources, truths = batch["data_source"], batch["ground_truth"]
        texts = self.texts(batch)
        # A batch without the column (made by hand) gives {}, as verl's reward managers do.
        extra_info = batch["extra_info"] if "extra_info" in batch else [{}] * len(batch)
        prompts = decoded_prompts(self.tokenizer, batch, skip_special_tokens=True) if self.calls.needs_prompts else [""] * len(batch)
        samples = [Sample(sources[i], text, truths[i], own_copy(extra_info[i]), prompts[i]) for i, text in enumerate(texts)]
        try:
            results = self.calls.score(samples, measure=count_errors)
        except KeyError as e:  # a data_source with no scorer: the data's error, never scored
            i = next(i for i, s in enumerate(samples) if find_scorer(s.data_source) is None)
            raise UnknownDataSourceError(self._failure(i, samples[i], e.args[0] if e.args else str(e))) from e
        scores = [self._settled(i, sample, r, count_errors) for i, (sample, r) in enumerate(zip(samples, results))]
        failed = Counter(r.error for r in results if r.error)
        if failed and sum(failed.values()) == len(results):
            kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(failed.items()))
            print(f"spmdsplit: warning: every one of this batch's {len(results)} rewards failed ({kinds}; "
                  f"{self.calls.how}): each scored reward.on_error={self.on_error:g}", file=sys.stderr, flush=True)
        per_sample = [r.extras for r in results]
        if self.overlong_buffer is not None and shaped:
            self.shape_overlong(scores, per_sample, response_lengths(batch).tolist())
        keys = sorted({k for extras in per_sample for k in extras})
        collected = {k: [extras.get(k, math.nan) for extras in per_sample] for k in keys}
        scores = torch.tensor(scores, dtype=torch.float32, device=responses.device)
        return on_last_token(scores, mask), scores, collected

    def _settled(self, i: int, sample: Sample, result: Scored, count: bool) -> float:
        """A sample's score: its own, or reward.on_error's for a failed call (which stops the job
        under `fail`, the sample shown)."""
        if result.error is None:
            return result.score
        if self.on_error is None:
            raise RewardError(self._failure(i, sample, result.message)) from result.exception
        if count:
            self.error_counts[result.error] += 1
        return self.on_error

    def _failure(self, i: int, sample: Sample, message: str) -> str:
        return (f"{self.calls.how} failed on a sample; the job stops here so that it does not train on a broken "
                f"reward (reward.on_error=<a number> scores such samples instead):\n"
                f"{describe_sample(i, sample.solution_str, sample.data_source, sample.ground_truth)}\n"
                f"  error: {message}")

    def shape_overlong(self, scores: list[float], per_sample: list[dict[str, float]], lengths: list[int]) -> None:
        """Adds each row's overlong_reward to its score, in place; with `log`, also as the extras
        "overlong_reward" and "overlong" (1.0 where penalised). A row's length is what verl's DAPO
        manager counts, the response's attention-mask tokens: in a multi-turn row the tool
        responses count too, as they fill the same data.max_response_length budget."""
        buffer = self.overlong_buffer
        for i, length in enumerate(lengths):
            penalty = overlong_reward(length, self.max_response_length, buffer.len, buffer.penalty_factor)
            scores[i] += penalty
            if buffer.log:
                per_sample[i]["overlong_reward"] = penalty
                per_sample[i]["overlong"] = float(penalty < 0)
