"""Agent harnesses as their users write them (rollout.agent.harness): async functions that drive
the model through the `openai` client, here over the embedded echo environment."""

from __future__ import annotations

import hashlib

from spmdsplit.agent.echo import EchoDigits

TURNS = 3


async def echo_harness(client, row):
    """The embedded echo task (spmdsplit/agent/echo.py) played through chat completions: the digit
    shown as a user message, the model's one-token answer stepped, the next digit shown after it;
    the episode's reward is the steps' sum. The prompt row only seeds the episode."""
    seed = int.from_bytes(hashlib.sha256(str(row["uid"]).encode()).digest()[:4], "big")
    env = EchoDigits(turns=TURNS)
    shown = env.reset(seed=seed)
    messages, reward = [{"role": "user", "content": shown.text}], 0.0
    for _ in range(TURNS):
        answer = await client.chat.completions.create(model="policy", messages=messages, max_tokens=1)
        text = answer.choices[0].message.content or ""
        shown = env.step(text)
        reward += shown.reward
        if shown.done:
            break
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": shown.text}]
    return {"reward": reward}


async def forgetful_echo_harness(client, row):
    """The echo task with a harness that keeps no history: each call shows only the digit of its
    turn, a conversation of its own, so no call extends the one before and each starts a row of
    the episode (rollout.agent.rows_per_episode trains them)."""
    seed = int.from_bytes(hashlib.sha256(str(row["uid"]).encode()).digest()[:4], "big")
    env = EchoDigits(turns=TURNS)
    shown, reward = env.reset(seed=seed), 0.0
    for _ in range(TURNS):
        answer = await client.chat.completions.create(model="policy", max_tokens=1,
                                                      messages=[{"role": "user", "content": shown.text}])
        shown = env.step(answer.choices[0].message.content or "")
        reward += shown.reward
        if shown.done:
            break
    return {"reward": reward}
