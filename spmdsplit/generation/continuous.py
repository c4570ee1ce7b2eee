"""Continuous generation (rollout.continuous), on each rank of a rollout pool of its own: the
engine never drains. It holds at least a batch's worth of requests (this rank's share of
data.train_batch_size prompts x rollout.n) and a new prompt's group enters as soon as that many
are no longer running; a batch is handed over as soon as this rank's share of its groups is
complete, in completion order, but for the groups the next batch would not allow (a long answer
begun for this batch and overtaken by shorter ones): the batch takes those first, waiting for the
ones still running, so that they are not started again; new weights are loaded between two engine
steps while the requests go on (their next tokens are the new version's: inference/base.py
StepwiseEngine).

Staleness, per token: every response token records the version of the weights it was sampled with
(`token_weights_version`). Batch k trains update k with the policy of version k-1, and
rollout.staleness=s allows tokens of versions k-1-s .. k-1, as in batch mode. So before the rank
fills batch k it holds at least version k-1-s (waiting for it if it must: the only wait), and a
request that holds a token older than that can never be trained: it starts again from its prompt
(counted in rollout/requests_restarted; the hand-over rule above leaves that only to such answers
beyond what one batch takes). Nothing else is ever restarted or dropped.

Weights arrive when the actor pool has them (WeightsReady, polled between engine steps), not at
fixed points: which engine step takes a version is free-running. The rows are this rank's share
of each batch, as in batch mode (same size, same row order of groups, `row_index` in it), so the
actor pool's side is unchanged but for the token versions it checks.

Agents (rollout.multi_turn): a response is an agent episode (spmdsplit/agent/loop.py), and each of
its turns is one request. When a turn ends with tool calls they start at once, off this thread
(Tools.start), and the episode leaves the engine; other episodes' turns go on meanwhile, and the
next engine step after the calls return submits its next turn (the tool's tokens appended, mask 0,
recorded with the version then held, which no check reads). Nothing waits for a whole turn of
every episode, as batch mode's loop does. An environment's episode (rollout.multi_turn.environment)
is the same, its reset run as the episode's first call and each step as a turn's; a checkpoint
keeps no environment's state, so its episodes still running start again from their prompts.

A harness (rollout.agent.harness) makes its episode's requests itself, through the OpenAI server
(agent/harness.py): the stream starts the episodes, steps the engine for their calls (and between
two steps takes new weights), and hands an episode's row over once its harness returned. An
episode holding a token too old is given up and played again; a checkpoint keeps none running.
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from spmdsplit.agent.harness import HarnessRunner, Playing
from spmdsplit.batch import Batch
from spmdsplit.inference.base import rollout_batch


def padded(rows: list[list], fill, device) -> torch.Tensor:
    """Lists of different lengths as one right-padded tensor (ints: int64; floats: float32)."""
    width = max(len(row) for row in rows)
    return torch.tensor([row + [fill] * (width - len(row)) for row in rows],
                        dtype=torch.float32 if isinstance(fill, float) else torch.int64, device=device)


@dataclass(eq=False)  # compared by identity
class Response:
    """One of a group's responses, as far as it went."""

    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False
    episode: object = None  # agents: the Episode (turns, calls, tool rewards; agent/loop.py); a harness's: Playing, then Ended
    turn_start: int = 0  # agents: tokens[turn_start:] are the turn being generated

    @property
    def first_version(self) -> int | None:
        """The version of its first token (None: none yet); a harness's episode still playing has
        its tokens on the server."""
        if self.versions:
            return self.versions[0]
        return self.episode.first_version() if isinstance(self.episode, Playing) else None


@dataclass(eq=False)
class ToolCalls:
    """An episode's turn's tool calls, running (Tools.start's future)."""

    group: Group
    member: int
    response: Response  # the one that made the calls: if it was restarted since, their answer is dropped
    calls: list
    turn_end: str
    results: concurrent.futures.Future


@dataclass(eq=False)
class Group:
    """One prompt's rollout.n responses: `prompts` are its n collated prompt rows (step_prompts'),
    `contexts` each row's prompt tokens without padding."""

    prompts: Batch
    contexts: list[list[int]]
    seeds: list[int | None]
    responses: list[Response]
    outside: bool = False  # validation's: none of the batches' (`generate`)
    validate: bool = False  # sampled as rollout.val_kwargs

    @property
    def complete(self) -> bool:
        return all(r.finished for r in self.responses)

    def oldest(self) -> int | None:
        versions = [r.first_version for r in self.responses]  # each in the order drawn: its first, its oldest
        return min((v for v in versions if v is not None), default=None)


