"""Models load straight into their engine's layout, and weights leave it as a stream.

Three real processes on gloo: pool A is global rank 0 alone, pool B ranks 1-2 (its first rank, the
one that reads the checkpoint, is *not* global rank 0, as in a critic pool). Both pools run at once
and each checks the same things, so every check runs on a pool of 1 and a pool of 2:
- each role's model, loaded by its engine from a `ModelSource`, has exactly the weights (and the
  rotary buffers: a forward gives the same output) of a plain `from_pretrained` of that source,
  value and score heads included (fresh, seeded on the reader only);
- after an update, `iter_full_weights` into the rollout copy leaves it equal to the actor's weights;
- the HF export is written in the engine's compute dtype and loads back equal.
The test model ties its head to its embeddings (as Qwen2.5-0.5B does), the case most easily broken
by sharding, streaming by name, or loading a stream.
"""

import importlib.util
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.launch import run_ranks
from tests.support.helpers import ROWS, make_batch

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")


def kinds(engine: str) -> dict:
    """Each kind of model and the dtype it is loaded in: trained ones fp32 masters, the frozen
    reward model in bf16 (DeepSpeed holds a frozen bf16 model only on GPU: fp32 there)."""
    return {"causal_lm": torch.float32, "value": torch.float32,
            "reward": torch.bfloat16 if engine == "fsdp" else torch.float32}


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    """The embedded model's tokenizer and shape, with the head tied to the embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from spmdsplit.embedded import MODEL_SHAPE, build_tokenizer
    from spmdsplit.models import hf_tensors, save_hf_folder

    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         **{**MODEL_SHAPE, "tie_word_embeddings": True})
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    folder = str(tmp_path_factory.mktemp("tied"))
    save_hf_folder(model, hf_tensors(model), folder, tokenizer)
    return folder


def _outputs(model_or_engine, batch):
    out = model_or_engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    return out.logits.float().detach().clone()


def _engine(name, source, group, optim, param_dtype=None):
    from spmdsplit.engines.fsdp import FSDPEngine

    if name == "fsdp":
        return FSDPEngine.from_source(source, DeviceMesh.from_group(group, "cpu"), torch.device("cpu"), optim, param_dtype)
    from spmdsplit.engines.deepspeed import DeepSpeedEngine

    return DeepSpeedEngine.from_source(source, group, 3, torch.device("cpu"), optim, param_dtype)


def _load_update_sync(rank, world_size, model_dir, engine_name, out_dir):
    from spmdsplit.config import ActorConfig, OptimConfig, RolloutConfig
    from spmdsplit.exchange import row_ranges
    from spmdsplit.models import ModelSource, load_causal_lm, load_tokenizer
    from spmdsplit.roles.actor import Actor
    from spmdsplit.inference.hf import HFEngine

    pools = [dist.new_group([0]), dist.new_group([1, 2])]
    group = pools[0] if rank == 0 else pools[1]
    pool_rank, pool_size = dist.get_rank(group), dist.get_world_size(group)
    batch = make_batch(len(load_tokenizer(model_dir)))
    result = {"loaded": {}, "outputs": {}}
    optim = OptimConfig(lr=1e-2, lr_warmup_steps=0, grad_clip=1e9)
    for kind, dtype in kinds(engine_name).items():
        engine = _engine(engine_name, ModelSource(kind, model_dir, dtype, seed=7), group,
                         optim if kind != "reward" else None)
        result["loaded"][kind] = {k: v.clone() for k, v in engine.iter_full_weights()}
        result["outputs"][kind] = _outputs(engine, batch)

    # The actor: bf16 compute under FSDP (so the export has a compute dtype that is not the masters').
    mixed = torch.bfloat16 if engine_name == "fsdp" else None
    engine = _engine(engine_name, ModelSource("causal_lm", model_dir, torch.float32, seed=7), group, optim, mixed)
    cfg = ActorConfig(optim=optim, ppo_mini_batch_size=ROWS // 2, ppo_micro_batch_size_per_gpu=2, shuffle=False)
    actor = Actor(engine, cfg, temperature=1.0, device=torch.device("cpu"))
    actor.update_policy(make_batch(len(load_tokenizer(model_dir))).slice(*row_ranges(ROWS, pool_size)[pool_rank]),
                        seed=1)
    actor_weights = {k: v.clone() for k, v in engine.iter_full_weights()}
    rollout, gathered_dtypes = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        copy = HFEngine(load_causal_lm(model_dir, dtype, torch.device("cpu"), seed=0), load_tokenizer(model_dir),
                        RolloutConfig(), 4)
        with _AllGatherDtypes() as seen:
            copy.load_weights(engine.iter_full_weights(copy.dtype))
        gathered_dtypes[dtype] = seen.dtypes
        assert copy.model.lm_head.weight is copy.model.model.embed_tokens.weight  # still tied
        rollout[dtype] = {k: v.clone() for k, v in copy.model.state_dict().items()}
    hf_dir = os.path.join(out_dir, f"hf-pool{pool_size}")
    engine.save_hf(hf_dir, load_tokenizer(model_dir), is_writer=pool_rank == 0)
    return {**result, "actor": actor_weights, "rollout": rollout, "hf_dir": hf_dir, "compute_dtype": engine.compute_dtype,
            "gathered_dtypes": gathered_dtypes, "pool_size": pool_size}


class _AllGatherDtypes(TorchDispatchMode):
    """Records the dtype of every tensor all-gathered (DTensor's full_tensor) while inside."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "all_gather" in func.__name__:
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def _check(results, model_dir, engine):
    from safetensors import safe_open

    from spmdsplit.models import ModelSource, load_causal_lm, load_tokenizer

    batch = make_batch(len(load_tokenizer(model_dir)))
    plain = {}
    for kind, dtype in kinds(engine).items():
        plain[kind] = ModelSource(kind, model_dir, dtype, seed=7).read("cpu").eval()
    for rank, got in enumerate(results):
        for kind, model in plain.items():
            expected = {k: v for k, v in model.named_parameters()}
            assert got["loaded"][kind].keys() == expected.keys(), (rank, kind)
            for name, tensor in expected.items():
                torch.testing.assert_close(got["loaded"][kind][name], tensor, rtol=0, atol=0, msg=f"rank {rank} {kind} {name}")
            torch.testing.assert_close(got["outputs"][kind], _outputs(model, batch), rtol=1e-5, atol=1e-5,
                                       msg=f"rank {rank} {kind} forward")
        moved = (got["actor"]["model.embed_tokens.weight"] - plain["causal_lm"].model.embed_tokens.weight).abs().max()
        assert moved > 1e-3, "the update did not move the actor: the sync would be checked against the checkpoint"
        # Streamed into a bf16 copy: bitwise the fp32 weights gathered, then cast.
        for dtype, state in got["rollout"].items():
            for name, tensor in got["actor"].items():
                torch.testing.assert_close(state[name], tensor.to(dtype), rtol=0, atol=0, msg=f"rank {rank} {dtype} {name}")
        if engine == "fsdp" and got["pool_size"] > 1:  # cast before the gather: the pool moves the rollout's dtype
            for dtype, gathered in got["gathered_dtypes"].items():
                assert gathered and set(gathered) == {dtype}, (rank, dtype, gathered)
        files = [f for f in os.listdir(got["hf_dir"]) if f.endswith(".safetensors")]
        with safe_open(os.path.join(got["hf_dir"], files[0]), "pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {got["compute_dtype"]}
        back = load_causal_lm(got["hf_dir"], got["compute_dtype"], torch.device("cpu"), seed=0)
        for name, tensor in back.named_parameters():
            torch.testing.assert_close(tensor.to(got["compute_dtype"]), got["actor"][name].to(got["compute_dtype"]),
                                       rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("engine", ["fsdp", pytest.param("deepspeed", marks=needs_deepspeed)])
def test_sharded_load_and_streamed_sync_on_pools_of_one_and_two(tied_model_dir, engine, tmp_path):
    results = run_ranks(_load_update_sync, 3, tied_model_dir, engine, str(tmp_path), timeout=300, kind="plain" if engine == "fsdp" else engine)
    _check(results, tied_model_dir, engine)


def _reads_and_partitions(rank, world_size, model_dir, engine):
    """Which ranks of a two-rank pool ever read the checkpoint whole, and (ZeRO-3) whether each
    rank holds only its partition of every parameter afterwards."""
    from spmdsplit.models import ModelSource

    reads = []
    original = ModelSource.read

    def counting_read(self, device="cpu"):
        reads.append(self.kind)
        return original(self, device)

    ModelSource.read = counting_read
    source = ModelSource("causal_lm", model_dir, torch.float32)
    if engine == "fsdp":
        from spmdsplit.engines.fsdp import FSDPEngine

        FSDPEngine.from_source(source, DeviceMesh.from_group(dist.group.WORLD, "cpu"), torch.device("cpu"))
        return reads, None
    from spmdsplit.engines.deepspeed import DeepSpeedEngine

    model = DeepSpeedEngine.from_source(source, dist.group.WORLD, 3, torch.device("cpu")).model
    held = {name: (p.ds_tensor.numel(), p.ds_numel) for name, p in model.named_parameters()}
    return reads, held


@pytest.mark.parametrize("engine", ["fsdp", pytest.param("deepspeed", marks=needs_deepspeed)])
def test_only_the_pools_first_rank_reads_the_checkpoint(tied_model_dir, engine):
    results = run_ranks(_reads_and_partitions, 2, tied_model_dir, engine, kind="plain" if engine == "fsdp" else engine)
    assert [reads for reads, _ in results] == [["causal_lm"], []]
    if engine == "deepspeed":
        for rank, (_, held) in enumerate(results):
            for name, (mine, whole) in held.items():
                assert mine == (whole + 1) // 2, f"rank {rank} holds {mine} of {name}'s {whole} elements"
