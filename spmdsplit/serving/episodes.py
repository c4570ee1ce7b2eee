"""Episodes over the endpoint: an agent harness that drives the model itself, through the OpenAI
API, trains on what it asked for.

Each episode has an id, and its calls go to the server under `/episodes/<id>/v1/...` (a client's
base_url names it), so the server knows which episode every call belongs to without trusting
anything in the request's body. The server records each call's prompt and completion as token ids
with the engine's log-probs, and the episode's trained rows are built from those records, never
from text read back (token in, token out):

- A call whose prompt extends the previous call's context (prompt + completion) continues that
  call's row: the tokens between (the harness's tool results, user turns, the template's glue)
  join the response masked out, the completion joins it trained. A call that does not extend it
  starts a row of its own (`chain_rows`; the episode counts it).
- A chat call that repeats the episode's last conversation with the completion as the assistant's
  message, then adds messages, is rendered as that call's context (its tokens as sampled) plus the
  template's tokens for what was added (`continue_chat`), so it extends it by construction; a
  harness that edits the history gets the messages rendered whole.
- Each row holds to the episode's token budget (its response, masked tokens included) and the
  episode to its turns: a call over either gets no tokens, finish_reason "length".
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

from spmdsplit.serving.protocol import SENTINEL, template_message


@dataclass
class Row:
    """One trained row of an episode: its prompt (the first call's), its response (completions and
    what came between them), which response tokens the policy sampled, and their log-probs (0
    where it did not)."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # each response token's weights version (continuous generation)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def extend(self, between: list[int], completion: list[int], log_probs: list[float],
               versions: list[int] | None = None) -> None:
        self.response_ids += between + completion
        self.response_mask += [0] * len(between) + [1] * len(completion)
        self.log_probs += [0.0] * len(between) + list(log_probs)
        # What came between was not sampled: it carries the version of the completion after it.
        versions = list(versions) if versions else [0] * len(completion)
        self.versions += (versions[:1] or self.versions[-1:] or [0]) * len(between) + versions


@dataclass
class Call:
    """A call of an episode as the engine ran it (and, for chat, the messages it was asked with)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    log_probs: list[float]
    messages: list[dict] | None = None
    ended_on_eos: bool = False  # its last token is an EOS, which the template writes after a reply too
    versions: list[int] = field(default_factory=list)  # each completion token's weights version
    answer: dict | None = None  # chat: the assistant's message the server answered with


def chain_rows(calls: list[Call]) -> list[Row]:
    """The episode's rows: each call continues the row of the call before it when its prompt starts
    with that row's whole context, else starts a row."""
    rows: list[Row] = []
    for call in calls:
        last = rows[-1] if rows else None
        if last is not None and call.prompt_ids[:len(last.context)] == last.context:
            last.extend(call.prompt_ids[len(last.context):], call.completion_ids, call.log_probs, call.versions)
        else:
            row = Row(list(call.prompt_ids))
            row.extend([], call.completion_ids, call.log_probs, call.versions)
            rows.append(row)
    return rows


