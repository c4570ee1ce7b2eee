"""One of the project's rollout engines served over the OpenAI API on localhost, so that code written
for a hosted model with the `openai` client (an LLM judge in a reward function, an agent harness)
runs unchanged against it.

- driver.py: `EngineDriver`, the engine owned by one stepping thread while it serves: requests from
  any thread batched into the same engine steps, pause/resume around a sleep, stop.
"""

from __future__ import annotations

from spmdsplit.serving.driver import Completion, ContextTooLong, DriverStopped, EngineDriver  # noqa: F401
