"""Where a job's prompts come from: verl parquet files (`data.train_files` / `data.val_files`),
reasoning-gym's tasks (an entry `reasoning_gym:<task>[,<task>...]` there, spmdsplit/data/reasoning_gym.py)
or, when none are given, the built-in synthetic task (`data.task`).

`build_rows` is the one entry point: it returns rows of one shape whatever the source,

    {"prompt": str | [{"role", "content"}, ...], "data_source": str, "ability": str | None,
     "reward_model": {"ground_truth": ..., "style": ...}, "extra_info": dict,
     "source_row": str | None, "index": int}

(`index` is the row's position in the returned list; `extra_info` is kept as the data has it),
and a report of what was read, skipped and filtered, for the job's log (`format_report`).
Every rank may call it: it reads and decides the same way everywhere, with no collective.
"""

from __future__ import annotations

from spmdsplit.data import reasoning_gym
from spmdsplit.data.parquet import DataError, as_file_list, has_chat_template, read_parquet_rows
from spmdsplit.data.prompts import check_prompt_lengths, check_truncation, filter_overlong_prompts, prompt_lengths
from spmdsplit.data.synthetic import make_dataset
from spmdsplit.seeds import validation_data_seed

SYNTHETIC_VAL_SAMPLES = 256  # validation set of the synthetic task when data.val_files is empty


def _synthetic_rows(data_cfg, split: str) -> list[dict]:
    if split == "train":
        rows = make_dataset(data_cfg.task, int(data_cfg.num_train_samples), int(data_cfg.seed))
    else:
        rows = make_dataset(data_cfg.task, SYNTHETIC_VAL_SAMPLES, validation_data_seed(int(data_cfg.seed)))
    return [
        {
            "prompt": r["prompt"],
            "data_source": r["data_source"],
            "ability": r.get("ability"),
            "reward_model": {"ground_truth": r["reward_model"]["ground_truth"], "style": r["reward_model"].get("style")},
            "extra_info": r.get("extra_info") or {},
            "agent_name": r.get("agent_name"),
            "source_row": None,
        }
        for r in rows
    ]


def build_rows(data_cfg, tokenizer, split: str, tools: list[dict] | None = None,
               default_agent: str = "single_turn_agent",
               environment_tools: list[dict] | None = None) -> tuple[list[dict], dict]:
    """The rows of `split` ("train" or "val") and a report:
    {"split", "source" ("parquet" | "synthetic/<task>"), "files", "rows_read", "malformed",
     "malformed_examples", "skipped", "filtered_overlong", "rows"}, and "reasoning_gym" (the tasks)
    when data.train_files / data.val_files name reasoning-gym's.

    Parquet rows are checked (data.skip_malformed_rows decides whether malformed ones stop the
    job or are dropped and counted); with data.filter_overlong_prompts, prompts longer than
    data.max_prompt_length tokens are dropped and counted; with data.truncation=error and no
    filtering, a parquet prompt that is too long stops the job here, before any training."""
    if split not in ("train", "val"):
        raise ValueError(f"split={split!r}: expected 'train' or 'val'")
    key = "data.train_files" if split == "train" else "data.val_files"
    files = as_file_list(data_cfg.train_files if split == "train" else data_cfg.val_files)
    truncation = data_cfg.truncation
    check_truncation(truncation)
    max_len = int(data_cfg.max_prompt_length)

    specs = [f for f in files if reasoning_gym.is_spec(f)]
    parquet_files = [f for f in files if not reasoning_gym.is_spec(f)]
    if files:
        rows, report = [], {"files": [], "rows_read": 0, "malformed": {}, "malformed_examples": {}, "skipped": 0}
        if parquet_files:
            rows, report = read_parquet_rows(
                parquet_files,
                prompt_key=data_cfg.prompt_key or "prompt",
                skip_malformed=data_cfg.skip_malformed_rows,
                key=key,
            )
        report = {"split": split, "source": "parquet", **report}
        if specs:
            generated, tasks = reasoning_gym.build_rows(specs, data_cfg.reasoning_gym, split, key)
            rows += generated
            report.update(rows_read=report["rows_read"] + len(generated), reasoning_gym=tasks)
    else:
        rows = _synthetic_rows(data_cfg, split)
        report = {
            "split": split,
            "source": f"synthetic/{data_cfg.task}",
            "files": [],
            "rows_read": len(rows),
            "malformed": {},
            "malformed_examples": {},
            "skipped": 0,
        }

    if tools is not None:  # multi-turn: each row's agent, and the tool schemas its prompt is rendered with
        from spmdsplit.agent import attach_tools

        attach_tools(rows, tools, default_agent, key, environment_tools)
    needs_template = any(not isinstance(r["prompt"], str) for r in rows)
    if needs_template and tokenizer is not None and not has_chat_template(tokenizer):
        raise DataError(
            f"{key}: the prompts are chat messages, but the tokenizer has no chat template: use a chat "
            "model's tokenizer (model.path), or give the prompts as plain strings"
            + (" (data.reasoning_gym.chat=false)" if specs else "")
        )

    filtered = 0
    if data_cfg.filter_overlong_prompts:
        if tokenizer is None:
            raise ValueError("data.filter_overlong_prompts needs the tokenizer")
        rows, filtered = filter_overlong_prompts(rows, tokenizer, max_len)
        if not rows:
            raise DataError(
                f"{key}: every prompt is longer than data.max_prompt_length={max_len} tokens "
                f"({filtered} dropped by data.filter_overlong_prompts); raise data.max_prompt_length"
            )
    elif truncation == "error" and files and tokenizer is not None:
        # checked here for files, so a long prompt stops the job before training rather than at its
        # step; the synthetic task's prompts are short by design, and collate_prompts checks them
        check_prompt_lengths(rows, prompt_lengths(rows, tokenizer), max_len, key=key)

    for i, r in enumerate(rows):
        r["index"] = i
    report["filtered_overlong"] = filtered
    report["rows"] = len(rows)
    return rows, report


def format_report(report: dict, max_prompt_length: int | None = None) -> str:
    """One line for the job's log."""
    split, source = report["split"], report["source"]
    if source == "parquet":
        parts = [f"{len(report['files'])} parquet file(s)"] if report["files"] else []
        if report.get("reasoning_gym"):
            parts.append(f"reasoning-gym's task(s) {', '.join(report['reasoning_gym'])}")
        text = f"data ({split}): {report['rows_read']} row(s) from {' and '.join(parts)}"
    else:
        text = f"data ({split}): {report['rows_read']} row(s) of the synthetic task {source}"
    if report.get("skipped"):
        details = "; ".join(
            f"{reason}: {n} [{', '.join(report['malformed_examples'].get(reason, []))}"
            + (", ...]" if n > len(report["malformed_examples"].get(reason, [])) else "]")
            for reason, n in report["malformed"].items()
        )
        text += f"; skipped {report['skipped']} malformed (data.skip_malformed_rows=true): {details}"
    if report.get("filtered_overlong"):
        limit = f"={max_prompt_length}" if max_prompt_length is not None else ""
        text += f"; dropped {report['filtered_overlong']} prompt(s) longer than data.max_prompt_length{limit}"
    return text + f"; {report['rows']} row(s) used"
