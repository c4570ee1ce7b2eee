"""Multi-turn, tool-using rollouts (agents), run by the rollout group in every placement.

- tools.py: the tools, as users write them for verl (a function, or a class with create /
  execute / calc_reward / release), loaded from verl's tool-config YAML, run concurrently;
- parsers.py: how calls are read out of a turn (Hermes by default; compact for the embedded model);
- chat.py: the tokens of tool responses, from the model's own chat template;
- environments.py: gym-style environments (reset / step) as episodes; trl_env.py: classes written for
  TRL's environment_factory, whose public methods are the episode's tools;
- loop.py: the agent loop around an engine (HF or vLLM), token in, token out.
"""

from __future__ import annotations

import functools
import json
import os

from omegaconf import OmegaConf

from spmdsplit.data.parquet import ENVIRONMENT_AGENT

# verl's agent_name values, and ours for an environment's episodes (rollout.multi_turn.environment)
AGENTS = ("single_turn_agent", "tool_agent", ENVIRONMENT_AGENT)
LOOKUP_TOOLS = os.path.join(os.path.dirname(__file__), "lookup_tools.yaml")  # the embedded task's tool config
ECHO_ENVIRONMENT = "spmdsplit.agent.echo.EchoDigits"  # the embedded echo task's environment


def environment_path(cfg) -> str:
    """rollout.multi_turn.environment, or the embedded echo task's own when it is empty and that
    task is the data."""
    path = cfg.rollout.multi_turn.environment
    if not path and not cfg.data.train_files and cfg.data.task == "echo" and not cfg.rollout.agent.harness:
        return ECHO_ENVIRONMENT
    return path


def default_agent(cfg) -> str:
    """The agent of rows without agent_name: an environment's, when the job has one."""
    return ENVIRONMENT_AGENT if environment_path(cfg) else cfg.rollout.agent.default_agent_loop


def load_job_environments(cfg):
    """The job's environments (None without one); a bad environment raises ToolConfigError."""
    if not cfg.rollout.multi_turn.enable or not environment_path(cfg):
        return None
    m = cfg.rollout.multi_turn
    kwargs = json.dumps(OmegaConf.to_container(m.environment_kwargs) if OmegaConf.is_config(m.environment_kwargs)
                        else dict(m.environment_kwargs or {}), sort_keys=True)
    return _load_environments(environment_path(cfg), kwargs, m.environment_action_field, m.tool_timeout_s,
                              m.max_tool_response_length, m.tool_response_truncate_side, m.environment_style)


@functools.lru_cache(maxsize=None)
def _load_environments(path: str, kwargs_json: str, action_field: str, timeout_s: float, max_text_chars: int,
                       truncate_side: str, style: str = "auto"):
    """Loaded once per process, like the tools: the check before the first collective and the
    engine's agent loop share them (the constructor's probe runs once)."""
    from spmdsplit.agent.environments import SETTING, Environments, load_environment
    from spmdsplit.agent.tools import import_target
    from spmdsplit.agent.trl_env import is_trl_style, load_trl_environments

    target = import_target(path, f"{SETTING}={path}")
    if is_trl_style(target, style):
        return load_trl_environments(target, path, json.loads(kwargs_json), timeout_s=timeout_s,
                                     max_text_chars=max_text_chars, truncate_side=truncate_side)
    factory = load_environment(path, json.loads(kwargs_json), action_field)
    return Environments(factory, timeout_s=timeout_s, max_text_chars=max_text_chars, truncate_side=truncate_side,
                        action_field=action_field)


def tool_config_path(cfg) -> str:
    """rollout.multi_turn.tool_config_path, or the embedded lookup task's own when it is empty and
    that task is the data (not the echo task's: its environment's tools, if it has any, are the
    ones its calls are read against)."""
    path = cfg.rollout.multi_turn.tool_config_path
    if not path and not cfg.data.train_files and cfg.data.task == "lookup":
        return LOOKUP_TOOLS
    return path


def load_job_tools(cfg):
    """The job's tools (None without multi-turn); a bad tool config raises ToolConfigError, a
    one-line message the launcher shows without a traceback."""
    if not cfg.rollout.multi_turn.enable:
        return None
    m = cfg.rollout.multi_turn
    return _load_tools(tool_config_path(cfg), m.tool_timeout_s, m.max_tool_response_length, m.tool_response_truncate_side)


