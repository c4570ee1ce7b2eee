"""Agent tools (spmdsplit/agent/tools.py): verl-format tool configs, tool classes and functions, and
`Tools.run`'s contract: every call gets a result (errors included), concurrently, within its deadline."""

import importlib
import os
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import yaml

from spmdsplit.agent.tools import (CUT, ERROR_KINDS, BaseTool, Call, ToolConfigError, ToolResponse, Tools, ToolSchema,
                                   load_tools, make_tool)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "rollout.multi_turn.tool_config_path"

# The user's tool module, written as a real file and imported by its dotted name.
SAMPLE = '''
import asyncio
import threading
import time
import uuid

from spmdsplit.agent.tools import BaseTool, ToolResponse

EVENTS = []
NUMBER = 3


class Gsm8kLike(BaseTool):
    """Written as for verl: async methods, per-instance state, a step reward and a final score."""

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.state = {}
        EVENTS.append(("init", config, tool_schema.function.name,
                       tool_schema.function.parameters.properties.answer.type,
                       tool_schema.model_dump(exclude_unset=True, exclude_none=True)))

    async def create(self, instance_id=None, ground_truth=None, **kwargs):
        instance_id = instance_id or str(uuid.uuid4())
        if ground_truth is None:
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth")
        self.state[instance_id] = {"truth": ground_truth, "answer": None}
        EVENTS.append(("create", ground_truth))
        return instance_id, ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        state = self.state[instance_id]
        state["answer"] = parameters["answer"]
        EVENTS.append(("execute", kwargs))
        right = state["answer"] == state["truth"]
        return ToolResponse(text=f"{state['answer']} is {'right' if right else 'wrong'}"), 0.5 if right else -0.5, {}

    async def calc_reward(self, instance_id, **kwargs):
        EVENTS.append(("calc_reward", kwargs))
        state = self.state[instance_id]
        return 1.0 if state["answer"] == state["truth"] else 0.0

    async def release(self, instance_id, **kwargs):
        EVENTS.append(("release", kwargs))
        del self.state[instance_id]


class SyncCounter:
    """Duck-typed (no BaseTool), plain methods, its schema from get_openai_tool_schema()."""

    def __init__(self, config, tool_schema):
        self.step = config["step"]

    def get_openai_tool_schema(self):
        return {"type": "function", "function": {"name": "count", "description": "Adds the step.", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}

    def create(self, instance_id=None, **kwargs):
        return instance_id or str(uuid.uuid4())  # an older tool: the id alone

    def execute(self, instance_id, parameters, **kwargs):
        EVENTS.append(("main_thread", threading.current_thread() is threading.main_thread()))
        return str(parameters["n"] + self.step), 0.25, {}

    def calc_reward(self, instance_id, **kwargs):
        return 2.0

    def release(self, instance_id, **kwargs):
        EVENTS.append(("release",))


class HangingExecute(BaseTool):
    def execute(self, instance_id, parameters, **kwargs):
        threading.Event().wait()

    def release(self, instance_id, **kwargs):
        EVENTS.append(("release", instance_id))


class RaisingExecute(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        raise KeyError("boom")

    def release(self, instance_id, **kwargs):
        EVENTS.append(("release", instance_id))


class BadRelease(BaseTool):
    def release(self, instance_id, **kwargs):
        raise OSError("sandbox gone")


class Exploding(BaseTool):
    def __init__(self, config, tool_schema):
        raise RuntimeError("bad config:\\nno url")


class NoSchema(BaseTool):
    pass


def lookup(key: str, limit: int = 10) -> str:
    """Looks a key up in the table.

    Args:
        key: The key to look up.
        limit: At most this many characters of the value.
    """
    EVENTS.append(("lookup", key))
    if key == "missing":
        raise ValueError("no such key")
    return f"value of {key}"[:limit]


def typed(s: str, n: int, x: float, b: bool, a: list[str], o: dict) -> str:
    """Takes one argument of each JSON type.

    Args:
        s: a string
        n: an integer
        x: a number
        b: a boolean
        a: an array
        o: an object
    """
    return "ok"


def sleepy(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "slept"


async def asleep(seconds: float) -> str:
    """Sleeps without a thread.

    Args:
        seconds: how long
    """
    await asyncio.sleep(seconds)
    return "slept"


def hang(x: str) -> str:
    """Never returns.

    Args:
        x: anything
    """
    threading.Event().wait()


async def ahang(x: str) -> str:
    """Never returns, without a thread.

    Args:
        x: anything
    """
    await asyncio.Event().wait()


def big(size: int) -> str:
    """A long answer: A's, then B's.

    Args:
        size: its length
    """
    return "A" * (size // 2) + "B" * (size - size // 2)


def answer(kind: str):
    """Answers with a value of the given kind.

    Args:
        kind: which one
    """
    return {"int": 42, "bytes": b"x", "none": None, "list": ["a"], "tuple": ("a", 1.0, {}), "dict": {"text": "d"},
            "response": ToolResponse(text="r"), "empty": ToolResponse()}[kind]


def fetch(url: str, api_key: str = "") -> str:
    return f"{url} with key {api_key!r}"


def takes_all(q: str, **kwargs) -> str:
    return f"{q} {sorted(kwargs.items())}"


def no_docs(x):
    return x
'''


