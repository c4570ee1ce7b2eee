"""How tool calls are read out of a policy's turn: a small interface, one class per format.

A parser sees the text of one assistant turn (its tokens decoded with the special tokens kept; the
tokens themselves are never re-encoded, see loop.py) and returns the calls in it. A call whose
JSON or shape is wrong is still returned, with `parse_error` set: the model is told what was
wrong (tools.py turns it into an error response) instead of the call vanishing silently.

- `hermes` (default): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the format of
  Qwen2.5/Qwen3, Hermes and most chat templates that take `tools=`.
- `compact`: for the embedded character-level model, which cannot be expected to discover a
  40-character JSON envelope by sampling: a turn that ends with `@` calls the tool config's first
  tool, the text before the `@` being its one argument; a tool without parameters ignores that
  text (the model's thinking, as it were). The `@` ends the turn like an EOS does (`stop_tokens`).
"""

from __future__ import annotations

import json
import re

from spmdsplit.agent.tools import Call

PARSERS: dict[str, type["ToolParser"]] = {}


def register(name: str):
    def add(cls):
        PARSERS[name] = cls
        return cls
    return add


class ToolParser:
    """`calls(text, row_kwargs)` -> the calls of one turn ([] for an answer); `stop_tokens` -> the
    strings that end a turn besides the model's EOS."""

    def __init__(self, tool_schemas: list[dict]):
        self.tool_schemas = tool_schemas

    stop_tokens: tuple[str, ...] = ()

    def calls(self, text: str, row_kwargs: dict) -> list[Call]:
        raise NotImplementedError

    def content(self, text: str) -> str:
        """What a turn of calls says besides them."""
        return text


@register("hermes")
class HermesParser(ToolParser):
    PATTERN = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def calls(self, text: str, row_kwargs: dict) -> list[Call]:
        calls = []
        for body in self.PATTERN.findall(text):
            try:
                parsed = json.loads(body)
            except json.JSONDecodeError as e:
                calls.append(Call("", None, row_kwargs, parse_error=f"the tool call is not valid JSON ({e.msg})"))
                continue
            name = parsed.get("name") if isinstance(parsed, dict) else None
            arguments = parsed.get("arguments", {}) if isinstance(parsed, dict) else None
            if isinstance(arguments, str):  # some models write the arguments as a JSON string
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    arguments = None
            if not isinstance(name, str) or not isinstance(arguments, dict):
                calls.append(Call(name if isinstance(name, str) else "", None, row_kwargs,
                                  parse_error='a tool call must be {"name": <string>, "arguments": <object>}'))
                continue
            calls.append(Call(name, arguments, row_kwargs))
        return calls

    def content(self, text: str) -> str:
        return self.PATTERN.sub("", text).strip()


@register("compact")
class CompactParser(ToolParser):
    MARK = "@"
    stop_tokens = (MARK,)

    def calls(self, text: str, row_kwargs: dict) -> list[Call]:
        if not text.endswith(self.MARK):
            return []
        if not self.tool_schemas:
            return [Call("", None, row_kwargs, parse_error="no tools are configured")]
        function = self.tool_schemas[0]["function"]
        argument = text[: -len(self.MARK)]
        params = list((function.get("parameters") or {}).get("properties") or {})
        if not params:
            return [Call(function["name"], {}, row_kwargs)]
        if len(params) != 1 or not argument:
            return [Call(function["name"], None, row_kwargs,
                         parse_error=f"{function['name']} takes {len(params)} arguments, a compact call gives one")]
        return [Call(function["name"], {params[0]: argument}, row_kwargs)]

    def content(self, text: str) -> str:
        return ""  # the text before the mark is the call's argument


class ServedToolCalls:
    """The job's format (rollout.multi_turn.format) for the OpenAI server (serving/protocol.py
    ToolReader): an agent harness's chat calls with `tools` get the calls the model wrote as
    `tool_calls`, read as the agent loop reads a turn, against the request's tools. A reply whose
    calls cannot be read (bad JSON, a wrong shape) is answered as text, as vLLM's parsers do."""

    def __init__(self, name: str):
        build_parser(name, [])  # an unknown format fails here, not at the first call
        self.name, self.stop = name, PARSERS[name].stop_tokens

    def read(self, text: str, tools: list[dict]) -> tuple[str | None, list[tuple[str, dict]]]:
        parser = build_parser(self.name, tools)
        calls = parser.calls(text, {})
        if not calls or any(c.parse_error for c in calls):
            return text, []
        return parser.content(text), [(c.name, c.arguments) for c in calls]


def build_parser(name: str, tool_schemas: list[dict]) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"rollout.multi_turn.format={name!r}: expected one of {sorted(PARSERS)}")
    return PARSERS[name](tool_schemas)
