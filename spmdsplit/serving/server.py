"""The HTTP side: an aiohttp server on 127.0.0.1 speaking the OpenAI API over an EngineDriver.

The server runs on an event loop of its own, in a daemon thread (usercode.UserCode's loop), so it
serves while the thread that built it does anything else (a training step, a reward batch). Each
request is read (protocol.py), its prompts x n go to the driver as separate requests, which the
engine steps together with every other request held, and the answer is written when all are done.
The only module of spmdsplit that imports aiohttp at import time; nothing imports it but
spmdsplit.serving's `OpenAIServer`, lazily.
"""

from __future__ import annotations

import asyncio
import copy
import errno
import json
import threading
from collections.abc import Callable

from aiohttp import web

from spmdsplit.serving import protocol
from spmdsplit.serving.driver import Completion, DriverStopped, make_driver
from spmdsplit.serving.episodes import Call as EpisodeCall
from spmdsplit.serving.episodes import Episodes
from spmdsplit.serving.protocol import BadRequest, Record, Served
from spmdsplit.usercode import UserCode

LOCALHOST = "127.0.0.1"
MAX_BODY_BYTES = 64 * 2**20  # aiohttp's default (1 MiB) would refuse a long judge prompt with its messages


class PortInUse(OSError):
    """The port asked for is taken (by another server, or one not yet closed)."""