@functools.lru_cache(maxsize=None)
def _load_tools(path: str, timeout_s: float, max_response_chars: int, truncate_side: str):
    """Loaded once per process: the check before the first collective (check_multi_turn) and the
    engine's agent loop (build_agent_rollout) share the instances, so a tool's constructor (a
    client, an index) runs once on a generating rank."""
    from spmdsplit.agent.tools import Tools, load_tools

    if not path:
        return Tools([], timeout_s=timeout_s, max_response_chars=max_response_chars, truncate_side=truncate_side)
    return load_tools(path, timeout_s=timeout_s, max_response_chars=max_response_chars, truncate_side=truncate_side)


def environment_tools(cfg) -> list[dict] | None:
    """The tool schemas of the job's environment's episodes: a TRL-style environment's methods;
    None for a gym-style environment or none."""
    environments = load_job_environments(cfg)
    return getattr(environments, "schemas", None)


def call_schemas(cfg) -> list[dict]:
    """The tools a turn's calls are read against: the tool config's, then a TRL-style environment's."""
    return load_job_tools(cfg).schemas + (environment_tools(cfg) or [])


def check_multi_turn(cfg, tokenizer):
    """What would fail only mid-rollout, checked on every rank before the first collective: the
    tool config (a missing module or class), the call format, a tokenizer without a chat
    template. Returns the loaded tools (None without multi-turn)."""
    from spmdsplit.agent.chat import ToolChat
    from spmdsplit.agent.parsers import build_parser
    from spmdsplit.agent.tools import ToolConfigError
    from spmdsplit.errors import ConfigError

    if not cfg.rollout.multi_turn.enable:
        if environment_path(cfg):
            what = (f"rollout.multi_turn.environment={cfg.rollout.multi_turn.environment}"
                    if cfg.rollout.multi_turn.environment else "data.task=echo")
            raise ConfigError(f"{what}: an environment's episodes are multi-turn; set rollout.multi_turn.enable=true")
        return None
    try:
        tools = load_job_tools(cfg)
        parser = build_parser(cfg.rollout.multi_turn.format, call_schemas(cfg))
        chat = ToolChat(tokenizer)
        if load_job_environments(cfg) is not None:
            chat.opening_ids("x")  # a template that re-renders the first message cannot open an episode
    except (ToolConfigError, ValueError) as e:
        raise ConfigError(str(e)) from None
    unknown = [t for t in parser.stop_tokens if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
    if unknown:
        raise ConfigError(f"rollout.multi_turn.format={cfg.rollout.multi_turn.format}: the call format ends a turn "
                          f"with {unknown}, which the tokenizer of model.path has no single token for")
    return tools


def attach_tools(rows: list[dict], schemas: list[dict], default_agent: str, key: str,
                 environment_schemas: list[dict] | None = None) -> None:
    """Each row's agent (its agent_name, or rollout.agent.default_agent_loop) and the tool schemas
    its prompt is rendered with: a tool agent's row the tool config's, an environment's row its
    environment's (a TRL-style one's methods; None for a gym-style one)."""
    from spmdsplit.data.parquet import DataError

    unknown = [i for i, r in enumerate(rows) if (r.get("agent_name") or default_agent) not in AGENTS]
    if unknown:
        names = sorted({rows[i].get("agent_name") for i in unknown})
        raise DataError(f"{key}: {len(unknown)} row(s) have an agent_name this trainer does not run: {names} "
                        f"(rows {unknown[:5]}); expected one of {list(AGENTS)}")
    if default_agent != ENVIRONMENT_AGENT and any(r.get("agent_name") == ENVIRONMENT_AGENT for r in rows):
        raise DataError(f"{key}: rows name agent_name={ENVIRONMENT_AGENT}, but the job has no environment: set "
                        f"rollout.multi_turn.environment")
    for r in rows:
        r["agent_name"] = r.get("agent_name") or default_agent
        r["tools"] = (schemas if r["agent_name"] == "tool_agent" else
                      environment_schemas if r["agent_name"] == ENVIRONMENT_AGENT else None)


def load_harness(cfg):
    """rollout.agent.harness's function; a ToolConfigError (one line naming the key) if it cannot be
    one: not importable, not callable, or taking neither (client, row) nor (base_url, row)."""
    import inspect

    from spmdsplit.agent.harness import SETTING
    from spmdsplit.agent.tools import ToolConfigError, import_target
    from spmdsplit.agent.verifiers_env import is_verifiers, load_verifiers_harness

    if is_verifiers(cfg.rollout.agent.harness):
        return load_verifiers_harness(cfg)
    where = f"{SETTING}={cfg.rollout.agent.harness}"
    fn = import_target(cfg.rollout.agent.harness, where)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        raise ToolConfigError(f"{where}: expected a function (client, row) or (base_url, row)") from None
    if len(params) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise ToolConfigError(f"{where}: it takes {len(params)} arguments; a harness takes (client, row) or (base_url, row)")
    return fn


def check_harness(cfg) -> None:
    """rollout.agent.harness on every rank before the first collective: its function, and the
    setting it does not run with, its port."""
    from spmdsplit.errors import ConfigError

    if not cfg.rollout.agent.harness:
        return
    # (Continuous generation refuses a tensor-parallel engine for every rollout: preflight.py.)
    if cfg.rollout.multi_turn.enable:
        raise ConfigError(f"rollout.agent.harness={cfg.rollout.agent.harness} does not run with "
                          "rollout.multi_turn.enable=true (the harness drives the turns itself)")
    load_harness(cfg)
    check_harness_ports(cfg)


def check_harness_ports(cfg) -> None:
    """rollout.agent.port's port for this rank free on 127.0.0.1, before the first collective (a
    port taken later still fails at start-up, with PortInUse)."""
    import errno
    import socket

    from spmdsplit.agent.harness import endpoint_port
    from spmdsplit.errors import ConfigError

    port = endpoint_port(cfg.rollout.agent.port, local_rank())
    if not port:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as e:
            taken = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            raise ConfigError(f"rollout.agent.port={cfg.rollout.agent.port}: 127.0.0.1:{port}, the endpoint of "
                              f"local rank {local_rank()}, {taken}; 0 takes any free port") from None


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def build_agent(cfg, engine, tokenizer, eos_ids: list[int]):
    """What drives the engine through a batch's episodes: the harness (rollout.agent.harness), the
    agent loop (rollout.multi_turn.enable), or None (the engine generates alone)."""
    if cfg.rollout.agent.harness:
        return build_harness_rollout(cfg, engine, tokenizer)
    if cfg.rollout.multi_turn.enable:
        return build_agent_rollout(cfg, engine, tokenizer, eos_ids)
    return None


def build_harness_rollout(cfg, engine, tokenizer):
    from spmdsplit.agent.harness import HarnessRunner, endpoint_port

    return HarnessRunner(engine, tokenizer, load_harness(cfg), cfg.rollout.agent, cfg.data.max_response_length,
                         cfg.rollout.multi_turn.max_assistant_turns or 0, sampling=cfg.rollout,
                         val_sampling=cfg.rollout.val_kwargs, stepped=cfg.rollout.continuous,
                         tool_format=cfg.rollout.multi_turn.format,
                         port=endpoint_port(cfg.rollout.agent.port, local_rank()), **engine_ranks(engine))


def engine_ranks(engine) -> dict:
    """A tensor-parallel engine's group of ranks and whether this is its first (the harness runs
    there): `peers` and `first` for HarnessRunner; nothing for an engine of one rank."""
    group = getattr(engine, "tensor_parallel_group", lambda: None)()
    return {} if group is None else {"peers": group.cpu_group, "first": group.is_first_rank}


def build_agent_rollout(cfg, engine, tokenizer, eos_ids: list[int]):
    from spmdsplit.agent.loop import AgentLoop
    from spmdsplit.agent.parsers import build_parser

    tools = load_job_tools(cfg)
    # An engine whose ranks generate in lockstep (vLLM) runs each turn's tool calls and environment
    # steps on its first rank only.
    return AgentLoop(engine, tokenizer, eos_ids, tools, build_parser(cfg.rollout.multi_turn.format, call_schemas(cfg)),
                     cfg.rollout.multi_turn, cfg.data.max_response_length, default_agent(cfg),
                     run_once=getattr(engine, "run_on_first_rank", None),
                     environments=load_job_environments(cfg), seed=cfg.trainer.seed)
