"""The OpenAI API's requests and responses as this server reads and writes them (no HTTP here).

A request is read into a `Call`: its prompts as token ids, and what to ask the engine for each.
What the engines cannot do is refused with a `BadRequest` naming the field, never ignored: the
engine samples with its own settings (the stepwise contract has no per-request sampling), so a
request's temperature, top_p or top_k must be the served ones or absent; no penalties, logit
biases, echo or top log-probs; no streaming. Tools (chat's `tools`) where the server was given the
job's tool-call format (a `ToolReader`): the tools rendered by the chat template, the calls the
model wrote read out of its reply as `tool_calls`; a call cannot be forced (`tool_choice` auto or
none only).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from spmdsplit.seeds import nth_seed
from spmdsplit.serving.driver import Completion, ContextTooLong, check_context

# Content no chat template alters and no real message holds: where it lands in a rendered
# conversation marks what the template writes around a message (serving/episodes.py, agent/chat.py).
SENTINEL = "\u2063SPMDSPLIT\u2063"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) for /v1/completions; chat: the context's room


class BadRequest(Exception):
    """A request the server refuses: HTTP `status` with OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class Served:
    """What the server serves: the model's name, the engine's sampling (temperature 0: greedy) and
    its longest context."""

    model: str
    temperature: float
    top_p: float
    top_k: int  # -1: off
    max_model_len: int

    @classmethod
    def of(cls, model: str, sampling, max_model_len: int) -> Served:
        """From the engine's settings: an object with do_sample, temperature, top_p, top_k (the
        engine's rollout.* or rollout.val_kwargs)."""
        if not sampling.do_sample:
            return cls(model, 0.0, 1.0, -1, max_model_len)
        top_k = sampling.top_k if sampling.top_k > 0 else -1
        return cls(model, float(sampling.temperature), float(sampling.top_p), top_k, max_model_len)

    def describe(self) -> str:
        greedy = " (greedy)" if self.temperature == 0 else ""
        return f"temperature={self.temperature:g}{greedy}, top_p={self.top_p:g}, top_k={self.top_k}"


class ToolReader(Protocol):
    """How the served model writes tool calls (the job's format: agent/parsers.py ServedToolCalls)."""

    stop: tuple[str, ...]  # what ends a reply of calls besides the EOS

    def read(self, text: str, tools: list[dict]) -> tuple[str | None, list[tuple[str, dict]]]:
        """A reply's content besides its calls, and the calls (name, arguments); (text, []) for none."""


@dataclass
class Call:
    """One request, read: each prompt's token ids, `n` completions of each."""

    chat: bool
    prompts: list[list[int]]
    n: int
    max_tokens: int | None  # None: the room the prompt leaves
    stop: tuple[str, ...]
    seed: int | None
    logprobs: int | None  # None: not asked; completions: 0 or 1; chat: 0
    user: Any
    metadata: Any
    tools: list[dict] | None = None  # chat: the request's tools, where the reply's calls are read
    messages: list[dict] | None = None  # chat: its messages as the template took them (template_message)


@dataclass
class Record:
    """One choice of a response, for the record hook: the request's id (the response's `id`) and
    the choice's `index`, the prompt's and the completion's token ids and the completion's
    log-probs (each as the engine sampled it), and the request's `user` and `metadata` fields."""

    request_id: str
    index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    user: Any
    metadata: Any


# ------------------------------------------------------------------ reading a request

def read_completion(body: Any, served: Served, tokenizer) -> Call:
    """/v1/completions: `prompt` a string or token ids, or a list of either (a batch)."""
    _check_common(body, served)
    _refuse(body, "echo", lambda v: v in (None, False), "echo is not supported")
    _refuse(body, "suffix", lambda v: v in (None, ""), "suffix is not supported")
    n = _n(body)
    _refuse(body, "best_of", lambda v: v is None or v == n, "best_of other than n is not supported")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or logprobs not in (0, 1)):
        raise BadRequest("logprobs may be 0 or 1 here (the sampled tokens' log-probs; the engines give no "
                         "alternatives)", "logprobs")
    prompts = [_prompt_ids(p, tokenizer) for p in _prompts(body)]
    max_tokens = _max_tokens(body, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    return _call(body, False, prompts, n, max_tokens, logprobs, served)


def read_chat(body: Any, served: Served, tokenizer, tool_reader: ToolReader | None = None) -> Call:
    """/v1/chat/completions: `messages` (and `tools`, where the server reads calls) rendered with
    the tokenizer's chat template."""
    _check_common(body, served)
    tools = _tools(body, tool_reader)
    _refuse(body, "response_format", lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
            "response_format other than text is not supported")
    _refuse(body, "top_logprobs", lambda v: v in (None, 0), "top_logprobs is not supported (the engines give "
            "the sampled token's log-prob only)")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise BadRequest("logprobs must be true or false", "logprobs")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _max_tokens(body, key, None)
    messages = chat_messages(body.get("messages"), tokenizer)
    call = _call(body, True, [_render(messages, tokenizer, tools)], _n(body), max_tokens, 0 if logprobs else None,
                 served)
    call.messages = messages
    if tools:
        call.tools, call.stop = tools, tuple(dict.fromkeys(call.stop + tool_reader.stop))
    return call


def _tools(body: dict, tool_reader: ToolReader | None) -> list[dict] | None:
    """The request's tools, checked (None: none, or tool_choice none); refused where the server reads
    no calls, or asked to force one (the engine cannot)."""
    _refuse(body, "functions", lambda v: not v, "functions (the legacy form) are not supported: use tools")
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        _refuse(body, "tool_choice", lambda v: v in (None, "none", "auto"), "tool_choice needs tools")
        return None
    if tool_reader is None:
        raise BadRequest("tools are not supported by this server (it reads no tool calls)", "tools")
    if choice not in (None, "auto", "none"):
        raise BadRequest("tool_choice may be auto or none here (the engine cannot force a call)", "tool_choice")
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function"
                                              and isinstance(t.get("function"), dict)
                                              and isinstance(t["function"].get("name"), str) for t in tools):
        raise BadRequest('tools must be a list of {"type": "function", "function": {"name": ..., ...}}', "tools")
    return None if choice == "none" else tools


