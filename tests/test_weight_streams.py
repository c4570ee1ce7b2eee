"""The weights' stream to a rollout pool apart scales with the number of sources (issue 36).

With a rollout pool of its own every actor rank is a source of the policy's weights, and each
bucket of the stream is gathered from the actor ranks' FSDP2 shards to the one rank that
broadcasts it (spmdsplit/weight_sync.py `push`). Real processes on gloo: an actor pool of S = 1, 2
and 4 ranks, each a real FSDPEngine over its pool, and one rollout rank receiving. Every
collective an actor rank runs during a sync is seen at torch's dispatcher and the bytes it brings
to that rank are added up; beside it, the same for what every actor rank ran per sync before (each
weight all-gathered whole on every rank: `iter_full_weights`).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.launch import run_ranks


class ReceivedBytes(TorchDispatchMode):
    """Adds up the bytes that gathers bring to this rank from others while inside: an all-gather's
    output beyond its own input, a gather's outputs beyond its own on the root. (An actor rank is
    the root of every broadcast it takes part in: those only send.)"""

    def __init__(self):
        super().__init__()
        self.received = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        out = func(*args, **(kwargs or {}))
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        if "all_gather_into_tensor" in name:  # functional (DTensor.full_tensor): out = input x group size
            self.received += nbytes(args[0]) * (args[1] - 1)
        elif name.startswith("gather_"):  # c10d.gather_(outputs [[...]], inputs [t], group, root, ...)
            outputs = args[0][0] if args[0] else []
            if outputs:  # the root: every rank's part, its own among them
                self.received += sum(nbytes(t) for t in outputs) - nbytes(args[1][0])
        return out


def stream_to_a_rollout_rank(rank, world_size, model_dir):
    """Ranks 0..S-1: the actor pool (FSDP2), every one a source; rank S: the rollout pool. Two
    syncs (the first also carries the layout); each actor rank counts what the second brought
    it, then what gathering every weight whole (the stream before) brings it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from spmdsplit.engines.fsdp import FSDPEngine
    from spmdsplit.models import ModelSource
    from spmdsplit.weight_sync import WeightBroadcast

    sources = list(range(world_size - 1))
    actor_pool = dist.new_group(sources)
    groups = [dist.new_group([src, world_size - 1]) for src in sources]  # every rank makes every group
    groups = [g if rank in (src, world_size - 1) else None for src, g in zip(sources, groups)]
    sync = WeightBroadcast(sources, groups, torch.device("cpu"), bucket_mb=0.01)
    result = {}
    if rank in sources:
        engine = FSDPEngine.from_source(ModelSource("causal_lm", model_dir, torch.float32, seed=0),
                                        DeviceMesh.from_group(actor_pool, "cpu"), torch.device("cpu"),
                                        param_dtype=torch.bfloat16)
        for sync_index in range(2):
            sync.ready()
            with ReceivedBytes() as counted:
                sync.push(engine.iter_weight_shards(torch.bfloat16), actor_pool)
        result["push"] = counted.received
        with ReceivedBytes() as counted:
            weights = {name: tensor.clone() for name, tensor in engine.iter_full_weights(torch.bfloat16)}
        result["all_gather"] = counted.received
        result["model_bytes"] = sum(t.numel() * t.element_size() for t in weights.values())
        result["weights"] = weights if rank == 0 else None
    else:
        for sync_index in range(2):
            sync.ready()
            result["weights"] = {name: tensor.clone() for name, tensor in sync.receive()}
        result["buckets"] = len(sync.layout)
    return result


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The embedded model's shape with eight blocks and a vocabulary that divides by no pool (FSDP2's
    last chunks shorter or empty there), so that the stream has a few dozen buckets."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from spmdsplit.embedded import MODEL_SHAPE, build_tokenizer
    from spmdsplit.models import hf_tensors, save_hf_folder

    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=1001, pad_token_id=tokenizer.pad_token_id, **{**MODEL_SHAPE, "num_hidden_layers": 8})
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    folder = str(tmp_path_factory.mktemp("stream"))
    save_hf_folder(model, hf_tensors(model), folder, tokenizer)
    return folder


@pytest.mark.parametrize("sources", [1, 2, 4])
def test_bytes_an_actor_rank_receives_per_sync_fall_with_the_number_of_sources(model_dir, sources):
    results = run_ranks(stream_to_a_rollout_rank, sources + 1, model_dir, timeout=180)
    actor, rollout = results[:sources], results[sources]
    expected = actor[0]["weights"]
    assert list(rollout["weights"]) == list(expected), set(rollout["weights"]) ^ set(expected)
    assert rollout["buckets"] > 2 * sources
    for name, tensor in expected.items():  # bitwise the bf16 weights, put together from every rank's shard
        assert torch.equal(rollout["weights"][name], tensor), name
    model, largest = actor[0]["model_bytes"], max(t.numel() * t.element_size() for t in expected.values())
    # Before: every weight whole on every rank, (S - 1) / S of the model brought to each.
    for rank in actor:
        assert rank["all_gather"] == pytest.approx(model * (sources - 1) / sources, rel=0.05)
    # Now: each bucket only to its owner, (S - 1) / S of it. A source owns 1 / S of the model, give
    # or take its largest bucket (owners are picked as the buckets come: the least loaded so far).
    # The parts are padded to whole chunks (the vocabulary of 1001 rows divides by no pool): 5 %.
    pushed = [rank["push"] for rank in actor]
    print(f"\nS={sources}: bytes received per actor rank per sync, of a {model / 2**20:.2f} MiB bf16 model: "
          f"before {[round(r['all_gather'] / model, 3) for r in actor]} of it, now {[round(p / model, 3) for p in pushed]}")
    assert sum(pushed) == pytest.approx(model * (sources - 1) / sources, rel=0.05)
    for received in pushed:
        assert received <= (model / sources + largest) * (sources - 1) / sources * 1.05
    if sources == 1:
        assert pushed == [0]
