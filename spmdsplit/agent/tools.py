"""The tools a multi-turn (agentic) rollout calls, written the way verl users write them.

`rollout.multi_turn.tool_config_path` names verl's tool YAML: a `tools:` list whose entries name a
verl-style tool class (create/execute/calc_reward/release, `def` or `async def`) or a plain function,
as `pkg.mod.Name` or `path/to/file.py:Name`. verl is never imported: a tool ported from verl changes
its `verl.tools.base_tool` import to this module. Why it is shaped so:
- Every rank loads the config before anything distributed happens, so a bad entry is a one-line
  ToolConfigError (a ConfigError, shown without a traceback) on every rank, never a hang.
- Tools are user code: an exception, a hang, bad arguments or a non-text answer never escapes
  `Tools.run`; it becomes an error text the model reads next and an error kind the caller counts.
- Tool calls mostly wait (HTTP, sandboxes), so one `run` starts all its calls at once on the tools'
  event loop (spmdsplit/usercode.py, where all user code runs): an `async def` method there, a sync one
  in a fresh daemon thread; a call's steps (create to calc_reward) are bounded together by the timeout.

Function tools are called as `fn(**arguments)`. Per-row data (`extra_info.tools_kwargs[name]`, e.g. a
secret) reaches them by one rule: the row's create_kwargs merged with its execute_kwargs (execute's
win), minus the schema's parameters, passed by keyword: all of it if `fn` takes **kwargs, else only
the keys `fn` names as parameters. The model's own arguments are never overridden. (transformers puts
every parameter of `fn` in the schema it builds, so a function taking row data needs a `tool_schema`.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import yaml

from spmdsplit.config import TRUNCATE_SIDES  # verl's meaning: the side KEPT ("middle": both ends)
from spmdsplit.errors import ConfigError
from spmdsplit.usercode import TIMEOUT, UserCode, error_line

SETTING = "rollout.multi_turn.tool_config_path"
ERROR_KINDS = ("bad_call", "unknown_tool", "bad_arguments", "exception", "timeout", "not_text")
CUT = "...[truncated]..."
_ENTRY_KEYS = ("class_name", "function", "config", "tool_schema")
# Checked in this order, so a bool is named "boolean" and never passes as "integer" or "number".
_JSON_TYPES = {"boolean": bool, "integer": int, "number": (int, float), "string": str, "array": list,
               "object": dict, "null": type(None)}


class ToolConfigError(ConfigError):
    """A tool config entry that cannot work; one line naming the file, the entry and what was expected."""


@dataclass
class ToolResponse:
    """A tool's answer, with verl's ToolResponse fields (images and videos are not supported)."""
    text: str | None = None
    image: Any = None
    video: Any = None


@dataclass
class Call:
    """One tool call of one episode's turn, as the parser produced it."""
    name: str
    arguments: dict | None  # None when the parser could not read them
    row_kwargs: dict = field(default_factory=dict)  # the row's extra_info.tools_kwargs
    parse_error: str = ""  # the parser's complaint: no tool runs, the model sees it


@dataclass
class ToolResult:
    text: str  # what the model sees next (a response or an error message), already truncated
    reward: float = 0.0  # execute's step reward (0.0 on error)
    score: float | None = None  # calc_reward's value (None on error and for function tools)
    error: str = ""  # "" or one of ERROR_KINDS
    truncated: bool = False
    seconds: float = 0.0


class ToolSchema(dict):
    """An OpenAI function schema in place of verl's pydantic OpenAIFunctionToolSchema: a dict whose nested
    dicts are ToolSchemas too, readable as attributes (`s.function.name`) where no dict method has the
    name (so `prop["items"]`, not `prop.items`)."""

    def __init__(self, data: dict):
        super().__init__({k: _wrap(v) for k, v in data.items()})

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"tool schema has no {name!r}") from None

    def model_dump(self, **_: Any) -> dict:
        """The plain dict; pydantic's exclude_* options have nothing to drop here."""
        return _wrap(self, plain=True)

    to_dict = model_dump


