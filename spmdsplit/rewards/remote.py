"""A reward server (reward.remote_url): each sample POSTed as JSON, concurrently, the way OpenRLHF's
(`--remote_rm_url`) and slime's (`--rm-url`) reward servers take them.

The request carries both projects' fields, so a server written for either reads what it expects:

    {"prompt": ..., "response": ..., "label": <ground truth>,          slime's (one sample)
     "query": [prompt + response], "prompts": [prompt], "labels": [<ground truth>],   OpenRLHF's (a batch of one)
     "data_source": ..., "ground_truth": ..., "extra_info": {...}}    verl's names

and the answer may be a number, or a JSON object holding the score under "rewards" (OpenRLHF: a
list, its first entry), "reward" or "score" (with other numbers as extras, logged like a custom
function's). A connection that fails, a timeout of one try, 429 or a 5xx is tried again after a
backoff (0.5 s, doubling, at most 8 s; reward.remote_retries more tries); any other status fails at
once. Each try may take its share of reward.timeout_s (the whole sample's bound). What is left after
the tries is the sample's error, with its kind: "unreachable" (no answer), "http_error" (a status),
"timeout", "bad_result" (an answer that is not a score).

aiohttp (the `remote` extra) is imported when a job uses a server, on the reward's event loop, with
one session (its connection pool sized by reward.max_concurrency) per process.
"""

from __future__ import annotations

import asyncio
import json
import numbers
from typing import Any

from spmdsplit.errors import ConfigError

INSTALL = "reward.remote_url needs aiohttp: pip install -e '.[remote]'"
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.5, 8.0


class ServerError(RuntimeError):
    """What a sample's requests ended with; `kind` is its error kind."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def check_installed() -> None:
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise ConfigError(INSTALL) from None


def request_body(sample) -> dict:
    """The JSON a sample is sent as (rewards/calls.py Sample)."""
    truth = jsonable(sample.ground_truth)
    return {"prompt": sample.prompt_str, "response": sample.solution_str, "label": truth,
            "query": [sample.prompt_str + sample.solution_str], "prompts": [sample.prompt_str], "labels": [truth],
            "data_source": sample.data_source, "ground_truth": truth, "extra_info": jsonable(sample.extra_info)}


def jsonable(value: Any) -> Any:
    """`value` as JSON can carry it: numpy arrays and scalars (parquet rows hold them) as lists and
    numbers, anything else unknown as its text."""
    return json.loads(json.dumps(value, default=_fallback))


def _fallback(value: Any) -> Any:
    for method in ("tolist", "item"):
        if callable(getattr(value, method, None)):
            return getattr(value, method)()
    return str(value)


def score_of(answer: Any) -> Any:
    """The score in a server's answer, as rewards/rule.py normalize_result reads it (a number, or
    a dict with "score" and extras); a ServerError of kind bad_result for an answer that holds none."""
    if isinstance(answer, numbers.Real):
        return answer
    if isinstance(answer, dict):
        for key in ("rewards", "reward", "score"):
            if key in answer:
                value = answer[key]
                if key == "rewards" and isinstance(value, list):
                    if len(value) != 1:
                        raise ServerError("bad_result", f"the server answered {len(value)} rewards for one sample")
                    value = value[0]
                extras = {k: v for k, v in answer.items() if k not in ("rewards", "reward", "score")}
                return {**extras, "score": value}
    raise ServerError("bad_result", "the server's answer holds no score (a number, or rewards/reward/score): "
                                    f"{str(answer)[:200]!r}")


class RemoteReward:
    def __init__(self, url: str, retries: int, max_concurrency: int, timeout_s: float):
        self.url, self.retries, self.max_concurrency = url, retries, max_concurrency
        self.try_timeout_s = timeout_s / (retries + 1)
        self._session = None

    async def score(self, sample) -> Any:
        """The sample's score from the server (see the module's docstring); ServerError when the
        tries are spent or the answer is not a score."""
        import aiohttp

        body, backoff, last = request_body(sample), FIRST_BACKOFF_S, None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, MAX_BACKOFF_S)
            try:
                async with self.session().post(self.url, json=body) as response:
                    if response.status in RETRY_STATUSES:
                        last = ServerError("http_error", f"HTTP {response.status} from {self.url}")
                        continue
                    if response.status >= 400:
                        raise ServerError("http_error", f"HTTP {response.status} from {self.url}: "
                                                        f"{(await response.text())[:200]!r}")
                    text = await response.text()
            except aiohttp.ClientError as e:
                last = ServerError("unreachable", f"{self.url}: {type(e).__name__}: {' '.join(str(e).split())}")
                continue
            except asyncio.TimeoutError:
                last = ServerError("timeout", f"{self.url} did not answer within {self.try_timeout_s:.3g} s")
                continue
            try:
                answer = json.loads(text)
            except json.JSONDecodeError:
                raise ServerError("bad_result", f"the server's answer is not JSON: {text[:200]!r}") from None
            return score_of(answer)
        raise ServerError(last.kind, f"{last} (after {self.retries + 1} tries)")

    def session(self):
        """One session per process, made on the loop that uses it."""
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.max_concurrency),
                                                  timeout=aiohttp.ClientTimeout(total=self.try_timeout_s))
        return self._session
