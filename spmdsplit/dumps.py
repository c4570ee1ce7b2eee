"""trainer.rollout_data_dir and trainer.validation_data_dir: each step's responses as verl writes
them, one JSONL file per step (<dir>/<step>.jsonl), a line per response with verl's fields, input
(the prompt's text), output (the response's), gts (the ground truth), score (its total score) and
step, and ours: data_source, uid, row_index (its place in the step's batch, the order of the
lines), weights_version (the update whose weights generated it, where a rollout pool of its own
says so), for agent episodes num_turns, tool_calls and tool_errors, and with an LLM judge its
verdict (judge_verdict: the text it wrote; "" for rows it did not score).

The ranks that hold the scored rows write them: the critic group's for training (the rows as
trained), the reward group's for validation. Each rank decodes its own rows; the pool's first rank
gathers the lines over the pool's gloo meeting group and writes the file in a thread of its own, so
a step waits for the decoding and one gather, never for the disk (`close` waits for the writes at
the end of the run). A resumed run writes its steps' files anew."""

from __future__ import annotations

import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spmdsplit.batch import Batch
from spmdsplit.roles.reward import VERDICT_TEXT, decoded_prompts, host_lists, response_lengths, response_texts

# Our columns a line carries when the rows have them (besides verl's fields).
EXTRA_COLUMNS = ("weights_version", "num_turns", "tool_calls", "tool_errors", "env_terminated", "env_truncated",
                 "harness_rows_dropped", "episode_row")


def dump_lines(tokenizer, eos_ids: list[int], step: int, rows: Batch, scores: torch.Tensor) -> list[dict]:
    """One dict per row: verl's fields and ours, texts decoded as verl decodes them for its dumps
    (special tokens dropped; the EOS ending a response too)."""
    inputs = decoded_prompts(tokenizer, rows, skip_special_tokens=True)
    outputs = response_texts(tokenizer, rows["responses"], response_lengths(rows), set(eos_ids), skip_special_tokens=True)
    columns = {"score": scores.float(), "row_index": rows["row_index"],
               **{k: rows[k] for k in EXTRA_COLUMNS if k in rows}}
    numbers = dict(zip(columns, host_lists(*columns.values())))
    return [{"input": inputs[i], "output": outputs[i], "gts": rows["ground_truth"][i], "score": numbers["score"][i],
             "step": step, "data_source": rows["data_source"][i], "uid": str(rows["uid"][i]) if "uid" in rows else None,
             **{k: numbers[k][i] for k in numbers if k != "score"},
             **({VERDICT_TEXT: rows[VERDICT_TEXT][i]} if VERDICT_TEXT in rows else {})}
            for i in range(len(rows))]


def write_file(path: str, lines: list[dict]) -> None:
    """The step's lines in the order of the batch, written whole (a resumed run's step replaces them)."""
    lines = sorted(lines, key=lambda line: line["row_index"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    os.replace(path + ".tmp", path)  # a reader never sees half a file


class RowDump:
    """One folder's dumps, on every rank of the pool that holds the rows; `group`: the pool's gloo
    meeting group (None: a pool of one rank); `writer`: this rank writes the files (the pool's first)."""

    def __init__(self, folder: str, tokenizer, eos_ids: list[int], group, writer: bool):
        self.folder, self.tokenizer, self.eos_ids, self.group, self.writer = folder, tokenizer, eos_ids, group, writer
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="dump") if writer else None
        self.writes: list[Future] = []

    def write(self, step: int, rows: Batch, scores: torch.Tensor) -> None:
        """This rank's `rows` of `step` with their `scores` ([B] floats); every rank of the pool calls it."""
        lines = dump_lines(self.tokenizer, self.eos_ids, step, rows, scores)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            every = [None] * dist.get_world_size(self.group) if self.writer else None
            dist.gather_object(lines, every, group=self.group, group_dst=0)
            lines = [line for part in every for line in part] if self.writer else []
        if self.writer:
            for done in [w for w in self.writes if w.done()]:
                done.result()  # a write that failed raises here, at the next step
            self.writes = [w for w in self.writes if not w.done()]
            self.writes.append(self.thread.submit(write_file, os.path.join(self.folder, f"{step}.jsonl"), lines))

    def close(self) -> None:
        for w in self.writes:
            w.result()
        if self.thread:
            self.thread.shutdown()


@dataclass
class Dumps:
    """A rank's dumps: each None where its folder is "" or its rows are not on this rank."""

    rollout: RowDump | None = None  # trainer.rollout_data_dir, on the critic group's ranks
    validation: RowDump | None = None  # trainer.validation_data_dir, on the reward group's ranks

    def close(self) -> None:
        for dump in (self.rollout, self.validation):
            if dump is not None:
                dump.close()