def _wrap(value: Any, plain: bool = False) -> Any:
    if isinstance(value, dict):
        inner = {k: _wrap(v, plain) for k, v in value.items()}
        return inner if plain else ToolSchema(inner)
    return [_wrap(v, plain) for v in value] if isinstance(value, list) else value


class BaseTool:
    """verl's BaseTool interface and defaults. One instance serves every episode; `instance_id` keeps
    their states apart. Without a tool_schema, `get_openai_tool_schema()` must return one."""

    def __init__(self, config: dict, tool_schema: Any = None):
        self.config = config
        schema = tool_schema if tool_schema is not None else self.get_openai_tool_schema()
        if schema is None:
            raise ValueError(f"{type(self).__name__} has no tool_schema (give one or override get_openai_tool_schema)")
        self.tool_schema = ToolSchema(_plain_schema(schema))
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> Any:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        return instance_id or str(uuid.uuid4()), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict, **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None


@dataclass
class Tool:
    """One loaded tool: its name, its plain OpenAI schema, and a verl-style instance or a function."""
    name: str
    schema: dict
    target: Any
    is_function: bool
    row_keys: frozenset | None = frozenset()  # the row kwargs a function takes; None: any (**kwargs)


def make_tool(target: Any, schema: Any = None) -> Tool:
    """A Tool from a verl-style instance (schema from get_openai_tool_schema() if not given) or a function
    (schema from its type hints and Google-style docstring, by transformers); ValueError if neither."""
    if inspect.isclass(target) or not callable(target) and not hasattr(target, "execute"):
        got = "a class (pass an instance)" if inspect.isclass(target) else type(target).__name__
        raise ValueError(f"expected a tool or a function, got {got}")
    if hasattr(target, "execute"):
        schema = _plain_schema(schema if schema is not None else getattr(target, "get_openai_tool_schema", dict)())
        return Tool(schema["function"]["name"], schema, target, False)
    if schema is None:
        from transformers.utils import get_json_schema  # imported here: it takes a second
        try:
            schema = get_json_schema(target)
        except Exception as e:
            raise ValueError(f"cannot build a schema for {getattr(target, '__name__', target)}() from its type hints "
                             f"and Google-style docstring ({error_line(e)}); fix them or give tool_schema") from None
    schema = _plain_schema(schema)
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature: they get no row kwargs
        params = []
    named = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    any_key = any(p.kind is p.VAR_KEYWORD for p in params)
    return Tool(schema["function"]["name"], schema, target, True, None if any_key else named)


def _plain_schema(schema: Any) -> dict:
    if hasattr(schema, "model_dump"):  # a ToolSchema, or a pydantic model from a tool written for verl
        schema = schema.model_dump(exclude_unset=True, exclude_none=True)
    function = schema.get("function") if isinstance(schema, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"tool_schema: expected an OpenAI function schema with function.name, got {str(schema)[:80]}")
    return {"type": "function", **copy.deepcopy(schema)}


def load_tools(path: str, setting: str = SETTING, *, timeout_s: float = 30.0, max_response_chars: int = 256,
               truncate_side: str = "middle") -> Tools:
    """The tools of a verl-format tool YAML; ToolConfigError (one line) for anything that cannot work."""
    where = f"{setting}={path}"
    if not os.path.isfile(path):
        raise ToolConfigError(f"{where}: no such file")
    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ToolConfigError(f"{where}: not valid YAML ({error_line(e)})") from None
    entries = doc.get("tools") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ToolConfigError(f"{where}: expected a YAML mapping with a non-empty `tools:` list, got {str(doc)[:80]}")
    tools: list[Tool] = []
    for i, entry in enumerate(entries):
        tools.append(_load_entry(entry, f"{where}: tools[{i}]"))
        first = [t.name for t in tools].index(tools[-1].name)
        if first < i:
            raise ToolConfigError(f"{where}: tools[{first}] and tools[{i}] are both named {tools[-1].name!r}")
    return Tools(tools, timeout_s=timeout_s, max_response_chars=max_response_chars, truncate_side=truncate_side)