class OpenAIServer:
    """`engine` (a StepwiseEngine) served over the OpenAI API as `model_name`, on 127.0.0.1:`port`
    (0: any free port; `port` and `base_url` say which once started). `sampling`: what the engine
    samples with (an object with do_sample, temperature, top_p, top_k: its rollout.*, or its
    rollout.val_kwargs with `validate=True`); requests asking for other settings are refused.
    `record(Record)`: called for every choice answered, on the server's thread before the response
    goes out (keep it quick; what it raises fails the request with a 500). `gather_s`: EngineDriver's.
    `peers`: the gloo group of a tensor-parallel engine's ranks, each serving its own callers
    (driver.LockstepDriver). `episodes`: the job's episodes (episodes.py), served under
    /episodes/<id>/v1/..., each call recorded into its episode and held to its budget, and sampled
    as its episode says (a validation episode's with `val_sampling`). `stepped`:
    the engine is stepped by its owner, not by a thread of the server's, and each call sets this
    event of the owner's (driver.SteppedDriver). `tool_reader`: how the model writes tool calls
    (chat's `tools` are refused without one)."""

    def __init__(self, engine, tokenizer, model_name: str, sampling, *, host: str = LOCALHOST, port: int = 0,
                 validate: bool = False, record: Callable[[Record], None] | None = None, gather_s: float = 0.0,
                 peers=None, episodes: Episodes | None = None, stepped: threading.Event | None = None,
                 tool_reader: protocol.ToolReader | None = None, val_sampling=None):
        if host not in (LOCALHOST, "localhost"):
            raise ValueError(f"OpenAIServer serves on {LOCALHOST} only (it has no authentication), not {host!r}")
        # A copy of its own: a fast tokenizer called with padding or truncation by the caller's threads
        # (a reward function's) changes its state, and the Rust side then refuses the server's
        # threads with "Already borrowed".
        self.tokenizer, self.record, self.requested_port = copy.deepcopy(tokenizer), record, port
        self.tool_reader = tool_reader
        self.driver = make_driver(engine, self.tokenizer, peers, stepped, validate=validate, gather_s=gather_s)
        self.served = Served.of(model_name, sampling, self.driver.max_model_len)
        self.served_val = self.served if val_sampling is None else Served.of(model_name, val_sampling,
                                                                             self.driver.max_model_len)
        self.episodes = episodes
        self._code: UserCode | None = None
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    @property
    def base_url(self) -> str:
        """What an `openai` client takes as its base_url."""
        if self.port is None:
            raise RuntimeError("OpenAIServer.base_url: the server is not running (start() it)")
        return f"http://{LOCALHOST}:{self.port}/v1"

    # ---- its life

    def start(self) -> OpenAIServer:
        """Listens (PortInUse if the port is taken) and starts stepping the engine; returns self."""
        if self._code is not None:
            raise RuntimeError("OpenAIServer.start: already running")
        code = UserCode("spmdsplit-serving")
        try:
            self._runner, self.port = code.submit(self._listen()).result()
        except BaseException:
            code.close()
            raise
        self._code = code
        self.driver.start()
        return self

    def pause(self) -> None:
        """Returns once the engine is free (EngineDriver.pause): it may sleep until `resume`.
        Requests keep coming in and wait."""
        self.driver.pause()

    def resume(self) -> None:
        self.driver.resume()

    def stop(self) -> None:
        """Requests not answered get a 503, then the port closes."""
        self.driver.stop()
        if self._code is not None:
            self._code.submit(self._runner.cleanup()).result()
            self._code.close()
        self._code, self._runner, self.port = None, None, None

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _listen(self) -> tuple[web.AppRunner, int]:
        app = web.Application(middlewares=[_openai_errors], client_max_size=MAX_BODY_BYTES)
        for prefix in ("", "/episodes/{episode}"):  # an episode's calls name it in the path
            app.router.add_get(prefix + "/v1/models", self._models)
            app.router.add_post(prefix + "/v1/completions", self._completions)
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
        # handler_cancellation: a client that went away (its timeout) cancels its handler, whose
        # requests then leave the engine instead of generating for nobody.
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, LOCALHOST, self.requested_port).start()
        except OSError as e:
            await runner.cleanup()
            if e.errno == errno.EADDRINUSE:
                raise PortInUse(errno.EADDRINUSE, f"OpenAIServer: {LOCALHOST}:{self.requested_port} is already in "
                                "use (port=0 takes any free port)") from None
            raise
        return runner, runner.addresses[0][1]

    # ---- the endpoints

    async def _models(self, request: web.Request) -> web.Response:
        self._episode(request)
        return web.json_response({"object": "list", "data": [
            {"id": self.served.model, "object": "model", "created": 0, "owned_by": "spmdsplit",
             "max_model_len": self.served.max_model_len}]})

    async def _completions(self, request: web.Request) -> web.Response:
        episode = self._episode(request)
        served = self._served(episode)
        return await self._answer(protocol.read_completion(await _body(request), served, self.tokenizer), episode)

    async def _chat(self, request: web.Request) -> web.Response:
        episode, body = self._episode(request), await _body(request)
        call = protocol.read_chat(body, self._served(episode), self.tokenizer, self.tool_reader)
        return await self._answer(call, episode)

    def _served(self, episode: str | None) -> Served:
        """What the call is sampled with: its episode's settings (validation's or training's)."""
        return self.served_val if episode is not None and self.episodes.get(episode).validate else self.served

    def _episode(self, request: web.Request) -> str | None:
        """The episode a call names in its path (None: none); a 404 for one the job has not open,
        and, on a server of episodes, for a call that names none (it would train on nothing)."""
        episode = request.match_info.get("episode")
        if episode is None and self.episodes is not None:
            raise BadRequest("this server answers its episodes only: call the base_url the harness was given "
                             "(/episodes/<id>/v1)", status=404, kind="not_found_error")
        if episode is not None and (self.episodes is None or not self.episodes.is_open(episode)):
            raise BadRequest(f"no episode {episode!r} is open on this server", status=404, kind="not_found_error")
        return episode

    async def _answer(self, call: protocol.Call, episode: str | None = None) -> web.Response:
        if episode is not None:
            return await self._episode_answer(call, episode)
        futures = [self.driver.submit(prompt, call.max_tokens, protocol.choice_seed(call.seed, j), call.stop)
                   for prompt in call.prompts for j in range(call.n)]
        completions = await self._completed(futures)
        return self._respond(call, completions)

    async def _episode_answer(self, call: protocol.Call, episode: str) -> web.Response:
        """One completion of one prompt: continuing the episode's last call as sampled where it
        does, cut to the episode's budget, recorded into the episode."""
        if call.n != 1 or len(call.prompts) != 1:
            raise BadRequest("an episode's call asks for one completion (n=1) of one prompt", "n")
        prompt = call.prompts[0]
        if call.chat:
            prompt = self.episodes.prompt_for_chat(episode, call.messages, prompt, self.tokenizer, call.tools)
        room = min(self.episodes.room(episode, prompt, call.max_tokens), self.served.max_model_len - len(prompt))
        if room <= 0:  # the budget or the turns spent, or the context full: no tokens
            completion = Completion([], [], "length", "")
        else:
            validate = self.episodes.get(episode).validate
            completion, = await self._completed([self.driver.submit(prompt, room, call.seed, call.stop, tag=episode,
                                                                    validate=validate)])
        eos = bool(completion.token_ids) and completion.token_ids[-1] in self.driver.eos_ids
        answer = protocol.chat_message(completion, call, self.tokenizer, self.tool_reader) if call.chat else None
        self.episodes.record(episode, EpisodeCall(prompt, completion.token_ids, completion.log_probs,
                                                  call.messages, eos, completion.versions, answer))
        call.prompts = [prompt]
        return self._respond(call, [completion], None if answer is None else [answer])

    async def _completed(self, futures) -> list[Completion]:
        waiting = [asyncio.wrap_future(f) for f in futures]
        try:
            return await asyncio.gather(*waiting)
        except DriverStopped as e:
            raise BadRequest(str(e), status=503, kind="server_error") from e
        finally:
            for f in futures:  # one failed, or the client went away: the rest leave the engine
                f.cancel()

    def _respond(self, call: protocol.Call, completions: list[Completion],
                 messages: list[dict] | None = None) -> web.Response:
        request_id = protocol.new_request_id(call.chat)
        if self.record is not None:
            for record in protocol.records(call, request_id, completions):
                try:
                    self.record(record)
                except Exception as e:  # noqa: BLE001 - the caller learns that its call was not recorded
                    raise BadRequest(f"the server's record hook failed: {type(e).__name__}: {e}", status=500,
                                     kind="server_error") from e
        return web.json_response(protocol.response(call, request_id, self.served.model, completions, self.tokenizer,
                                                   self.tool_reader, messages))


async def _body(request: web.Request):
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None


@web.middleware
async def _openai_errors(request: web.Request, handler):
    """Every error as OpenAI's body ({"error": {message, type, param, code}}), which its client reads."""
    try:
        return await handler(request)
    except BadRequest as e:
        return web.json_response(e.body(), status=e.status)
    except web.HTTPException as e:  # an unknown path (404), a wrong method (405), a body too large (413)
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        return web.json_response(protocol.error_body(f"{request.method} {request.path}: {e.reason}", kind),
                                 status=e.status)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - the engine's own error, told to the caller
        return web.json_response(protocol.error_body(f"{type(e).__name__}: {e}", "server_error"), status=500)
