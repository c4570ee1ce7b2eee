"""A stand-in for a SandboxFusion server's run_code API, for tools/fixtures/verl_code_fixtures.py
(verl's client against it) and tests/test_sandbox_fusion.py (ours against it). Trusted code only: it
runs what it is sent with a plain subprocess.

It answers in SandboxFusion's response shape: {"status": "Success" | "Failed" | "SandboxError",
"message", "compile_result", "run_result", "executor_pod_name", "files"}, each result
{"status": "Finished" | "TimeLimitExceeded" | "Error", "execution_time", "return_code", "stdout",
"stderr"}. A Python program gets a compile step here (a syntax error is a failed compile_result),
so that verl's compile-error branch is exercised; it then runs with the request's stdin under its
run_timeout.

Markers in the code make it misbehave, for the client's error paths:
    #fake: 504 x<N>        HTTP 504 to the first N requests carrying this code, then a normal answer
    #fake: 500             HTTP 500
    #fake: sandbox-error   {"status": "SandboxError"}
    #fake: not-json        a 200 whose body is not JSON
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
import sys
import tempfile
import threading
import time

from aiohttp import web

_GATEWAY_TIMEOUTS = re.compile(r"#fake: 504 x(\d+)")


def _result(status: str, started: float, return_code=None, stdout: str = "", stderr: str = "") -> dict:
    return {"status": status, "execution_time": round(time.monotonic() - started, 3), "return_code": return_code,
            "stdout": stdout, "stderr": stderr}


def _answer(status: str, compile_result=None, run_result=None, message: str = "") -> web.Response:
    return web.json_response({"status": status, "message": message, "compile_result": compile_result,
                              "run_result": run_result, "executor_pod_name": "fake", "files": {}})


async def _run(code: str, stdin: str | None, timeout: float) -> dict:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fake-sandbox-fusion-") as folder:
        path = os.path.join(folder, "main.py")
        with open(path, "w") as f:
            f.write(code)
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-I", path, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=folder, start_new_session=True)
        try:
            stdout, stderr = await asyncio.wait_for(process.communicate((stdin or "").encode()), timeout)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()
            return _result("TimeLimitExceeded", started)
    return _result("Finished", started, process.returncode, stdout.decode(errors="replace"),
                   stderr.decode(errors="replace"))


class Stats:
    """What the server saw: requests per code, each request's (headers, body), and the most
    requests it was answering at one time."""

    def __init__(self):
        self.seen: collections.Counter = collections.Counter()
        self.bodies: list = []
        self.most_at_once = 0
        self.at_once = 0


def make_app(stats: Stats) -> web.Application:
    async def run_code(request: web.Request) -> web.Response:
        stats.at_once += 1
        stats.most_at_once = max(stats.most_at_once, stats.at_once)
        try:
            return await answer(request)
        finally:
            stats.at_once -= 1

    async def answer(request: web.Request) -> web.Response:
        body = await request.json()
        stats.bodies.append((dict(request.headers), body))
        code = body["code"]
        stats.seen[code] += 1
        gateway = _GATEWAY_TIMEOUTS.search(code)
        if gateway and stats.seen[code] <= int(gateway.group(1)):
            return web.Response(status=504, text="gateway timeout")
        if "#fake: 500" in code:
            return web.Response(status=500, text="internal error")
        if "#fake: not-json" in code:
            return web.Response(status=200, text="<html>not json</html>")
        if "#fake: sandbox-error" in code:
            return _answer("SandboxError", message="the sandbox broke")
        started = time.monotonic()
        try:
            compile(code, "main.py", "exec")
        except (SyntaxError, ValueError) as e:
            return _answer("Failed", compile_result=_result("Finished", started, 1, stderr=str(e)))
        compiled = _result("Finished", started, 0)
        run = await _run(code, body.get("stdin"), float(body["run_timeout"]))
        ok = run["status"] == "Finished" and run["return_code"] == 0
        return _answer("Success" if ok else "Failed", compile_result=compiled, run_result=run)

    app = web.Application()
    app.router.add_post("/run_code", run_code)
    return app


class FakeSandboxFusion:
    """The app served on 127.0.0.1 from a thread of its own (so a blocking client works too)."""

    def __enter__(self) -> "FakeSandboxFusion":
        self._loop = asyncio.new_event_loop()

        async def serve():
            self.stats = Stats()
            self._runner = web.AppRunner(make_app(self.stats))
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]
            self.url = f"http://127.0.0.1:{port}/run_code"

        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(serve(), self._loop).result()
        return self

    def __exit__(self, *_exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
