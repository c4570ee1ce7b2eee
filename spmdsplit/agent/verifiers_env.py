"""verifiers v1 environments (PrimeIntellect's `verifiers`, 0.4) trained through the endpoint:
`rollout.agent.harness=verifiers:<env>` names one, and each prompt row becomes one episode of it,
played by the environment's own agent harness against the rank's served engine
(spmdsplit/agent/harness.py), scored by its task's rewards.

    rollout.agent.harness=verifiers:my_env              # an installed environment (taskset) package
    rollout.agent.harness=verifiers:path/to/my_env.py   # or a file: its folder joins sys.path
    rollout.agent.verifiers_env_kwargs={taskset: {...}, agent: {runtime: {type: subprocess}}}

`<env>` is what `vf-eval` takes as the taskset id (verifiers' loader imports it and takes the
Taskset its `__all__` exports, the Harness it exports as the agent's default, an Env subclass if
it has one); the kwargs are the rest of verifiers' EnvConfig (`[env]` in its TOML).

The path called, once per episode, on the harness's event loop (verifiers 0.4.0 source):
`Env.run_episode(task, ModelContext(model, client))` runs `setup()`, then `run()` (one agent for
a plain taskset: SingleAgentEnv), whose agent provisions the harness's runtime, points the
harness program at an interception server (started once, by `Env.serving()`), which forwards each
of its model calls to `client` (an EvalClientConfig: the body passed on unchanged, here to the
episode's base_url), then scores the finished trace with the task's `@vf.reward` methods (and
plugged judges): `Trace.reward` is their weighted sum; then `finalize()`. The episode's reward is
the sum over its traces (one for a single-agent env); an episode that failed (`errors`: the
harness program, its runtime, a reward that raised) raises here, so it scores 0 and is counted
as a harness's exception is.

Each row's task is the taskset's task type built from the row (`row_task_data`), not read from
the taskset's own `load()`: the job's data decides what is played, as for every other harness.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import sys
from typing import Any

SCHEME = "verifiers:"
SETTING = "rollout.agent.harness"
KWARGS = "rollout.agent.verifiers_env_kwargs"
MODEL = "policy"  # the served model's name (spmdsplit/serving)
# verifiers' client config reads its key from this variable ("EMPTY" when unset): a name of our
# own, so its default (PRIME_API_KEY) never sends a Prime key to the local endpoint.
API_KEY_VAR = "SPMDSPLIT_VERIFIERS_API_KEY"


def is_verifiers(harness: str) -> bool:
    return isinstance(harness, str) and harness.startswith(SCHEME)


def environment_id(spec: str) -> str:
    """The id verifiers imports for `spec`: an id as it is; a .py file or a package folder as its
    name, its parent folder put first on sys.path (verifiers imports ids as top-level modules:
    a dotted one would be looked up inside its own package and not found)."""
    path = spec[:-1] if spec.endswith("/") else spec
    if path.endswith(".py") or os.path.isdir(path):  # not any "/": a Hub id is owner/name[@version]
        folder, name = os.path.split(os.path.abspath(path))
        if not os.path.exists(path):
            raise FileNotFoundError(f"no such file or folder: {path}")
        if folder not in sys.path:
            sys.path.insert(0, folder)
        return name[:-3] if name.endswith(".py") else name
    return spec


def kwargs_dict(kwargs) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(kwargs, resolve=True) if OmegaConf.is_config(kwargs) else dict(kwargs or {})


def load_verifiers_harness(cfg):
    """The harness function of rollout.agent.harness=verifiers:<env>; a ToolConfigError (one line
    naming the key) when verifiers is not installed or the environment cannot be loaded."""
    spec = cfg.rollout.agent.harness[len(SCHEME):]
    kwargs = kwargs_dict(cfg.rollout.agent.verifiers_env_kwargs)
    return VerifiersHarness(_load_env(spec, json.dumps(kwargs, sort_keys=True)))


@functools.lru_cache(maxsize=None)
def _load_env(spec: str, kwargs_json: str):
    """The environment, built once per process: the check before the first collective and the
    rollout share it (its taskset's constructor may read data)."""
    from spmdsplit.agent.tools import ToolConfigError

    where = f"{SETTING}={SCHEME}{spec}"
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ToolConfigError(f"{where}: verifiers is not installed ({e}); tools/setup/setup_cpu.sh "
                              f"shows how to install it next to spmdsplit's packages") from None
    if not spec:
        raise ToolConfigError(f"{where}: name an environment (its taskset id), e.g. verifiers:my_env")
    kwargs = json.loads(kwargs_json)
    try:
        env_id = environment_id(spec)
        taskset = kwargs.pop("taskset", None) or {}
        if not isinstance(taskset, dict):
            raise ValueError(f"{KWARGS}.taskset must be a mapping, not {taskset!r}")
        config = vf.resolve_env_config({**kwargs, "taskset": {**taskset, "id": env_id}})
        return vf.load_environment(config)
    except Exception as e:  # noqa: BLE001 - whatever loading raised, the job stops in one line
        message = " ".join(str(e).split())  # pydantic's errors span lines
        raise ToolConfigError(f"{where} (with {KWARGS}): {type(e).__name__}: {message}") from None


def row_task_data(data_type, row: dict) -> dict:
    """The fields of the taskset's TaskData for a verl-style row: `extra_info`'s keys that name
    one of its fields (verl's preprocessing puts a row's own data there), then `answer` from the
    row's ground_truth and `info` from its extra_info (the names verifiers' tasksets use), where
    the type has them and extra_info did not fill them; `prompt` from extra_info, else the row's
    prompt text: as the data has it for a plain-text prompt, but rendered by the chat template
    for chat messages (the harness is given the text its tokens decode to)."""
    fields = data_type.model_fields
    info = row.get("extra_info") or {}
    data = {k: v for k, v in info.items() if k in fields and k != "idx"}  # idx: verifiers numbers its own
    if "answer" in fields and "answer" not in data and row.get("ground_truth") not in (None, ""):
        data["answer"] = row["ground_truth"]
    if "info" in fields and "info" not in data:
        data["info"] = info
    data.setdefault("prompt", row.get("prompt"))
    return data


class VerifiersHarness:
    """A harness (base_url, row) that plays one episode of the environment per row."""

    def __init__(self, env):
        self.env = env
        self.task_type = type(env.taskset).task_type()
        self._serving: contextlib.AsyncExitStack | None = None
        self._lock: asyncio.Lock | None = None

    async def __call__(self, base_url: str, row: dict) -> dict:
        import verifiers.v1 as vf

        await self._serve()
        task = self.task_type(self.task_type.data_type().model_validate(row_task_data(self.task_type.data_type(), row)),
                              self.env.taskset.config.task)
        client = vf.EvalClientConfig(base_url=base_url, api_key_var=API_KEY_VAR)
        episode = await self.env.run_episode(task, vf.ModelContext(model=MODEL, client=client))
        if not episode.ok:  # set once both hooks ran and every trace is ok
            raise RuntimeError(f"the episode failed: {_first_error(episode)}")
        return {"reward": sum(t.reward for t in episode.traces)}

    async def _serve(self) -> None:
        """The environment's serving resources (its interception server, shared tool servers),
        started at the first episode on the harness's loop and held while the process lives:
        verifiers' own runners hold them for a whole run the same way."""
        if self._serving is not None:
            return
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            if self._serving is None:
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(self.env.serving())
                self._serving = stack


def _first_error(episode) -> str:
    errors: list[Any] = list(episode.errors) + [e for t in episode.traces for e in (getattr(t, "errors", None) or [])]
    if errors:
        e = errors[0]
        return f"{getattr(e, 'type', '')}: {' '.join(str(getattr(e, 'message', e)).split())}"[:500]
    return "no trace" if not episode.traces else "a trace is not ok"
