"""A verifiers v1 environment as its users write one (a taskset package: `__all__` exports its
Taskset and, here, the Harness its agent plays with), over the embedded echo model: the task
shows a digit, the policy answers one token, and the task's reward is the answer's positional
match with the digit. Named by file in tests (rollout.agent.harness=verifiers:<this file>).

Its harness runs in-process, which verifiers allows of a harness whose model calls go through the
interception endpoint it is handed: the built-in ones (`null`, `bash`, ...) launch a `uv` script
that installs its packages from the network, and these tests run offline."""

from __future__ import annotations

import openai
import verifiers.v1 as vf

from spmdsplit.rewards.rule import positional_match_score

DIGITS = 10


class EchoData(vf.TaskData):
    answer: str = ""  # filled from the row's ground_truth when the row names none


class EchoTask(vf.Task[EchoData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def echoed(self, task: EchoData, trace: vf.Trace) -> float:
        return positional_match_score(trace.last_reply, task.answer)


class EchoTaskset(vf.Taskset[EchoTask, vf.TasksetConfig]):
    """Its own tasks, for verifiers' own eval; spmdsplit builds a task per row instead."""

    def load(self):
        for i in range(DIGITS):
            yield EchoTask(EchoData(prompt=str(i), answer=str(i)), self.config.task)


class EchoHarnessConfig(vf.HarnessConfig):
    max_tokens: int = 1


class EchoHarness(vf.Harness[EchoHarnessConfig]):
    """One chat call with the task's prompt as the user's message."""

    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            reply = await client.chat.completions.create(
                model=ctx.model, messages=[{"role": "user", "content": data.prompt_text}],
                max_tokens=self.config.max_tokens)
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout=reply.choices[0].message.content or "", stderr="")


__all__ = ["EchoTaskset", "EchoHarness"]