def render_chat(messages: Any, tokenizer, tools: list[dict] | None = None) -> list[int]:
    """`messages` as the tokenizer's chat template renders them, with the generation prompt."""
    return _render(chat_messages(messages, tokenizer), tokenizer, tools)


def chat_messages(messages: Any, tokenizer) -> list[dict]:
    """A request's messages, checked, as chat templates take them (template_message); a BadRequest
    for none, or for a tokenizer without a chat template."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise BadRequest("this model's tokenizer has no chat template: use /v1/completions with a prompt",
                         "messages")
    return [template_message(m, i) for i, m in enumerate(messages)]


def _render(plain: list[dict], tokenizer, tools: list[dict] | None) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(plain, tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - a template refuses with its own message (roles out of order, ...)
        raise BadRequest(f"the chat template refused the messages: {e}", "messages") from e
    ids = tokenizer.encode(text, add_special_tokens=False)  # the template writes its own special tokens
    if not ids:
        raise BadRequest("the rendered messages are empty", "messages")
    return ids


def template_message(m: Any, i: int) -> dict:
    """A request's message as chat templates take it: its content as text, an assistant's
    tool_calls with their arguments as objects (OpenAI sends them as JSON strings)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise BadRequest(f"messages[{i}] must be an object with a role", "messages")
    message = {**m, "content": _content(m.get("content"), i)}
    if m.get("tool_calls"):
        message["tool_calls"] = [_template_tool_call(c, i) for c in m["tool_calls"]]
    return message


def _template_tool_call(call: Any, i: int) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict) or not isinstance(function.get("name"), str):  # function: a dict here
        raise BadRequest(f"messages[{i}].tool_calls: each must be {{\"function\": {{\"name\": ..., \"arguments\": "
                         "<a JSON object, or its text>}}", "messages")
    return {**call, "function": {"name": function["name"], "arguments": arguments}}


def _content(content: Any, i: int) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _check_common(body: Any, served: Served) -> None:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model is required (a string)", "model")
    if model != served.model:
        raise BadRequest(f"the model `{model}` does not exist: this server serves `{served.model}`", "model",
                         status=404, code="model_not_found")
    if body.get("stream"):
        raise BadRequest("streaming is not supported: leave stream out or false", "stream")
    _check_sampling(body, served)
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1),
                          ("min_p", 0)):
        _refuse(body, name, lambda v: v is None or v == neutral, f"{name} is not supported")
    _refuse(body, "logit_bias", lambda v: not v, "logit_bias is not supported")


def _check_sampling(body: dict, served: Served) -> None:
    """The engine samples with its own settings: a request may repeat them, not change them."""
    for name, value in (("temperature", served.temperature), ("top_p", served.top_p), ("top_k", served.top_k)):
        given = body.get(name)
        if given is None:
            continue
        if not _is_number(given):
            raise BadRequest(f"{name} must be a number", name)
        if name == "top_k" and given <= 0:
            given = -1  # 0 and -1 both mean off
        if abs(given - value) > 1e-6:
            raise BadRequest(f"{name}={given:g} differs from what this server samples with: {served.describe()}. "
                             "The engine samples with its own settings: leave them out or repeat them", name)


