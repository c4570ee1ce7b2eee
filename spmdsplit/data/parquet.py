"""verl's parquet data: reading, checking and normalising rows, and rendering chat prompts.

A verl dataset is one or more parquet files with one row per prompt:

- `prompt` (the column `data.prompt_key` names): chat messages, a list of `{role, content}`
  (a plain string is accepted too and used as it is, without a chat template);
- `data_source`: which scorer rates the responses (e.g. `openai/gsm8k`);
- `ability`: a free-form label (e.g. `math`), optional;
- `reward_model`: a struct whose `ground_truth` the rule reward compares the response to;
- `extra_info`: a struct of anything else (split, index, the raw question, ...), optional; for
  multi-turn rows `extra_info.tools_kwargs` holds each tool's per-row arguments (docs/agents.md);
- `agent_name`: `tool_agent` or `single_turn_agent` (rollout.multi_turn), optional.

Every row is checked. A malformed row (a missing or empty prompt, a prompt of the wrong type, no
data_source, no ground truth, ...) is never dropped silently: by default the job stops with the
rows' numbers (`file:row`, counted from 0) and the count per reason; with
`data.skip_malformed_rows=true` the rows are dropped and counted in the report.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

# The reasons a row can be malformed, with what the error message says about them.
REASONS = {
    "missing prompt": "the prompt is null",
    "empty prompt": "the prompt is an empty string, an empty list, or messages with only empty contents",
    "prompt of wrong type": "the prompt is neither a string nor a list of {role, content} messages",
    "malformed message": "a prompt message is not a {role, content} struct with string role and content",
    "missing data_source": "no data_source column, or a null data_source",
    "bad data_source": "data_source is not a non-empty string",
    "bad ability": "ability is neither a string nor null",
    "missing reward_model": "no reward_model column, or a null reward_model",
    "missing ground_truth": "reward_model is not a struct with a non-null ground_truth",
    "bad extra_info": "extra_info is neither a struct (dict) nor null",
    "bad agent_name": "agent_name is neither a string nor null",
    "bad tools_kwargs": "extra_info.tools_kwargs is neither a struct (dict) nor null",
}
EXAMPLES_PER_REASON = 10  # row ids shown per reason in an error or a report
COLUMNS = ("data_source", "ability", "reward_model", "extra_info", "agent_name")


class DataError(ValueError):
    """Data that cannot be used as it is; the message names the config key, the file and the rows."""


def as_file_list(files: Any) -> list[str]:
    """`data.train_files` / `data.val_files` as a list of paths: a path, a list of paths (also an
    OmegaConf ListConfig or a tuple), or ""/None/[] for none."""
    if files is None:
        return []
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    out = []
    for f in files:
        f = os.fspath(f).strip() if f is not None else ""
        if f:
            out.append(f)
    return out


def _check_prompt(prompt: Any) -> tuple[str | None, Any]:
    """(reason, normalised prompt): reason is None for a good prompt."""
    if prompt is None:
        return "missing prompt", None
    if isinstance(prompt, str):
        return (None, prompt) if prompt.strip() else ("empty prompt", None)
    if hasattr(prompt, "tolist") and not isinstance(prompt, (dict, bytes)):  # a numpy array from pandas
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        return "prompt of wrong type", None
    if not prompt:
        return "empty prompt", None
    messages = []
    for m in prompt:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return "malformed message", None
        if not m["role"].strip():
            return "malformed message", None
        messages.append({"role": m["role"], "content": m["content"]})
    if not any(m["content"].strip() for m in messages):
        return "empty prompt", None
    return None, messages


def _check_row(raw: dict, prompt_key: str) -> tuple[str | None, dict | None]:
    reason, prompt = _check_prompt(raw.get(prompt_key))
    if reason:
        return reason, None
    source = raw.get("data_source")
    if source is None:
        return "missing data_source", None
    if not isinstance(source, str) or not source.strip():
        return "bad data_source", None
    ability = raw.get("ability")
    if ability is not None and not isinstance(ability, str):
        return "bad ability", None
    reward_model = raw.get("reward_model")
    if reward_model is None:
        return "missing reward_model", None
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        return "missing ground_truth", None
    extra_info = raw.get("extra_info")
    if extra_info is None:
        extra_info = {}
    if not isinstance(extra_info, dict):
        return "bad extra_info", None
    agent_name = raw.get("agent_name")
    if agent_name is not None and not isinstance(agent_name, str):
        return "bad agent_name", None
    if extra_info.get("tools_kwargs") is not None and not isinstance(extra_info["tools_kwargs"], dict):
        return "bad tools_kwargs", None
    return None, {
        "prompt": prompt,
        "data_source": source,
        "ability": ability,
        "reward_model": {"ground_truth": reward_model["ground_truth"], "style": reward_model.get("style")},
        "extra_info": extra_info,
        "agent_name": agent_name,
    }


def _read_file(path: str, prompt_key: str, key: str) -> list[dict]:
    import pyarrow.parquet as pq

    local = os.path.expanduser(path)
    if not os.path.exists(local):
        raise DataError(f"{key}: no such file: {path}")
    if os.path.isdir(local):
        raise DataError(f"{key}: {path} is a directory; list its parquet files instead")
    try:
        pfile = pq.ParquetFile(local)
        names = list(pfile.schema_arrow.names)
    except Exception as e:  # pyarrow raises several types for a file that is not parquet
        raise DataError(f"{key}: cannot read {path} as parquet: {e}") from e
    if prompt_key not in names:
        raise DataError(
            f"{key}: {path} has no column {prompt_key!r} (data.prompt_key); its columns are {names}"
        )
    wanted = [c for c in (prompt_key, *COLUMNS) if c in names]
    try:
        return pfile.read(columns=wanted).to_pylist()
    except Exception as e:
        raise DataError(f"{key}: cannot read {path}: {e}") from e


def read_parquet_rows(
    files: Any, prompt_key: str = "prompt", skip_malformed: bool = False, *, key: str = "data.train_files"
) -> tuple[list[dict], dict]:
    """Reads verl parquet files into rows of one shape:

        {"prompt": str | [{"role", "content"}, ...], "data_source": str, "ability": str | None,
         "reward_model": {"ground_truth": ..., "style": ...}, "extra_info": dict,
         "source_row": "<file>:<row>"}

    Returns (rows, report), report = {"files", "rows_read", "malformed": {reason: count},
    "malformed_examples": {reason: [first row ids]}, "skipped", "rows"}. Malformed rows raise a
    DataError listing them unless `skip_malformed`, which drops them (counted in the report).
    `key` is the config key named in errors (data.train_files or data.val_files).
    """
    paths = as_file_list(files)
    if not paths:
        raise DataError(f"{key}: no parquet file given")
    rows: list[dict] = []
    bad: dict[str, list[str]] = defaultdict(list)
    rows_read = 0
    for path in paths:
        for i, raw in enumerate(_read_file(path, prompt_key, key)):
            rows_read += 1
            row_id = f"{path}:{i}"
            reason, row = _check_row(raw, prompt_key)
            if reason:
                bad[reason].append(row_id)
            else:
                row["source_row"] = row_id
                rows.append(row)
    malformed = {reason: len(ids) for reason, ids in bad.items()}
    examples = {reason: ids[:EXAMPLES_PER_REASON] for reason, ids in bad.items()}
    if bad and not skip_malformed:
        raise DataError(malformed_message(key, rows_read, bad))
    if not rows:
        raise DataError(
            f"{key}: no usable rows in {paths} ({rows_read} read, {sum(malformed.values())} malformed)"
            + (f": {describe_malformed(malformed, examples)}" if malformed else "")
        )
    report = {
        "files": paths,
        "rows_read": rows_read,
        "malformed": malformed,
        "malformed_examples": examples,
        "skipped": sum(malformed.values()),
        "rows": len(rows),
    }
    return rows, report


def describe_malformed(counts: dict[str, int], examples: dict[str, list[str]]) -> str:
    parts = []
    for reason, n in counts.items():
        shown = examples.get(reason, [])
        more = f", ... ({n - len(shown)} more)" if n > len(shown) else ""
        parts.append(f"{reason}: {n} row(s) [{', '.join(shown)}{more}]")
    return "; ".join(parts)


def malformed_message(key: str, rows_read: int, bad: dict[str, list[str]]) -> str:
    total = sum(len(ids) for ids in bad.values())
    lines = [f"{key}: {total} of {rows_read} row(s) are malformed (rows as file:row, counted from 0):"]
    for reason, ids in bad.items():
        shown = ids[:EXAMPLES_PER_REASON]
        more = f", ... ({len(ids) - len(shown)} more)" if len(ids) > len(shown) else ""
        lines.append(f"  {reason} ({REASONS[reason]}): {len(ids)} row(s): {', '.join(shown)}{more}")
    lines.append("Fix the data, or set data.skip_malformed_rows=true to drop these rows (they are counted in the log).")
    return "\n".join(lines)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


# The agent of an environment's episodes (rollout.multi_turn.environment): its prompt is rendered
# without the generation prompt, which follows the environment's first observation (agent/chat.py).
ENVIRONMENT_AGENT = "environment_agent"


def render_prompt(prompt: str | list[dict], tokenizer, tools: list[dict] | None = None,
                  generation_prompt: bool = True) -> str:
    """The text the model sees: chat messages through the tokenizer's chat template, with the
    generation prompt (as verl does; not for an environment's episode, whose first observation
    comes first) and, for a tool agent's row, the tools' schemas (the template decides how the
    model is shown them); a plain string as it is."""
    if isinstance(prompt, str):
        return prompt
    if not has_chat_template(tokenizer):
        raise DataError(
            "the prompts are chat messages, but the tokenizer has no chat template: use a chat model's "
            "tokenizer (model.path), set tokenizer.chat_template, or give the prompts as plain strings"
        )
    messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                         **({"tools": tools} if tools else {}))
    if not isinstance(text, str):  # some tokenizers return a list for a single conversation
        text = text[0] if isinstance(text, (list, tuple)) and len(text) == 1 else str(text)
    return text