@pytest.fixture(scope="module")
def mod(tmp_path_factory):
    """The sample module's dotted name, importable for this module's tests."""
    folder = tmp_path_factory.mktemp("agent_tools")
    name = f"agent_tools_sample_{uuid.uuid4().hex[:8]}"
    (folder / f"{name}.py").write_text(SAMPLE)
    sys.path.insert(0, str(folder))
    yield importlib.import_module(name)
    sys.path.remove(str(folder))


@pytest.fixture
def load(tmp_path, mod):
    """Writes a config of `entries` (class_name/function names relative to the sample module) and loads it;
    the Tools are closed after the test."""
    loaded = []
    mod.EVENTS.clear()

    def load_(entries, **kwargs):
        for e in entries:
            for key in ("class_name", "function"):
                if key in e and "." not in e[key] and ":" not in e[key]:
                    e[key] = f"{mod.__name__}.{e[key]}"
        path = tmp_path / f"tools{len(loaded)}.yaml"
        path.write_text(yaml.safe_dump({"tools": entries}))
        loaded.append(load_tools(str(path), **kwargs))
        return loaded[-1]
    yield load_
    for tools in loaded:
        tools.close()


def schema(name, **properties):
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": {k: {"type": t} for k, t in properties.items()},
        "required": list(properties)[:1]}}}


# --------------------------------------------------------------------------- loading and running tools


def test_verl_format_class_tool_gets_row_kwargs_and_returns_reward_score_and_releases(tmp_path, mod):
    config = tmp_path / "gsm8k_tool_config.yaml"
    config.write_text(textwrap.dedent(f"""\
        tools:
          - class_name: "{mod.__name__}.Gsm8kLike"
            config:
              type: native
              scale: 3
            tool_schema:
              type: "function"
              function:
                name: "calc_gsm8k_reward"
                description: "Scores an answer to the problem."
                parameters:
                  type: "object"
                  properties:
                    answer:
                      type: "string"
                      description: "The model's answer"
                  required: ["answer"]
        """))
    mod.EVENTS.clear()
    tools = load_tools(str(config))
    try:
        assert tools.names == ["calc_gsm8k_reward"] and len(tools) == 1 and "calc_gsm8k_reward" in tools
        assert tools.schemas == [yaml.safe_load(config.read_text())["tools"][0]["tool_schema"]]
        init = mod.EVENTS[0]
        assert init[:4] == ("init", {"type": "native", "scale": 3}, "calc_gsm8k_reward", "string")
        assert init[4] == tools.schemas[0] and type(init[4]["function"]) is dict  # model_dump: plain dicts
        row = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}, "execute_kwargs": {"turn": 1},
                                     "calc_reward_kwargs": {"c": 2}, "release_kwargs": {"r": 3}}}
        right, wrong = tools.run([Call("calc_gsm8k_reward", {"answer": "72"}, row),
                                  Call("calc_gsm8k_reward", {"answer": "71"}, row)])
    finally:
        tools.close()
    assert (right.text, right.reward, right.score, right.error) == ("72 is right", 0.5, 1.0, "")
    assert (wrong.text, wrong.reward, wrong.score, wrong.error) == ("71 is wrong", -0.5, 0.0, "")
    assert right.seconds > 0
    events = mod.EVENTS[1:]
    assert events.count(("create", "72")) == 2
    assert events.count(("execute", {"turn": 1})) == 2 and events.count(("calc_reward", {"c": 2})) == 2
    assert events.count(("release", {"r": 3})) == 2