def _load_entry(entry: Any, where: str) -> Tool:
    if not isinstance(entry, dict):
        raise ToolConfigError(f"{where}: expected a mapping with class_name, got {type(entry).__name__}")
    if set(entry) - set(_ENTRY_KEYS):
        raise ToolConfigError(f"{where}: unknown key(s) {sorted(set(entry) - set(_ENTRY_KEYS))}; "
                              f"expected {', '.join(_ENTRY_KEYS)}")
    if ("class_name" in entry) == ("function" in entry):
        raise ToolConfigError(f"{where}: " + ("give class_name or function, not both" if "function" in entry
                                              else "missing class_name (pkg.mod.Name or path/to/file.py:Name)"))
    config, schema = entry.get("config") or {}, entry.get("tool_schema")
    kind = config.get("type", "native") if isinstance(config, dict) else None
    if kind == "mcp":
        raise ToolConfigError(f"{where}.config.type='mcp': MCP tools are not supported; write a tool class or function")
    if kind != "native":
        raise ToolConfigError(f"{where}.config: expected a mapping with type native (or no type), got {str(config)[:80]}")
    if schema is not None and not isinstance(schema, dict):
        raise ToolConfigError(f"{where}.tool_schema: expected a mapping, got {type(schema).__name__}")
    key = "class_name" if "class_name" in entry else "function"
    where = f"{where}.{key}={entry[key]!r}"
    target = import_target(entry[key], where)
    if inspect.isclass(target):
        if key == "function":
            raise ToolConfigError(f"{where}: is a class, not a function; list it under class_name")
        try:  # verl's constructor call: the config dict and a schema object (None: the class has its own)
            target = target(dict(config), None if schema is None else ToolSchema(copy.deepcopy(schema)))
        except Exception as e:
            raise ToolConfigError(f"{where}: constructing it raised {error_line(e)}") from None
        if not hasattr(target, "execute"):
            raise ToolConfigError(f"{where}: a tool class needs an execute method (see BaseTool)")
    try:
        return make_tool(target, schema)
    except ValueError as e:
        raise ToolConfigError(f"{where}: {' '.join(str(e).split())}") from None