def _call(body: dict, chat: bool, prompts: list[list[int]], n: int, max_tokens: int | None,
          logprobs: int | None, served: Served) -> Call:
    for prompt in prompts:
        try:
            check_context(len(prompt), max_tokens, served.max_model_len)
        except ContextTooLong as e:
            raise BadRequest(str(e), "max_completion_tokens" if chat and max_tokens is not None else "max_tokens",
                             code="context_length_exceeded") from e
    return Call(chat, prompts, n, max_tokens, _stop(body), _seed(body), logprobs, body.get("user"),
                body.get("metadata"))


def _prompts(body: dict) -> list:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        return prompt
    raise BadRequest("prompt is required: a string, a list of token ids, or a list of either", "prompt")


def _prompt_ids(prompt: Any, tokenizer) -> list[int]:
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)  # special tokens as the tokenizer adds them (a BOS), as vLLM's server does
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        ids = list(prompt)
        if any(not 0 <= t < len(tokenizer) for t in ids):
            raise BadRequest(f"prompt token ids must be in [0, {len(tokenizer)})", "prompt")
    else:
        raise BadRequest("each prompt must be a string or a list of token ids", "prompt")
    if not ids:
        raise BadRequest("the prompt is empty", "prompt")
    return ids


def _n(body: dict) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if not _is_int(n) or n < 1:
        raise BadRequest("n must be an integer >= 1", "n")
    return n


def _max_tokens(body: dict, key: str, default: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if not _is_int(value) or value < 1:
        raise BadRequest(f"{key} must be an integer >= 1", key)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop must be a non-empty string or a list of them", "stop")
    return tuple(stops)


def _seed(body: dict) -> int | None:
    seed = body.get("seed")
    if seed is None:
        return None
    if not _is_int(seed):
        raise BadRequest("seed must be an integer", "seed")
    return seed & ((1 << 63) - 1)  # what the engines' generators take


def _refuse(body: dict, name: str, allowed, message: str) -> None:
    if name in body and not allowed(body[name]):
        raise BadRequest(message, name)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of a prompt's choice `choice` of n: the request's own for the first (n=1 samples as
    the first choice of n), a hash of both for the others (their samples differ)."""
    if seed is None or choice == 0:
        return seed
    return nth_seed(seed, choice)


# ------------------------------------------------------------------ writing the response

def response(call: Call, request_id: str, model: str, completions: list[Completion], tokenizer,
             tool_reader: ToolReader | None = None, messages: list[dict] | None = None) -> dict:
    """OpenAI's response body; `completions` in choice order (prompt by prompt, n each); chat's
    `messages` where the caller made them already (chat_message)."""
    if call.chat:
        messages = messages or [chat_message(c, call, tokenizer, tool_reader) for c in completions]
        choices = [_chat_choice(i, c, m, call, tokenizer) for i, (c, m) in enumerate(zip(completions, messages))]
    else:
        choices = [_text_choice(i, c, call, tokenizer) for i, c in enumerate(completions)]
    prompt_tokens = sum(len(p) for p in call.prompts)
    completion_tokens = sum(len(c.token_ids) for c in completions)
    return {"id": request_id, "object": "chat.completion" if call.chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def new_request_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def _text_choice(index: int, c: Completion, call: Call, tokenizer) -> dict:
    logprobs = None
    if call.logprobs is not None:
        logprobs = {"tokens": _token_texts(c.token_ids, tokenizer), "token_logprobs": list(c.log_probs),
                    "top_logprobs": None, "text_offset": None}
    return {"index": index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}


def _chat_choice(index: int, c: Completion, message: dict, call: Call, tokenizer) -> dict:
    logprobs = None
    if call.logprobs is not None:
        logprobs = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                for t, lp in zip(_token_texts(c.token_ids, tokenizer), c.log_probs)]}
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": "tool_calls" if message.get("tool_calls") else c.finish_reason}


def chat_message(c: Completion, call: Call, tokenizer, tool_reader: ToolReader | None) -> dict:
    """The assistant's message of a chat completion: its text, or where the request gave tools and
    the reply calls them, what is left of the text (None if nothing) and the calls. The reply is
    read whole, its stop string included (a format's calls may end on one, as compact's `@`)."""
    if not call.tools or tool_reader is None:
        return {"role": "assistant", "content": c.text}
    content, calls = tool_reader.read(tokenizer.decode(c.token_ids, skip_special_tokens=True), call.tools)
    if not calls:
        return {"role": "assistant", "content": c.text}
    return {"role": "assistant", "content": content or None,
            "tool_calls": [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                            "function": {"name": name, "arguments": json.dumps(arguments)}}
                           for name, arguments in calls]}


def _token_texts(ids: list[int], tokenizer) -> list[str]:
    return [tokenizer.decode([t]) for t in ids]


def records(call: Call, request_id: str, completions: list[Completion]) -> list[Record]:
    """The record hook's view of a response, one Record per choice."""
    return [Record(request_id, i, call.prompts[i // call.n], c.token_ids, c.log_probs, c.finish_reason,
                   call.user, call.metadata) for i, c in enumerate(completions)]
