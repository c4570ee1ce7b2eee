"""A reward server of the kind reward.remote_url calls (OpenRLHF's and slime's shape), for the tests
and the bench: each POSTed sample scored by spmdsplit's built-in scorer of its data_source.

    python -m tools.serve.reward_server [--port 8000] [--sleep 0.2] [--answer slime|openrlhf]

`--sleep` makes each request wait that long before answering (a judge, a sandbox); `--answer` picks
the answer's shape: slime's (the score, a bare number) or OpenRLHF's ({"rewards": [score]}).
`serve(...)` runs one in a thread of the calling process (the tests), with knobs to misbehave.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from dataclasses import dataclass, field


@dataclass
class Behaviour:
    """How the server answers: `sleep_s` before each answer; `statuses`, the HTTP statuses of the
    first requests (then 200); `answer`: slime | openrlhf | garbage (not JSON) | no_score (JSON
    without one)."""
    sleep_s: float = 0.0
    statuses: list[int] = field(default_factory=list)
    answer: str = "slime"
    requests: int = 0  # counted as they come
    bodies: list = field(default_factory=list)


def make_app(behaviour: Behaviour):
    from aiohttp import web

    from spmdsplit.rewards.rule import compute_score

    async def score(request):
        body = await request.json()
        behaviour.requests += 1
        behaviour.bodies.append(body)
        if behaviour.sleep_s:
            await asyncio.sleep(behaviour.sleep_s)
        if behaviour.statuses:
            status = behaviour.statuses.pop(0)
            if status != 200:
                return web.Response(status=status, text="not now")
        if behaviour.answer == "garbage":
            return web.Response(text="<html>oops</html>")
        if behaviour.answer == "no_score":
            return web.json_response({"message": "fine"})
        result = compute_score(body["data_source"], body["response"], body["label"], body.get("extra_info"))
        value = result["score"] if isinstance(result, dict) else result
        return web.json_response({"rewards": [value]} if behaviour.answer == "openrlhf" else value)

    app = web.Application()
    app.router.add_post("/", score)
    return app


class Served:
    """A server running on a loop in a daemon thread; `url`, `stop()`."""

    def __init__(self, behaviour: Behaviour, port: int = 0):
        from aiohttp import web

        self.behaviour, self.loop = behaviour, asyncio.new_event_loop()
        self.runner = web.AppRunner(make_app(behaviour))
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", port)
            self.loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - the port the OS picked
            ready.set()
            self.loop.run_forever()
        self.thread = threading.Thread(target=run, name="reward-server", daemon=True)
        self.thread.start()
        ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}/"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def serve(**behaviour) -> Served:
    return Served(Behaviour(**behaviour))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds each request waits before its answer")
    parser.add_argument("--answer", choices=("slime", "openrlhf"), default="slime")
    args = parser.parse_args()
    from aiohttp import web

    web.run_app(make_app(Behaviour(sleep_s=args.sleep, answer=args.answer)), host="127.0.0.1", port=args.port,
                print=lambda *a: print(f"reward server on http://127.0.0.1:{args.port}/", flush=True))


if __name__ == "__main__":
    main()