def import_target(ref: Any, where: str) -> Any:
    """What `pkg.mod.Name` or `path/to/file.py:Name` names; ToolConfigError (one line) if nothing."""
    if not isinstance(ref, str) or not (":" in ref or "." in ref.strip(".")):
        raise ToolConfigError(f"{where}: expected a dotted path pkg.mod.Name or path/to/file.py:Name")
    label, _, name = ref.rpartition(":") if ":" in ref else ref.rpartition(".")  # pkg.mod:Name works too
    if label.endswith(".py"):
        path = os.path.abspath(os.path.expanduser(label))  # relative to the current directory
        if not os.path.isfile(path):
            raise ToolConfigError(f"{where}: no such file {path}")
        # A module name of its own per file, so tool files never replace each other or a real module;
        # several entries of one file share it.
        module_name = "spmdsplit_tool_" + hashlib.sha1(path.encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(module_name, path)
        if module_name not in sys.modules and spec is not None and spec.loader is not None:
            sys.modules[module_name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
            try:
                spec.loader.exec_module(sys.modules[module_name])
            except (Exception, SystemExit) as e:  # SystemExit: a file that calls sys.exit() on import
                del sys.modules[module_name]
                raise ToolConfigError(f"{where}: importing {path} failed ({error_line(e)})") from None
        if module_name not in sys.modules:
            raise ToolConfigError(f"{where}: {path} is not a Python file that can be imported")
        module = sys.modules[module_name]
    else:
        try:
            module = importlib.import_module(label)
        except (Exception, SystemExit) as e:  # the hint: torchrun does not put the current directory on sys.path
            hint = "; name a file as path/to/file.py:Name" if isinstance(e, ModuleNotFoundError) else ""
            raise ToolConfigError(f"{where}: cannot import module {label!r} ({error_line(e)}){hint}") from None
    if not hasattr(module, name):
        raise ToolConfigError(f"{where}: module {label!r} has no attribute {name!r}")
    return getattr(module, name)


class Tools:
    """The loaded tools, and `run` to call them. Stateless apart from their UserCode (its event-loop
    thread, the threads of timed-out calls: `stuck`) and the count of failed or hung releases
    (`release_errors`)."""

    def __init__(self, tools: Sequence[Any], *, timeout_s: float = 30.0, max_response_chars: int = 256,
                 truncate_side: str = "middle"):
        if truncate_side not in TRUNCATE_SIDES or not (timeout_s > 0 and max_response_chars > 0):
            raise ValueError(f"truncate_side={truncate_side!r} (expected one of {', '.join(TRUNCATE_SIDES)}), "
                             f"timeout_s={timeout_s} and max_response_chars={max_response_chars} (expected > 0)")
        self._tools: dict[str, Tool] = {}
        for t in tools:  # Tools, tool instances or functions
            t = t if isinstance(t, Tool) else make_tool(t)
            if t.name in self._tools:
                raise ValueError(f"two tools are named {t.name!r}")
            self._tools[t.name] = t
        self.names = list(self._tools)
        self.schemas = [t.schema for t in self._tools.values()]  # for apply_chat_template(tools=...)
        self.timeout_s, self.max_response_chars, self.truncate_side = timeout_s, max_response_chars, truncate_side
        self.release_errors = 0
        self.usercode = UserCode("spmdsplit-tools")

    def __len__(self) -> int:
        return len(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    @property
    def stuck(self) -> int:
        """How many threads of timed-out calls are still running."""
        return self.usercode.stuck

    def run(self, calls: Sequence[Call]) -> list[ToolResult]:
        """Runs all calls concurrently; one result per call, in order. A tool's fault never raises here."""
        return self.start(calls).result()

    def start(self, calls: Sequence[Call]) -> concurrent.futures.Future:
        """`run` without waiting: the calls start now, on the tools' event loop, and the future
        gives their results (never an exception) while the caller goes on (continuous generation
        runs other episodes' turns meanwhile)."""
        async def all_calls() -> list[ToolResult]:
            return list(await asyncio.gather(*(self._one(c) for c in calls)))
        if not calls:
            done = concurrent.futures.Future()
            done.set_result([])
            return done
        return self.usercode.submit(all_calls())

    def close(self) -> None:
        """Stops the event-loop thread (a later `run` starts another); stuck tool threads are daemons."""
        self.usercode.close()

    async def _one(self, call: Call) -> ToolResult:
        start = time.monotonic()
        try:
            result = await self._checked(call)
        except Exception as e:  # a bug here, not in the tool: still one result per call
            result = self._error("exception", f"tool {call.name} failed: {error_line(e)}")
        result.seconds = time.monotonic() - start
        return result

    async def _checked(self, call: Call) -> ToolResult:
        if call.parse_error or not isinstance(call.arguments, dict):
            why = call.parse_error or ("its arguments could not be read" if call.arguments is None else
                                       f"its arguments must be a JSON object, got {_json_type(call.arguments)}")
            return self._error("bad_call", f"bad tool call: {why}")
        tool = self._tools.get(call.name)
        if tool is None:
            return self._error("unknown_tool", f"unknown tool {call.name!r}; tools: {', '.join(self.names)}")
        problem = check_arguments(tool, call.arguments)
        if problem:
            return self._error("bad_arguments", problem)
        kw = call.row_kwargs.get(tool.name) if isinstance(call.row_kwargs, dict) else None
        kw = {k: v for k, v in kw.items() if isinstance(v, dict)} if isinstance(kw, dict) else {}
        state: dict[str, Any] = {}  # the instance id, once created
        # create..calc_reward, bounded together
        steps = await self.usercode.within(lambda: self._steps(tool, call.arguments, kw, state), self.timeout_s)
        if steps.error == TIMEOUT:
            if "id" in state:  # release without waiting: it may hang as well
                self.usercode.keep(asyncio.ensure_future(self._release(tool, state["id"], kw)))
            return self._error("timeout", f"tool {tool.name} timed out after {self.timeout_s:g} s")
        if "id" in state:
            await self._release(tool, state["id"], kw)
        if steps.error:
            return self._error("exception", f"tool {tool.name} raised {error_line(steps.exception)}")
        response, reward, score = steps.value
        text = response if isinstance(response, str) else (
            response.get("text") if isinstance(response, dict) else getattr(response, "text", None))
        if not isinstance(text, str):
            return self._error("not_text", f"tool {tool.name} returned {type(response).__name__}, not text")
        text, cut = self._truncate(text)
        return ToolResult(text, reward, score, truncated=cut)

    async def _steps(self, tool: Tool, args: dict, kw: dict, state: dict) -> tuple[Any, float, float | None]:
        call = self.usercode.call
        if tool.is_function:
            row = {**kw.get("create_kwargs", {}), **kw.get("execute_kwargs", {})}
            extra = {k: v for k, v in row.items()
                     if k not in _properties(tool) and (tool.row_keys is None or k in tool.row_keys)}
            return await call(tool.target, **{**args, **extra}), 0.0, None
        obj = tool.target
        if hasattr(obj, "create"):  # called the way verl's agent loop calls it
            created = await call(obj.create, create_kwargs=kw.get("create_kwargs", {}))
            state["id"] = created[0] if isinstance(created, tuple) else created  # older tools: the id alone
        else:
            state["id"] = str(uuid.uuid4())
        out = await call(obj.execute, state["id"], args, **kw.get("execute_kwargs", {}))
        response, reward = (out[0], out[1]) if isinstance(out, tuple) and len(out) >= 2 else (out, 0.0)
        score = None
        if hasattr(obj, "calc_reward"):
            score = await call(obj.calc_reward, state["id"], **kw.get("calc_reward_kwargs", {}))
        return response, float(reward or 0.0), None if score is None else float(score)

    async def _release(self, tool: Tool, instance_id: Any, kw: dict) -> None:
        """Releases an instance; a failure or a hang past timeout_s is counted, never shown to the model."""
        if hasattr(tool.target, "release"):
            release = tool.target.release
            outcome = await self.usercode.within(
                lambda: self.usercode.call(release, instance_id, **kw.get("release_kwargs", {})), self.timeout_s)
            self.release_errors += outcome.error is not None

    def _error(self, kind: str, message: str) -> ToolResult:
        text, cut = self._truncate(f"Error: {message}")
        return ToolResult(text, error=kind, truncated=cut)

    def _truncate(self, text: str) -> tuple[str, bool]:
        return truncate(text, self.max_response_chars, self.truncate_side)


def truncate(text: str, n: int, side: str) -> tuple[str, bool]:
    """`text` cut to `n` characters (and the CUT mark), keeping `side` (verl's meaning); and whether it was cut."""
    if len(text) <= n:
        return text, False
    head = n if side == "left" else 0 if side == "right" else (n + 1) // 2
    return text[:head] + CUT + text[len(text) - (n - head):], True


def _properties(tool: Tool) -> dict:
    params = tool.schema["function"].get("parameters")
    props = params.get("properties") if isinstance(params, dict) else None
    return props if isinstance(props, dict) else {}


def check_arguments(tool: Tool, args: dict) -> str:
    """The first way the arguments break the tool's schema, worded for the model; "" if none."""
    params, props = tool.schema["function"].get("parameters"), _properties(tool)
    params = params if isinstance(params, dict) else {}
    for key in args:
        if key not in props and params.get("additionalProperties") is not True:
            return f"{tool.name}() got an unexpected argument {key!r}"
    for key in params.get("required") or []:
        if key not in args:
            return f"{tool.name}() missing required argument {key!r}"
    for key, value in args.items():
        want = props[key].get("type") if isinstance(props.get(key), dict) else None
        wants = [want] if isinstance(want, str) else want if isinstance(want, list) else []
        if wants and _json_type(value) not in wants and not (_json_type(value) == "integer" and "number" in wants):
            if all(w in _JSON_TYPES for w in wants):  # a type this check does not know: the tool judges
                return f"{tool.name}() argument {key!r} must be {' or '.join(wants)}, got {_json_type(value)}"
    return ""


def _json_type(value: Any) -> str:
    return next((name for name, t in _JSON_TYPES.items() if isinstance(value, t)), type(value).__name__)
