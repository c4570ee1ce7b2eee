"""The real job, with a probe on the actor pool that writes down what the engines generated and which
adapter they were given (for test_lora_e2e.py): run as a torchrun script with PROBE_DIR set.

- `adapter_v<k>.pt`: the policy's adapter after update k (k = 0: before the first), whole, written by
  the actor pool's first rank (every actor rank takes part in the gathers).
- `rows_s<step>_r<rank>.pt`: each actor rank's rows of a step, as they came from the engine, with
  the version of the weights they were generated with (the rollout pool's `weights_version`, else
  step - 1: an engine on the actor's or the critic's pool takes the weights of the last update).

PROBE_SKIP_SYNC=1 makes every engine keep the first weights it was given: the later syncs still
stream (their collectives run), and the engine drops what they bring.
"""

import os
import sys

import torch

from spmdsplit import lora
from spmdsplit.programs.actor import ActorProgram
from spmdsplit.inference.hf import HFEngine
from spmdsplit.train import main

OUT = os.environ["PROBE_DIR"]
COLUMNS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "rollout_log_probs")


def dump_adapter(program: ActorProgram, version: int) -> None:
    adapter = {n: t.clone() for n, t in program.actor.engine.iter_full_weights(torch.float32, only=lora.is_adapter)}
    if program.pools.rank == program.pools.placement.ranks("actor")[0]:
        torch.save(adapter, os.path.join(OUT, f"adapter_v{version}.pt"))


original_start, original_compute_log_probs, original_update = ActorProgram.start, ActorProgram.compute_log_probs, ActorProgram.update


def start(self, step):
    dump_adapter(self, step - 1)
    return original_start(self, step)


def compute_log_probs(self, step):
    original_compute_log_probs(self, step)
    rows = self.rollout_batch
    version = rows["weights_version"].cpu() if "weights_version" in rows else torch.full((len(rows),), step - 1)
    torch.save({**{c: rows[c].cpu() for c in COLUMNS}, "version": version},
               os.path.join(OUT, f"rows_s{step}_r{self.pools.rank}.pt"))


def update(self, step):
    metrics = original_update(self, step)
    dump_adapter(self, step)
    return metrics


ActorProgram.start, ActorProgram.compute_log_probs, ActorProgram.update = start, compute_log_probs, update

if os.environ.get("PROBE_SKIP_SYNC") == "1":
    engines = [HFEngine]
    try:
        from spmdsplit.inference.vllm_engine import VLLMEngine

        engines.append(VLLMEngine)
    except ImportError:
        pass

    def keep_first(load):
        def load_weights(self, weights):
            if getattr(self, "probe_loaded", False):
                for _ in weights:  # the sync runs; the engine keeps what it had
                    pass
                return
            self.probe_loaded = True
            load(self, weights)
        return load_weights

    for engine in engines:
        engine.load_weights = keep_first(engine.load_weights)

sys.exit(main())
