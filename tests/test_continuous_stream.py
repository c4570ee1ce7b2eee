"""ContinuousGeneration (spmdsplit/generation/continuous.py) on the real HF engine in this process, the test
playing the actor pool: it says when each version's weights are there (`ready`) and loads them
(`take_weights`), so the stream's rules can be checked step by step: rows in batch mode's shape,
versions per token, the staleness bound (answers too old start again, counted), groups held back
when too far ahead, and a checkpoint that loses nothing."""

from __future__ import annotations

import torch

from spmdsplit.config import load_config
from spmdsplit.generation.continuous import ContinuousGeneration
from spmdsplit.data.prompts import PromptDataset
from spmdsplit.data.synthetic import make_dataset
from spmdsplit.generation.shares import step_prompts
from tests.support.engines import build_model

PROMPTS, N = 4, 2


class Actor:
    """The weights of each version (a random model per version) and when they are published."""

    def __init__(self, engine):
        self.engine, self.published, self.stream = engine, 0, None
        self.models = [build_model(seed=v)[0] for v in range(6)]

    def ready(self) -> bool:
        return self.stream.version < self.published

    def take_weights(self, step: int) -> int:
        version = self.stream.version + 1
        assert version <= self.published, "the stream waited for weights the test never publishes"
        state = self.models[version].state_dict().items()
        self.engine.update_weights(state) if self.stream.version >= 0 else self.engine.wake_up(state)
        return version


def make_stream(staleness: int):
    from spmdsplit.embedded import build_tokenizer
    from spmdsplit.inference.hf import HFEngine

    cfg = load_config(None, [f"rollout.staleness={staleness}", f"rollout.n={N}", f"data.train_batch_size={PROMPTS}",
                             "data.max_response_length=12", "rollout.hf_step_tokens=2", "rollout.per_row_seed=false"])
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    engine = HFEngine(build_model(seed=0)[0], tokenizer, cfg.rollout, 12, [tokenizer.eos_token_id])
    dataset = PromptDataset(make_dataset("repeat", 64, seed=1), PROMPTS, shuffle=False, seed=0)
    actor = Actor(engine)
    stream = ContinuousGeneration(cfg, engine, lambda t: step_prompts(cfg, dataset, tokenizer, t, [0], 0),
                                  actor.take_weights, actor.ready, 0, 1, tokenizer.pad_token_id,
                                  [tokenizer.eos_token_id], torch.device("cpu"))
    actor.stream = stream
    stream.version = actor.take_weights(1)  # version 0, as the source's start does
    return stream, actor


def token_versions(rows) -> list[list[int]]:
    mask = rows["response_mask"].bool()
    return [v[m].tolist() for v, m in zip(rows["token_weights_version"], mask)]


def test_rows_have_batch_modes_shape_and_each_tokens_version():
    stream, actor = make_stream(staleness=2)
    first = stream.next_batch(1)
    assert len(first) == PROMPTS * N and first["row_index"].tolist() == list(range(PROMPTS * N))
    assert all(set(v) == {0} for v in token_versions(first))
    assert first["weights_version"].tolist() == [0] * len(first)
    groups = first["uid"]
    assert all(groups[i] == groups[i + 1] for i in range(0, len(groups), N))  # groups whole and in a row
    assert torch.equal(first["rollout_log_probs"] != 0, first["response_mask"].bool())
    actor.published = 1  # taken at the next engine step, mid-answer for the groups running
    second = stream.next_batch(2)
    versions = token_versions(second)
    assert any(v[0] == 0 and v[-1] == 1 for v in versions)  # answers that span the load
    assert all(v == sorted(v) for v in versions)
    assert second["weights_version"].tolist() == [min(v) for v in versions]
    assert set(second["uid"]).isdisjoint(groups)


def test_answers_older_than_the_staleness_allows_start_again_and_no_group_runs_too_far_ahead():
    stream, actor = make_stream(staleness=1)
    stream.next_batch(1)
    # Held at version 0 the stream has started some of batch 2's groups (which allow version 0) and
    # never more than batch 2 takes: a further group could only land in batch 3, which needs version >= 1.
    held = [r for g in (*stream.groups, *stream.complete) for r in g.responses if r.versions]
    assert 0 < len(stream.groups) + len(stream.complete) <= PROMPTS and held
    assert all(r.versions[0] == 0 for r in held)
    assert stream.oldest_allowed(3) == 1
    assert stream.admits() == (len(stream.groups) + len(stream.complete) < PROMPTS)
    stream.pop_metrics()
    # Were those answers to land in batch 3 (filled with version 1), each would start again.
    actor.published = 1
    stream.version = actor.take_weights(3)
    stream.restart_stale(3)
    metrics = stream.pop_metrics()
    assert metrics["rollout/requests_restarted"] == len(held)
    assert metrics["rollout/tokens_discarded"] == sum(len(r.tokens) for r in held)
    assert all(min(v) >= 1 for v in token_versions(stream.next_batch(2)))


def test_a_checkpoint_keeps_every_answer_in_flight_and_the_resume_goes_on_from_them():
    stream, actor = make_stream(staleness=3)
    stream.next_batch(1)
    actor.published = 1
    stream.next_batch(2)
    state = stream.state()
    saved = {(g["prompts"]["uid"][m], m): r["tokens"]
             for g in state["in_flight"] + state["complete"] for m, r in enumerate(g["responses"])}
    assert state["tokens_held"] == sum(map(len, saved.values())) > 0

    resumed, actor2 = make_stream(staleness=3)  # a new process: a fresh engine and stream
    resumed.load_state(state, same_layout=True)
    actor2.published = 1
    rows = resumed.next_batch(3)
    assert resumed.pop_metrics()["rollout/tokens_resumed"] == state["tokens_held"]
    carried = 0
    for i, uid in enumerate(rows["uid"]):
        if (uid, i % N) in saved:  # an answer the checkpoint held goes on from the tokens saved
            tokens = rows["responses"][i][rows["response_mask"][i].bool()].tolist()
            before = saved[(uid, i % N)]
            assert tokens[: len(before)] == before, (uid, tokens, before)
            carried += len(before)
    assert carried > 0


def test_a_batch_takes_the_answers_the_next_batch_would_restart():
    """Staleness 1: a group holding tokens of version k-2 can land in batch k but not in batch k+1.
    Batch k takes such groups first (before groups that finished sooner and may wait) and waits for
    those still running, rather than leave them to start again with their tokens lost (taking the
    first groups to finish, this run restarted 2 answers at batch 4)."""
    stream, actor = make_stream(staleness=1)
    for batch in range(1, 5):
        rows = stream.next_batch(batch)
        assert min(min(v) for v in token_versions(rows)) >= stream.oldest_allowed(batch)
        held = [g.oldest() for g in (*stream.groups, *stream.complete) if g.oldest() is not None]
        assert min(held, default=batch) >= stream.oldest_allowed(batch + 1), held  # none left for a restart
        actor.published = batch
        for _ in range(2):  # the next version in, between two engine steps, with answers running
            stream.engine_step()
        assert stream.pop_metrics()["rollout/requests_restarted"] == 0, f"batch {batch}"
