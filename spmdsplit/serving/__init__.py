"""One of the project's rollout engines served over the OpenAI API on localhost, so that code written
for a hosted model with the `openai` client (an LLM judge in a reward function, an agent harness)
runs unchanged against it (docs/rollout.md "Serving an engine over the OpenAI API").

- driver.py: `EngineDriver`, the engine owned by one stepping thread while it serves: requests from
  any thread batched into the same engine steps, pause/resume around a sleep, stop;
- protocol.py: the API's requests read into token ids (what the engines cannot do refused, with
  OpenAI's error body) and its responses written; `Record`, what the record hook gets;
- server.py: `OpenAIServer`, the aiohttp server on its own event loop thread (the only module that
  imports aiohttp; imported from here only when `OpenAIServer` is asked for).
"""

from __future__ import annotations

from spmdsplit.serving.driver import Completion, ContextTooLong, DriverStopped, EngineDriver  # noqa: F401
from spmdsplit.serving.protocol import Record  # noqa: F401


def __getattr__(name: str):
    if name in ("OpenAIServer", "PortInUse"):  # aiohttp, only when a server is wanted
        from spmdsplit.serving import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