def test_sync_duck_typed_class_runs_off_the_calling_thread(load, mod):
    tools = load([{"class_name": "SyncCounter", "config": {"step": 5}}])
    assert tools.schemas[0]["function"]["name"] == "count"
    [result] = tools.run([Call("count", {"n": 2})])
    assert (result.text, result.reward, result.score, result.error) == ("7", 0.25, 2.0, "")
    assert mod.EVENTS == [("main_thread", False), ("release",)]


def test_function_tool_schema_comes_from_its_docstring(load):
    tools = load([{"function": "lookup"}])
    assert tools.schemas[0]["function"]["name"] == "lookup"
    assert tools.schemas[0]["function"]["parameters"] == {
        "type": "object", "required": ["key"], "properties": {
            "key": {"type": "string", "description": "The key to look up."},
            "limit": {"type": "integer", "description": "At most this many characters of the value."}}}
    results = tools.run([Call("lookup", {"key": "k"}), Call("lookup", {"key": "k", "limit": 3})])
    assert [(r.text, r.reward, r.score, r.error) for r in results] == [("value of k", 0.0, None, ""),
                                                                       ("val", 0.0, None, "")]


def test_function_named_under_class_name_and_file_path_forms(tmp_path, monkeypatch, mod):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_tools").mkdir()
    (tmp_path / "my_tools" / "shout.py").write_text(
        'def shout(text: str) -> str:\n    """Shouts.\n\n    Args:\n        text: what to shout\n    """\n'
        '    return text.upper()\n')
    entries = [{"class_name": "my_tools/shout.py:shout"}, {"function": f"{mod.__name__}:lookup"}]
    (tmp_path / "t.yaml").write_text(yaml.safe_dump({"tools": entries}))
    tools = load_tools("t.yaml")  # relative to the current directory, as is the file
    try:
        assert [r.text for r in tools.run([Call("shout", {"text": "hi"}), Call("lookup", {"key": "k"})])] == [
            "HI", "value of k"]
    finally:
        tools.close()


def test_row_kwargs_reach_a_function_by_the_documented_rule(load):
    tools = load([{"function": "fetch", "tool_schema": schema("fetch", url="string")},
                  {"function": "takes_all", "tool_schema": schema("takes_all", q="string")}])
    row = {"fetch": {"create_kwargs": {"api_key": "old", "other": 1}, "execute_kwargs": {"api_key": "s3cret"}},
           "takes_all": {"create_kwargs": {"q": "from row", "a": 1}, "execute_kwargs": {"b": 2}}}
    fetched, everything = tools.run([Call("fetch", {"url": "u"}, row), Call("takes_all", {"q": "model's"}, row)])
    assert fetched.text == "u with key 's3cret'"  # execute_kwargs win; `other` is no parameter of fetch
    assert everything.text == "model's [('a', 1), ('b', 2)]"  # **kwargs takes all; the model's q is kept


# --------------------------------------------------------------------------- config errors


def _config_error(tmp_path, entries, text=None) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(text if text is not None else yaml.safe_dump({"tools": entries}))
    with pytest.raises(ToolConfigError) as e:
        load_tools(str(path))
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{KEY}={path}: "), message
    return message


