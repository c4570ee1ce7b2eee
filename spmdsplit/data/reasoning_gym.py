"""reasoning-gym's procedural tasks as prompt rows: `data.train_files` / `data.val_files` naming
`reasoning_gym:<task>[,<task>...]` (the options are data.reasoning_gym.*), and the entries behind
the rows rebuilt for scoring (spmdsplit/rewards/reasoning_gym.py).

A row has verl's shape: the prompt (reasoning-gym's system prompt, then the question), data_source
`reasoning_gym/<task>`, ability the task's category, reward_model.ground_truth the task's answer as
text ("" for the tasks that have many answers and give none; only shown, never compared), and
extra_info `{"task", "config", "index", "split"}`: the dataset's config as JSON (its size and seed
among it) and the entry's index, from which the entry is rebuilt. The entry itself is not stored:
several tasks' metadata (tuples, sets, objects) does not survive a JSON or parquet round trip, and
their scorers read it.

Every rank builds the same rows: an entry depends on its task, config and index only.
"""

from __future__ import annotations

import difflib
import functools
import json

from spmdsplit.data.parquet import DataError
from spmdsplit.seeds import validation_data_seed

PREFIX = "reasoning_gym:"  # in data.train_files / data.val_files
DATA_SOURCE_PREFIX = "reasoning_gym/"  # the rows' data_source: the scorer of spmdsplit/rewards/rule.py
INSTALL = "reasoning-gym is not installed; install the extra: pip install -e '.[reasoning-gym]'"


def is_spec(entry: str) -> bool:
    return str(entry).startswith(PREFIX)


def _library(key: str):
    try:
        import reasoning_gym
    except ImportError:
        raise DataError(f"{key}: {INSTALL}") from None
    return reasoning_gym


def parse_tasks(spec: str, key: str) -> list[str]:
    """The task names of one `reasoning_gym:a,b` entry; an unknown name is a DataError naming the
    key, the name and the closest known one."""
    known = _library(key).factory.DATASETS
    tasks = [t.strip() for t in spec[len(PREFIX):].split(",") if t.strip()]
    if not tasks:
        raise DataError(f"{key}={spec!r}: no task named; e.g. {PREFIX}leg_counting,basic_arithmetic")
    for task in tasks:
        if task not in known:
            close = difflib.get_close_matches(task, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" ({len(known)} tasks: reasoning_gym.factory.DATASETS)"
            raise DataError(f"{key}={spec!r}: reasoning-gym has no task {task!r}{hint}")
    return tasks


@functools.cache
def dataset(task: str, config: str):
    """The task's dataset for a JSON config (its keyword arguments: size, seed, ...), built once
    per process: rows and scorer rebuild entries from it."""
    import reasoning_gym

    return reasoning_gym.create_dataset(task, **json.loads(config))


@functools.lru_cache(maxsize=65536)  # rollout.n scores the same entry n times
def entry(task: str, config: str, index: int) -> dict:
    return dataset(task, config)[index]


def split_seed(seed: int, split: str) -> int:
    """The seed of a split's entries: the validation split's is offset, so it shares none with training."""
    return validation_data_seed(int(seed)) if split == "val" else int(seed)


def config_json(size: int, seed: int) -> str:
    return json.dumps({"seed": int(seed), "size": int(size)}, sort_keys=True)


def make_rows(tasks: list[str], size: int, seed: int, split: str, system_prompt: str = "default",
              chat: bool = True, key: str = "data.train_files") -> list[dict]:
    """`size` entries of each task, as rows (in the order of `tasks`, then of index). `system_prompt`
    names one of reasoning_gym.utils.SYSTEM_PROMPTS ("" = none); `chat=False` gives one plain-text
    prompt, system prompt and question joined by a blank line, for a tokenizer without a chat template."""
    prompts = _library(key).utils.SYSTEM_PROMPTS
    if system_prompt and system_prompt not in prompts:
        raise DataError(f"data.reasoning_gym.system_prompt={system_prompt!r}: expected one of {sorted(prompts)} or ''")
    system = prompts[system_prompt] if system_prompt else ""
    config = config_json(size, seed)
    rows = []
    for task in tasks:
        ds = dataset(task, config)
        for index in range(int(size)):
            item = entry(task, config, index)
            question = item["question"]
            if chat:
                prompt = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
            else:
                prompt = f"{system}\n\n{question}" if system else question
            answer = item.get("answer")
            rows.append({
                "prompt": prompt,
                "data_source": DATA_SOURCE_PREFIX + task,
                "ability": ds.category,
                "reward_model": {"ground_truth": "" if answer is None else str(answer), "style": "rule"},
                "extra_info": {"task": task, "config": config, "index": index, "split": split},
                "agent_name": None,
                "source_row": f"{PREFIX}{task}[{index}]",
            })
    return rows


def build_rows(specs: list[str], rg_cfg, split: str, key: str) -> tuple[list[dict], list[str]]:
    """The rows of data.train_files' / data.val_files' `reasoning_gym:` entries, and their tasks;
    the validation split has val_size entries per task, and its own seed (split_seed)."""
    tasks = [task for spec in specs for task in parse_tasks(spec, key)]
    size = rg_cfg.size if split == "train" else rg_cfg.val_size
    return make_rows(tasks, size, split_seed(rg_cfg.seed, split), split, rg_cfg.system_prompt, rg_cfg.chat, key), tasks
