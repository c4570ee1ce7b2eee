"""The embedded lookup task's tool: a verl-style class that knows each row's code (given per row in
extra_info.tools_kwargs.lookup.create_kwargs) and answers it when called."""

from __future__ import annotations

import uuid

from spmdsplit.agent.tools import BaseTool, ToolResponse


class LookupTool(BaseTool):
    def __init__(self, config: dict, tool_schema):
        super().__init__(config, tool_schema)
        self.codes: dict[str, str] = {}

    async def create(self, instance_id: str | None = None, create_kwargs: dict | None = None, **kwargs):
        instance_id = instance_id or uuid.uuid4().hex
        self.codes[instance_id] = str((create_kwargs or {}).get("code", ""))
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict, **kwargs):
        return ToolResponse(text=self.codes[instance_id]), 0.0, {}

    async def release(self, instance_id: str, **kwargs) -> None:
        self.codes.pop(instance_id, None)