@pytest.mark.parametrize("entries, text, expected", [
    (None, "tools: [", "not valid YAML"),
    (None, "tools: 3\n", "expected a YAML mapping with a non-empty `tools:` list"),
    (None, "- class_name: x.Y\n", "expected a YAML mapping with a non-empty `tools:` list"),
    ([{"config": {}}], None, "tools[0]: missing class_name"),
    ([{"class_name": "MOD.lookup", "function": "MOD.lookup"}], None, "tools[0]: give class_name or function, not both"),
    ([{"class_name": "MOD.lookup", "tol_schema": {}}], None, "tools[0]: unknown key(s) ['tol_schema']"),
    ([{"class_name": "no_such_pkg_xyz.mod.Tool"}], None,
     "tools[0].class_name='no_such_pkg_xyz.mod.Tool': cannot import module 'no_such_pkg_xyz.mod' (ModuleNotFoundError: "
     "No module named 'no_such_pkg_xyz'); name a file as path/to/file.py:Name"),
    ([{"class_name": "MOD.Missing"}], None, "tools[0].class_name='MOD.Missing': module 'MOD' has no attribute 'Missing'"),
    ([{"class_name": "Tool"}], None, "tools[0].class_name='Tool': expected a dotted path pkg.mod.Name"),
    ([{"class_name": "MOD.NUMBER"}], None, "tools[0].class_name='MOD.NUMBER': expected a tool or a function, got int"),
    ([{"class_name": "MOD.Exploding"}], None,
     "tools[0].class_name='MOD.Exploding': constructing it raised RuntimeError: bad config: no url"),
    ([{"class_name": "MOD.NoSchema"}], None, "tools[0].class_name='MOD.NoSchema': constructing it raised ValueError: "
                                             "NoSchema has no tool_schema"),
    ([{"function": "MOD.Gsm8kLike"}], None, "tools[0].function='MOD.Gsm8kLike': is a class, not a function"),
    ([{"function": "MOD.no_docs"}], None, "tools[0].function='MOD.no_docs': cannot build a schema for no_docs() from "
                                          "its type hints and Google-style docstring (DocstringParsingException: "
                                          "Cannot generate JSON schema for no_docs because it has no docstring!)"),
    ([{"function": "MOD.lookup", "tool_schema": {"name": "lookup"}}], None,
     "tools[0].function='MOD.lookup': tool_schema: expected an OpenAI function schema with function.name"),
    ([{"class_name": "MOD.lookup", "config": {"type": "mcp"}}], None,
     "tools[0].config.type='mcp': MCP tools are not supported"),
    ([{"class_name": "MOD.lookup", "config": ["x"]}], None, "tools[0].config: expected a mapping"),
    ([{"function": "MOD.lookup"}, {"function": "MOD.typed"}, {"class_name": "MOD.lookup"}], None,
     "tools[0] and tools[2] are both named 'lookup'"),
])
def test_config_errors_are_one_line_and_name_the_entry(tmp_path, mod, entries, text, expected):
    entries = yaml.safe_load(yaml.safe_dump(entries).replace("MOD", mod.__name__)) if entries else entries
    assert expected.replace("MOD", mod.__name__) in _config_error(tmp_path, entries, text)