def same_reply(message: dict, answer: dict | None) -> bool:
    """Whether a message (as the template takes it: protocol.template_message) repeats the server's
    answer: its text (either side's whitespace aside) and its tool calls (names and arguments; the
    ids are the harness's to keep or not)."""
    if answer is None:
        return False
    answer = template_message(answer, 0)  # its calls' arguments as objects, as the message's are

    def calls(m: dict) -> list:
        return [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
    return (message.get("role") == "assistant" and message["content"].strip() == answer["content"].strip()
            and calls(message) == calls(answer))


def continue_chat(last: Call | None, messages: list[dict], tokenizer, tools: list[dict] | None = None) -> list[int] | None:
    """The prompt ids of a chat call that continues `last`: its context as sampled, then the
    template's tokens for the messages added after the assistant's reply (and the next generation
    prompt). None when `messages` do not repeat `last`'s conversation and its reply, or the
    template does not render the conversation as a prefix of the longer one."""
    if last is None or last.messages is None:
        return None
    k = len(last.messages)
    if len(messages) <= k + 1 or messages[:k] != last.messages or not same_reply(messages[k], last.answer):
        return None
    # The reply's own tokens are the sampled ones (its calls included): the marker stands for all of it.
    marked = [*last.messages, {"role": "assistant", "content": SENTINEL}, *messages[k + 1:]]
    full = tokenizer.apply_chat_template(marked, tools=tools, add_generation_prompt=True, tokenize=False)
    after = full[full.rindex(SENTINEL) + len(SENTINEL):]
    # A completion that ended on an EOS (such as "<|im_end|>") wrote the start of what the template
    # writes after an assistant's content: only the rest is new.
    turn_end = tokenizer.decode(last.completion_ids[-1:], skip_special_tokens=False) if last.ended_on_eos else ""
    if turn_end and after.startswith(turn_end):
        after = after[len(turn_end):]
    return last.prompt_ids + last.completion_ids + tokenizer.encode(after, add_special_tokens=False)


@dataclass
class Episode:
    budget: int  # tokens of a row's response at most
    max_turns: int  # calls at most (0: no limit)
    validate: bool = False  # sampled as the engine's validation settings say
    calls: list[Call] = field(default_factory=list)
    refused: int = 0  # calls answered with no tokens: over the budget or the turns


class UnknownEpisode(KeyError):
    """A call names no episode of the job (or one already closed)."""


class Episodes:
    """The job's open episodes, by id, shared by the server's handlers (any thread) and the code
    that runs the harness."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[str, Episode] = {}
        self._ids = itertools.count()

    def open(self, budget: int, max_turns: int = 0, validate: bool = False) -> str:
        with self._lock:
            episode_id = f"e{next(self._ids)}"
            self._open[episode_id] = Episode(budget, max_turns, validate)
        return episode_id

    def close(self, episode_id: str) -> tuple[list[Row], Episode]:
        """The episode's rows (its calls chained) and its record; later calls naming it are refused."""
        with self._lock:
            episode = self._open.pop(episode_id)
        return chain_rows(episode.calls), episode

    def is_open(self, episode_id: str) -> bool:
        with self._lock:
            return episode_id in self._open

    def get(self, episode_id: str) -> Episode:
        with self._lock:
            episode = self._open.get(episode_id)
        if episode is None:
            raise UnknownEpisode(episode_id)
        return episode

    def prompt_for_chat(self, episode_id: str, messages: list[dict], rendered: list[int], tokenizer,
                        tools: list[dict] | None = None) -> list[int]:
        """The call's prompt: its messages continuing the episode's last call as sampled, where they
        do (continue_chat), else as the template rendered them."""
        episode = self.get(episode_id)
        last = episode.calls[-1] if episode.calls else None
        return continue_chat(last, messages, tokenizer, tools) or rendered

    def room(self, episode_id: str, prompt_ids: list[int], max_tokens: int | None) -> int | None:
        """How many tokens the call may have: `max_tokens` (None: all the room) cut to what its row's
        budget leaves; 0 when the budget or the episode's turns are spent."""
        episode = self.get(episode_id)
        with self._lock:
            if episode.max_turns and len(episode.calls) >= episode.max_turns:
                episode.refused += 1
                return 0
            rows = chain_rows(episode.calls)
            used = 0
            if rows and prompt_ids[:len(rows[-1].context)] == rows[-1].context:
                used = len(prompt_ids) - len(rows[-1].prompt_ids)
            left = max(episode.budget - used, 0)
            if left == 0:
                episode.refused += 1
            return left if max_tokens is None else min(max_tokens, left)

    def record(self, episode_id: str, call: Call) -> None:
        episode = self.get(episode_id)
        with self._lock:
            episode.calls.append(call)