class ContinuousGeneration:
    """This rank's engine, kept full. `prompts(t)`: this rank's rows of the dataset's generation
    batch t (shares.step_prompts: each prompt rollout.n times, with its seeds); `take_weights(step)`
    loads the next version the actor pool sends and returns it (blocking: sources.ContinuousSource);
    `ready()` says,
    without waiting, whether the actor pool is sending one (weight_sync.WeightsReady). `agent`:
    the agent loop (agent/loop.py AgentLoop) around `engine` with rollout.multi_turn, or a
    harness's server (agent/harness.py HarnessRunner) with rollout.agent.harness."""

    def __init__(self, cfg, engine, prompts: Callable[[int], Batch], take_weights: Callable[[int], int],
                 ready: Callable[[], bool], part: int, parts: int, pad_token_id: int, eos_token_ids: list[int],
                 device: torch.device, agent=None):
        self.cfg, self.engine, self.prompts, self.take_weights, self.ready = cfg, engine, prompts, take_weights, ready
        # A harness's episodes make their calls themselves (the stream steps the engine for them);
        # the agent loop's turns are the stream's requests.
        self.harness = agent if isinstance(agent, HarnessRunner) else None
        self.agent = None if self.harness is not None else agent
        self.n, self.staleness = cfg.rollout.n, cfg.rollout.staleness
        self.budget = cfg.data.max_response_length
        self.quota = cfg.data.train_batch_size // parts  # this rank's groups per batch
        self.part, self.pad_token_id, self.eos_token_ids, self.device = part, pad_token_id, eos_token_ids, device
        self.version = -1  # the weights the engine holds (what take_weights returned)
        self.every = cfg.rollout.version_every_engine_steps  # 0: free-running, else the fixed schedule
        self.clock = 0  # engine steps since the run started (the fixed schedule's clock; idle steps count)
        self.handed: dict[int, int] = {}  # batch -> the clock when it was handed over
        self.filling = 1  # the batch being filled
        self.awaited: int | None = None  # agents: the batch next_batch generates while its caller waits
        self.drawn = 0  # generation batches of prompts drawn from the dataset
        self.waiting: deque[Group] = deque()  # drawn, not yet submitted
        self.groups: list[Group] = []  # submitted, in the order they were drawn
        self.live: dict[str, tuple[Group, int]] = {}  # request id -> (group, member)
        self.complete: list[Group] = []  # every response finished, in completion order
        self.resumed: list[tuple[Group, int]] = []  # responses a checkpoint kept, to submit again
        self.tooling: list[ToolCalls] = []  # agents: episodes whose tool calls run
        self.playing: list[tuple[Group, int]] = []  # a harness's episodes running
        self._ids = itertools.count()
        self.counts = dict(engine_steps=0, live_requests=0, restarted=0, tokens_discarded=0, tokens=0, tokens_resumed=0,
                           steps_with_tools=0, tool_waits=0)

    # ---------------------------------------------------------------- the loop

    def next_batch(self, batch: int) -> Batch:
        """This rank's rows of batch `batch`: its first `quota` groups to complete, generating
        until they have (the engine stepping, weights taken between steps as they come)."""
        self.filling = batch
        while self.version < self.oldest_allowed(batch):  # the only wait: too far ahead of training
            self.wait_for_weights()
        self.restart_stale(batch)
        # Agents: the actor pool waits for this batch, so no episode of a later batch starts meanwhile
        # (admits): their first turns would slow every engine step of this batch's last turns.
        self.awaited = batch if self.agent is not None or self.harness is not None else None
        while not self.batch_ready(batch):
            self.engine_step()
        self.awaited = None
        # The groups the next batch would restart first, then the rest in completion order (a stable sort).
        ordered = sorted(self.complete, key=lambda g: not self.too_old_for(batch + 1, g))
        groups, self.complete = ordered[: self.quota], ordered[self.quota:]
        self.filling = batch + 1
        self.handed[batch] = self.clock
        return self.rows(groups)

    def oldest_allowed(self, batch: int) -> int:
        return max(0, batch - 1 - self.staleness)

    def too_old_for(self, batch: int, group: Group) -> bool:
        oldest = group.oldest()
        return oldest is not None and oldest < self.oldest_allowed(batch)

    def batch_ready(self, batch: int) -> bool:
        """A batch's worth of groups complete, and none still running whose tokens the next batch
        would not allow, unless the batch is full without it: such a group lands in this batch or
        starts again, its tokens lost (a long answer begun for this batch, overtaken by shorter ones
        begun later). Waiting for it costs the hand-over at most the rest of one answer; the engine
        runs on meanwhile."""
        if len(self.complete) < self.quota:
            return False
        last_chance = sum(self.too_old_for(batch + 1, g) for g in self.complete)
        return last_chance >= self.quota or not any(self.too_old_for(batch + 1, g) for g in self.groups)

    def engine_step(self) -> None:
        """One engine step, the engine topped up first and new weights taken if they are there
        (on the fixed schedule: if they are due)."""
        if self.weights_due():
            self.version = self.take_weights(self.filling)
            self.restart_stale(self.filling)
            # Free-running, the caller may have waited for these weights (gen_ahead: the batch it
            # hands over next): it looks first, before new groups come in and a step runs over them.
            # (The fixed schedule steps on: its clock at each hand-over sets when versions are due.)
            if not self.every:
                return
        if self.harness is not None:
            self.harness_step()
            return
        # On the fixed schedule a call's answer lands at the next step, however long it took: the rows
        # do not depend on a tool's latency.
        answered = self.take_tool_results(wait=bool(self.every))
        self.top_up()
        if not self.live:
            if self.tooling:  # only tool calls are out: wait for the first to return
                self.counts["tool_waits"] += 1
                self.take_tool_results(wait=True, first=True)
                return
            if answered:  # the calls' answers ended episodes: the caller may have what it waits for
                return
            self.wait_for_weights()  # every group the staleness allows is generated: wait
            self.restart_stale(self.filling)
            return
        deltas = self.engine.step()
        self.clock += 1
        self.counts["engine_steps"] += 1
        self.counts["live_requests"] += len(self.live)
        self.counts["steps_with_tools"] += bool(self.tooling)
        for delta in deltas:
            group, member = self.live[delta.request_id]
            response = group.responses[member]
            response.tokens += delta.token_ids
            response.log_probs += delta.log_probs
            response.versions += [self.version] * len(delta.token_ids)
            self.counts["tokens"] += len(delta.token_ids)
            if delta.finished:
                del self.live[delta.request_id]
                self.turn_ended(group, member)

    def harness_step(self) -> None:
        """One engine step over the calls a harness's episodes made (the engine topped up first
        with new episodes); the episodes that ended since are done. With no call to step: waits for
        a call or an episode's end, or, with no episode running, for the next weights."""
        self.top_up()
        deltas = self.harness.step(self.version)
        ended = self.take_ended_episodes()
        if deltas is None:
            if ended:
                return
            if self.playing:  # the harnesses are between calls: wait for one (briefly: weights may come)
                self.counts["tool_waits"] += 1
                self.harness.wait(0.05)
                return
            self.wait_for_weights()  # every group the staleness allows is generated: wait
            self.restart_stale(self.filling)
            return
        self.clock += 1
        self.counts["engine_steps"] += 1
        self.counts["live_requests"] += self.harness.held
        self.counts["tokens"] += sum(len(d.token_ids) for d in deltas)

    def take_ended_episodes(self) -> int:
        """The harness's episodes that ended: their rows as the responses, done. Returns how many."""
        ended = [(g, m) for g, m in self.playing if g.responses[m].episode.outcome.done()]
        for group, member in ended:
            self.playing.remove((group, member))
            response = group.responses[member]
            response.episode = self.harness.end(response.episode)
            row = response.episode.rows[0]  # the stream's response: its first row (all of them go out: harness.finish)
            response.tokens, response.log_probs = list(row.response_ids), list(row.log_probs)
            response.versions = list(row.versions) or [self.version]  # an episode that made no call: now
            self.response_done(group, member)
        return len(ended)

    def turn_ended(self, group: Group, member: int) -> None:
        """A request finished: the response is done, or (an agent's) its turn's calls start."""
        response = group.responses[member]
        if self.agent is not None:
            turn = slice(response.turn_start, None)
            calls, turn_end = self.agent.take_turn(response.episode, response.tokens[turn], response.log_probs[turn])
            if calls:
                self.tooling.append(ToolCalls(group, member, response, calls, turn_end, self.agent.start_calls(calls)))
                return
        self.response_done(group, member)

    def response_done(self, group: Group, member: int) -> None:
        group.responses[member].finished = True
        if group.complete and not group.outside:
            self.groups.remove(group)
            self.complete.append(group)

    def take_tool_results(self, wait: bool, first: bool = False) -> int:
        """Tool calls that returned: their answers appended to the episode, and its next turn
        submitted (or the episode ends). `wait`: for every call out (`first`: for one of them).
        Returns how many episodes' calls were answered."""
        if not self.tooling:
            return 0
        if wait:
            concurrent.futures.wait([t.results for t in self.tooling],
                                     return_when=concurrent.futures.FIRST_COMPLETED if first else concurrent.futures.ALL_COMPLETED)
        # One look at each future: a call that returns between two looks would land in neither list, lost.
        returned, running = [], []
        for t in self.tooling:
            (returned if t.results.done() else running).append(t)
        self.tooling = running
        for t in returned:
            response = t.response
            if t.group.responses[t.member] is not response:  # restarted meanwhile (staleness): dropped
                continue
            self.agent.add_responses(response.episode, t.calls, t.results.result(), t.turn_end)
            tool_tokens = response.episode.response_ids[len(response.tokens):]
            response.tokens += tool_tokens
            response.log_probs += [0.0] * len(tool_tokens)
            response.versions += [self.version] * len(tool_tokens)
            if response.episode.done:
                self.response_done(t.group, t.member)
            else:
                response.turn_start = len(response.tokens)
                self.submit(t.group, t.member)
        return len(returned)

    def generate(self, prompts: Batch, validate: bool = False, greedy: bool = False) -> Batch:
        """Rows generated now, beside the requests held, which go on (validation: the engine is
        never drained for it); as an engine's `generate`, so validation.validation_rows
        takes it as its engine."""
        if greedy:
            raise RuntimeError("continuous generation has no greedy baselines (preflight refuses ReMax with it)")
        keep = prompts["attention_mask"].bool()
        group = Group(prompts, [ids[m].tolist() for ids, m in zip(prompts["input_ids"], keep)], [None] * len(prompts),
                      [Response() for _ in range(len(prompts))], outside=True, validate=validate)
        for member in range(len(prompts)):
            self.submit(group, member)
        while not group.complete:
            self.engine_step()
        return self.columns(prompts, group.responses, prompts["input_ids"].device, validate)

    def due(self, version: int) -> int | None:
        """The fixed schedule's engine step for `version`: v*K, or later if batch v (which the
        actor trains to make it) was handed over later; None before that."""
        return max(version * self.every, self.handed[version]) if version in self.handed else None

    def weights_due(self) -> bool:
        if not self.every:
            return self.ready()
        due = self.due(self.version + 1)
        return due is not None and self.clock >= due

    def wait_for_weights(self) -> None:
        """The next version, waiting for it; on the fixed schedule the clock first runs to its step
        (the engine idle), so that nothing depends on when it came."""
        if self.every:
            due = self.due(self.version + 1)
            if due is None:
                raise RuntimeError(f"continuous generation waits for the weights of update {self.version + 1}, "
                                   f"but batch {self.version + 1} was never handed over")
            self.clock = max(self.clock, due)
        self.version = self.take_weights(self.filling)

    def top_up(self) -> None:
        """New groups in while fewer than a batch's worth of requests run (quota x n); first the
        responses a checkpoint kept, where they stopped."""
        for group, member in self.resumed:
            self.submit(group, member)
        self.resumed = []
        # The engine's requests count, not the episodes whose tool calls are out: while they wait, new
        # groups keep the engine busy (how many may be out at once is admits()'s: the staleness).
        while len(self.live) + len(self.playing) < self.quota * self.n and self.admits():
            if not self.waiting:
                self.drawn += 1
                self.waiting.extend(self.split(self.prompts(self.drawn)))
            group = self.waiting.popleft()
            self.groups.append(group)
            for member in range(self.n):
                self.submit(group, member)

    def admits(self) -> bool:
        """Whether a new group may start: the batch it would land in (the groups ahead of it fill
        the batches before) allows tokens of the version held. Generating further ahead would only
        make tokens that staleness restarts; this is the rollout pool's one wait for training."""
        landing = self.filling + (len(self.complete) + len(self.groups)) // self.quota
        if self.awaited is not None and landing > self.awaited:
            return False
        return self.version >= self.oldest_allowed(landing)

    def split(self, prompts: Batch) -> list[Group]:
        groups = []
        for first in range(0, len(prompts), self.n):
            rows = prompts.slice(first, first + self.n)
            keep = rows["attention_mask"].bool()
            contexts = [ids[m].tolist() for ids, m in zip(rows["input_ids"], keep)]
            seeds = rows["sample_seed"].tolist() if "sample_seed" in rows else [None] * self.n
            groups.append(Group(rows, contexts, seeds, [Response() for _ in range(self.n)]))
        return groups

    def submit(self, group: Group, member: int) -> None:
        """The response's request: its prompt and the tokens it has, for the budget left (an agent's:
        its next turn, with the turn's seed and stop tokens)."""
        response = group.responses[member]
        if self.harness is not None:  # its harness makes the requests
            response.episode = self.harness.begin(group.prompts.slice(member, member + 1), group.validate)
            self.playing.append((group, member))
            return
        seed, stop_ids, budget = group.seeds[member], None, self.budget - len(response.tokens)
        if self.agent is not None:
            if response.episode is None:
                response.episode = self.agent.start(group.prompts.slice(member, member + 1))[0]
                response.episode.seed = seed
                opening = self.agent.opening_calls(response.episode)  # an environment's reset, first
                if opening:
                    self.tooling.append(ToolCalls(group, member, response, opening, "", self.agent.start_calls(opening)))
                    return
            seed, stop_ids = self.agent.turn_seed(response.episode), self.agent.turn_stop_ids(response.episode)
            budget = self.agent.turn_budget(response.episode)
        request_id = f"c{next(self._ids)}"
        self.live[request_id] = (group, member)
        self.engine.submit(request_id, group.contexts[member] + response.tokens, budget,
                           seed, validate=group.validate, stop_ids=stop_ids)

    def restart_stale(self, batch: int) -> None:
        """Responses holding a token older than batch `batch` allows start again from their prompt
        (a later batch allows even less): complete groups waiting to be handed over included."""
        allowed = self.oldest_allowed(batch)
        stale_live = [rid for rid, (g, m) in self.live.items()
                      if not g.outside and g.responses[m].versions and g.responses[m].versions[0] < allowed]
        if stale_live:
            self.engine.abort(stale_live)
        restart = [(self.live.pop(rid)) for rid in stale_live]
        for group in list(self.complete):
            if self.too_old_for(batch, group):
                self.complete.remove(group)
                self.groups.append(group)
        for group in self.groups:
            for member, response in enumerate(group.responses):
                first = response.first_version
                if first is not None and first < allowed and (group, member) not in restart:
                    restart.append((group, member))
        self.resumed = [(g, m) for g, m in self.resumed if not any(g is rg and m == rm for rg, rm in restart)]
        for group, member in restart:
            response = group.responses[member]
            if (group, member) in self.playing:  # a harness's episode still running: given up
                self.playing.remove((group, member))
                self.harness.cancel(response.episode)
            self.counts["restarted"] += 1
            self.counts["tokens_discarded"] += len(response.tokens)
            group.responses[member] = Response()
            self.submit(group, member)

    # ---------------------------------------------------------------- the rows

    def rows(self, groups: list[Group]) -> Batch:
        """The groups as rollout rows: verl's columns (inference/base.py rollout_batch), the engine's
        log-probs, each token's version, each row's oldest version (`weights_version`, which the
        actor checks against the staleness bound), and `row_index`: the row's place in the batch."""
        prompts = Batch.concat([g.prompts for g in groups])
        responses = [r for g in groups for r in g.responses]
        rows = self.columns(prompts.to(self.device), responses, self.device)
        if "token_weights_version" not in rows:  # else a harness's episodes made several rows, each with its own
            rows["token_weights_version"] = padded([r.versions for r in responses], 0, self.device)[:, : rows["responses"].shape[1]]
            rows["weights_version"] = torch.tensor([min(r.versions) for r in responses], dtype=torch.int64,
                                                   device=self.device)
        first = self.part * len(rows)  # every generating rank hands over as many rows
        rows["row_index"] = torch.arange(first, first + len(rows), dtype=torch.int64, device=self.device)
        return rows

    def columns(self, prompts: Batch, responses: list[Response], device, validate: bool = False) -> Batch:
        """verl's columns of the responses with the engine's log-probs (an agent's: its episodes',
        tool tokens masked, as batch mode's loop gives them)."""
        if self.agent is not None or self.harness is not None:
            return (self.agent or self.harness).finish(prompts, [r.episode for r in responses], validate)
        return rollout_batch(prompts, padded([r.tokens for r in responses], self.pad_token_id, device),
                             self.pad_token_id, self.eos_token_ids,
                             {"rollout_log_probs": padded([r.log_probs for r in responses], 0.0, device)})

    # ---------------------------------------------------------------- checkpoints

    def state(self) -> dict:
        """Everything drawn and not handed over: the groups waiting, in flight (each response's
        tokens, log-probs and versions so far) and complete; how many prompt batches were drawn.
        Agents' tool calls out are waited for first (their answers appended, the next turns
        submitted): a call is never run twice, nor its answer lost."""
        self.take_tool_results(wait=True)
        agent = self.agent or self.harness

        def resumable(r: Response) -> bool:
            return agent is None or agent.resumable(r.episode)

        def group(g: Group) -> dict:
            return {"prompts": g.prompts.to("cpu"), "contexts": g.contexts, "seeds": g.seeds,
                    "responses": [vars(r if resumable(r) else Response()) for r in g.responses]}

        # The order the engine holds them in (an HF step batches its requests in that order): a
        # resume submits them again in it (a harness's episodes running: from their prompts).
        running = [(self.groups.index(g), m) for g, m in [*self.live.values(), *self.resumed, *self.playing]]
        # A complete group holding an episode that cannot be kept (a TRL-style environment's, whose
        # reward is read from its instance at the hand-over) goes back in flight: those episodes
        # start again from their prompt at the resume, the others stay as they finished.
        redo = [g for g in self.complete if not all(resumable(r) for r in g.responses)]
        for k, g in enumerate(redo):
            running += [(len(self.groups) + k, m) for m, r in enumerate(g.responses) if not resumable(r)]
        in_flight = [group(g) for g in [*self.groups, *redo]]
        complete = [group(g) for g in self.complete if g not in redo]
        return {"drawn": self.drawn, "clock": self.clock, "handed": dict(self.handed), "running": running,
                "waiting": [group(g) for g in self.waiting], "in_flight": in_flight, "complete": complete,
                "tokens_held": sum(len(r["tokens"]) for g in (*in_flight, *complete) for r in g["responses"])}

    def load_state(self, state: dict, same_layout: bool) -> None:
        """What `state` kept, the unfinished responses submitted again at the first engine step
        (prompt and tokens so far as the context, the budget left). Another rollout pool size
        shares the prompts out otherwise: then generation starts after the batches drawn, and
        the responses held are dropped (reported)."""
        def group(d: dict) -> Group:
            return Group(d["prompts"].to(self.device), d["contexts"], d["seeds"], [Response(**r) for r in d["responses"]])

        self.drawn, self.clock, self.handed = state["drawn"], state["clock"], dict(state["handed"])
        if not same_layout:
            print(f"[rollout] resumed on another layout: {state['tokens_held']} generated tokens in flight dropped",
                  flush=True)
            return
        self.waiting = deque(group(d) for d in state["waiting"])
        self.groups = [group(d) for d in state["in_flight"]]
        self.complete = [group(d) for d in state["complete"]]
        self.resumed = [(self.groups[g], m) for g, m in state["running"]]
        self.counts["tokens_resumed"] = state["tokens_held"]  # reported with the first batch after it

    def pop_metrics(self) -> dict[str, float]:
        """Since the last call: engine steps, mean requests running per step (occupancy),
        responses restarted for staleness and the tokens they dropped, tokens generated, and the
        tokens a checkpoint kept in flight that this run goes on from (after a resume)."""
        c, steps = self.counts, max(self.counts["engine_steps"], 1)
        metrics = {"rollout/engine_steps": c["engine_steps"], "rollout/occupancy": c["live_requests"] / steps,
                   "rollout/requests_restarted": c["restarted"], "rollout/tokens_discarded": c["tokens_discarded"],
                   "rollout/tokens_generated": c["tokens"], "rollout/tokens_resumed": c["tokens_resumed"]}
        if self.agent is not None or self.harness is not None:  # how much tool time the engine ran through, and how often it only waited for tools
            metrics.update({"rollout/engine_steps_during_tools": c["steps_with_tools"],
                            "rollout/tool_waits": c["tool_waits"]})
        self.counts = dict.fromkeys(c, 0)
        return metrics