def test_config_error_for_a_missing_file_and_a_file_that_fails_to_import(tmp_path, monkeypatch):
    with pytest.raises(ToolConfigError, match=f"^{KEY}={tmp_path}/nope.yaml: no such file$"):
        load_tools(str(tmp_path / "nope.yaml"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.py").write_text("import no_such_module_xyz\n")
    assert "tools[0].class_name='broken.py:f': importing" in _config_error(
        tmp_path, [{"class_name": "broken.py:f"}])
    assert "tools[0].class_name='gone.py:f': no such file" in _config_error(tmp_path, [{"class_name": "gone.py:f"}])


def test_tool_schema_object_reads_like_verls():
    s = ToolSchema(schema("f", a="array"))
    assert s.function.name == "f" and s.function.parameters.properties["a"].type == "array"
    assert s.model_dump(exclude_unset=True, exclude_none=True) == schema("f", a="array") == s.to_dict()
    assert type(s.model_dump()["function"]) is dict
    with pytest.raises(AttributeError, match="no 'nme'"):
        s.function.nme


# --------------------------------------------------------------------------- error kinds


def test_bad_calls_and_unknown_tools_run_nothing(load, mod):
    tools = load([{"function": "lookup"}, {"function": "typed"}])
    results = tools.run([Call("lookup", None, parse_error="invalid JSON: Expecting ',' at char 9"),
                         Call("lookup", None), Call("lookup", ["k"]), Call("serch", {"key": "k"})])
    assert [r.error for r in results] == ["bad_call", "bad_call", "bad_call", "unknown_tool"]
    assert results[0].text == "Error: bad tool call: invalid JSON: Expecting ',' at char 9"
    assert results[2].text == "Error: bad tool call: its arguments must be a JSON object, got array"
    assert results[3].text == "Error: unknown tool 'serch'; tools: lookup, typed"
    assert all(r.reward == 0.0 and r.score is None for r in results) and mod.EVENTS == []
    assert set(r.error for r in results) <= set(ERROR_KINDS)


def test_arguments_are_checked_against_the_schema_before_the_tool_runs(load, mod):
    tools = load([{"function": "lookup"}, {"function": "typed"}])
    good = {"s": "x", "n": 1, "x": 1.5, "b": True, "a": ["y"], "o": {}}
    calls = [Call("lookup", {"key": "k", "x": 1}), Call("lookup", {"limit": 3}), Call("typed", good),
             Call("typed", {**good, "x": 2})]  # an integer is a number
    bad = {"s": 1, "n": True, "x": "1.5", "b": 1, "a": "y", "o": []}
    calls += [Call("typed", {**good, k: v}) for k, v in bad.items()]
    results = tools.run(calls)
    assert [r.error for r in results] == ["bad_arguments", "bad_arguments", "", ""] + ["bad_arguments"] * 6
    assert results[0].text == "Error: lookup() got an unexpected argument 'x'"
    assert results[1].text == "Error: lookup() missing required argument 'key'"
    assert [r.text for r in results[4:]] == [
        "Error: typed() argument 's' must be string, got integer", "Error: typed() argument 'n' must be integer, got boolean",
        "Error: typed() argument 'x' must be number, got string", "Error: typed() argument 'b' must be boolean, got integer",
        "Error: typed() argument 'a' must be array, got string", "Error: typed() argument 'o' must be object, got array"]
    assert mod.EVENTS == []  # lookup never ran


def test_a_tool_exception_becomes_a_result_and_the_instance_is_still_released(load, mod):
    tools = load([{"function": "lookup"}, {"class_name": "RaisingExecute", "tool_schema": schema("raiser", q="string")},
                  {"class_name": "BadRelease", "tool_schema": schema("bad_release", q="string")}])
    missing, raised, released_badly = tools.run([Call("lookup", {"key": "missing"}), Call("raiser", {"q": "x"}),
                                                 Call("bad_release", {"q": "x"})])
    assert (missing.error, missing.text, missing.reward) == ("exception", "Error: tool lookup raised ValueError: no such key", 0.0)
    assert (raised.error, raised.text, raised.score) == ("exception", "Error: tool raiser raised KeyError: 'boom'", None)
    assert [e[0] for e in mod.EVENTS if e[0] == "release"] == ["release"]
    assert (released_badly.error, released_badly.text) == ("", "Updated the tool state.")  # a release error is not shown
    assert tools.release_errors == 1


def test_a_hung_tool_times_out_and_is_left_behind(load, mod):
    tools = load([{"function": "hang"}, {"function": "ahang"}, {"function": "lookup"},
                  {"class_name": "HangingExecute", "tool_schema": schema("hang_exec", q="string")}], timeout_s=0.5)
    start = time.monotonic()
    results = tools.run([Call("hang", {"x": "1"}), Call("ahang", {"x": "1"}), Call("lookup", {"key": "k"}),
                         Call("hang_exec", {"q": "x"})])
    assert time.monotonic() - start < 1.5
    assert [r.error for r in results] == ["timeout", "timeout", "", "timeout"]
    assert results[0].text == "Error: tool hang timed out after 0.5 s" and results[2].text == "value of k"
    assert tools.stuck == 2  # the two hung threads; the async one was cancelled
    deadline = time.monotonic() + 2  # the hung instance is released in the background
    while not any(e[0] == "release" for e in mod.EVENTS) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert any(e[0] == "release" for e in mod.EVENTS)


def test_only_text_counts_as_text(load):
    tools = load([{"function": "answer"}])
    kinds = ["int", "bytes", "none", "list", "tuple", "empty", "dict", "response"]
    results = tools.run([Call("answer", {"kind": k}) for k in kinds])
    assert [r.error for r in results] == ["not_text"] * 6 + ["", ""]
    assert [r.text for r in results[:2]] == ["Error: tool answer returned int, not text",
                                             "Error: tool answer returned bytes, not text"]
    assert results[5].text == "Error: tool answer returned ToolResponse, not text"
    assert [r.text for r in results[6:]] == ["d", "r"]


@pytest.mark.parametrize("side, kept", [("left", "A" * 100 + CUT), ("right", CUT + "B" * 100),
                                        ("middle", "A" * 50 + CUT + "B" * 50)])
def test_a_long_response_is_cut_on_the_configured_side(load, side, kept):
    tools = load([{"function": "big"}], max_response_chars=100, truncate_side=side)
    long, short = tools.run([Call("big", {"size": 5_000_000}), Call("big", {"size": 100})])
    assert (long.text, long.truncated, long.error) == (kept, True, "")
    assert (short.text, short.truncated) == ("A" * 50 + "B" * 50, False)


# --------------------------------------------------------------------------- concurrency and exit


@pytest.mark.parametrize("name", ["sleepy", "asleep"])
def test_calls_of_one_run_run_concurrently(load, name):
    tools = load([{"function": name}])
    tools.run([Call(name, {"seconds": 0.0})])  # starts the loop thread
    start = time.monotonic()
    results = tools.run([Call(name, {"seconds": 0.2}) for _ in range(32)])
    elapsed = time.monotonic() - start
    assert [r.text for r in results] == ["slept"] * 32
    assert elapsed < 1.0, f"32 calls sleeping 0.2 s took {elapsed:.2f} s"


def test_tools_built_in_code_and_close_is_idempotent():
    def echo(text: str) -> str:
        return text

    class Echo(BaseTool):
        def execute(self, instance_id, parameters, **kwargs):
            return ToolResponse(text=parameters["text"] * 2), 1.0, {}

    tools = Tools([make_tool(echo, schema("echo", text="string")), Echo({}, schema("echo2", text="string"))])
    assert tools.run([]) == []
    assert [r.text for r in tools.run([Call("echo", {"text": "a"}), Call("echo2", {"text": "b"})])] == ["a", "bb"]
    tools.close()
    tools.close()
    assert tools.run([Call("echo", {"text": "again"})])[0].text == "again"  # a later run starts a new loop
    tools.close()
    with pytest.raises(ValueError, match="two tools are named 'echo'"):
        Tools([make_tool(echo, schema("echo", text="string"))] * 2)
    with pytest.raises(ValueError, match=r"got a class \(pass an instance\)"):
        Tools([Echo])
    with pytest.raises(ValueError, match="truncate_side='top'"):
        Tools([], truncate_side="top")


def test_a_process_whose_tool_hangs_forever_still_exits(tmp_path):
    script = textwrap.dedent("""
        import threading
        from spmdsplit.agent.tools import Call, Tools, make_tool

        def hang(x: str) -> str:
            threading.Event().wait()

        schema = {"function": {"name": "hang", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
        tools = Tools([make_tool(hang, schema)], timeout_s=0.3)
        [result] = tools.run([Call("hang", {"x": "1"})])
        print(result.error, tools.stuck, flush=True)
    """)  # no close(): exiting must not wait for the loop thread or the hung one
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=20)
    assert (done.returncode, done.stdout, done.stderr) == (0, "timeout 1\n", "")
    assert time.monotonic() - start < 15


def test_a_fault_of_the_runner_itself_is_still_one_answer_per_call():
    """A schema the argument check cannot read (`required` not a list) fails in Tools, not in the
    tool: the call is still answered, with an exception error, and the turn's other calls run."""
    def echo(text: str) -> str:
        return text
    odd = {"type": "function", "function": {"name": "odd", "parameters": {"type": "object", "properties": {},
                                                                          "required": 5}}}
    tools = Tools([make_tool(lambda **kw: "x", odd), make_tool(echo, {"type": "function", "function": {
        "name": "echo", "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}})])
    broken, fine = tools.run([Call("odd", {}), Call("echo", {"text": "hi"})])
    assert broken.error == "exception" and "tool odd failed: TypeError" in broken.text
    assert (fine.error, fine.text) == ("", "hi")
