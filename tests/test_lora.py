"""LoRA (spmdsplit/lora.py): PEFT adapters on FSDP2, the reference as the adapter-free base, what a
sync moves, the adapter's files and checkpoints, and the start-up checks. The jobs that show the
engines sampling from the adapter they were given, resume and export are tests/test_lora_e2e.py."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from spmdsplit import lora
from spmdsplit.config import load_config
from spmdsplit.errors import ConfigError
from spmdsplit.preflight import check_config, check_lora_models
from tests.support.launch import run_ranks
from tests.support.helpers import ROWS, make_batch

SPEC = lora.LoraSpec(rank=8, alpha=16.0)


def peft_model(model_dir, spec=SPEC, seed=0):
    """The embedded model with an adapter whose B is not zero (a fresh one computes as the base)."""
    from spmdsplit.models import ModelSource

    model = ModelSource("causal_lm", model_dir, torch.float32, lora=spec).read().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


IDS = torch.randint(4, 14, (3, 9), generator=torch.Generator().manual_seed(1))


def test_the_names_an_engine_takes_are_peft_saved_ones(embedded_model_dir):
    from peft import get_peft_model_state_dict

    from spmdsplit.models import load_causal_lm

    model = peft_model(embedded_model_dir)
    names = [n for n, _ in model.named_parameters()]
    adapter = [n for n in names if lora.is_adapter(n)]
    assert adapter and all(not p.requires_grad for n, p in model.named_parameters() if n not in adapter)
    assert sorted(lora.saved_name(n) for n in adapter) == sorted(get_peft_model_state_dict(model))
    assert all(lora.model_name(lora.saved_name(n)) == n for n in adapter)
    plain = load_causal_lm(embedded_model_dir, torch.float32, "cpu", 0)  # the model's own names: no prefix, no base_layer
    assert {lora.base_name(n) for n in names if not lora.is_adapter(n)} == {n for n, _ in plain.named_parameters()}
    # all-linear: every linear layer of every block, not the output head
    assert {n.split(".")[-4] for n in adapter} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_merged_stream_is_the_model_peft_merges(embedded_model_dir, dtype):
    from spmdsplit.models import hf_tensors, load_causal_lm

    model = peft_model(embedded_model_dir)
    merged = dict(lora.merged(hf_tensors(model), lora.scalings(model), dtype))
    plain = load_causal_lm(embedded_model_dir, torch.float32, torch.device("cpu"), seed=0)
    expected = peft_model(embedded_model_dir).merge_and_unload()
    assert merged.keys() == dict(plain.named_parameters()).keys()
    for name, tensor in expected.named_parameters():
        assert merged[name].dtype == dtype
        torch.testing.assert_close(merged[name], tensor.to(dtype), rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-2)
    plain.load_state_dict({k: v.float() for k, v in merged.items()}, strict=False)
    if dtype == torch.float32:
        torch.testing.assert_close(logits(plain.eval(), IDS), logits(model, IDS), rtol=0, atol=1e-5)


def test_an_adapter_folder_loads_with_peft(embedded_model_dir, tmp_path):
    from peft import PeftModel

    from spmdsplit.models import hf_tensors, load_causal_lm

    model = peft_model(embedded_model_dir)
    adapter = ((lora.saved_name(n), t) for n, t in hf_tensors(model) if lora.is_adapter(n))
    written = lora.write_adapter(str(tmp_path), adapter, model.peft_config[lora.ADAPTER], embedded_model_dir)
    assert written == sum(p.nbytes for n, p in model.named_parameters() if lora.is_adapter(n))
    loaded = PeftModel.from_pretrained(load_causal_lm(embedded_model_dir, torch.float32, "cpu", 0), str(tmp_path)).eval()
    assert torch.equal(logits(loaded, IDS), logits(model, IDS))
    with model.disable_adapter():
        assert not torch.allclose(logits(loaded, IDS), logits(model, IDS))


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 96 KiB tmpfs (a container's /dev/shm, scaled to the test's adapter); root only."""
    import subprocess

    folder = tmp_path / "shm"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(folder)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    yield str(folder)
    subprocess.run(["umount", str(folder)], check=True)


def test_an_adapter_that_does_not_fit_its_folder_goes_to_the_nodes_temp_folder(embedded_model_dir, small_tmpfs,
                                                                                tmp_path, monkeypatch, capsys):
    """rollout.lora_adapter_dir's folder too small for the adapter (the embedded model's: 64 KiB of
    tensors and AdapterFolder's headroom, against 96 KiB): written to TMPDIR instead, said once, and the engine's path names it; the
    folder it left is gone. Where it fits, it stays."""
    from spmdsplit.models import hf_tensors
    from spmdsplit.inference.vllm_engine import AdapterFolder

    model = peft_model(embedded_model_dir)
    adapter = lambda: ((lora.saved_name(n), t) for n, t in hf_tensors(model) if lora.is_adapter(n))  # noqa: E731
    capsys.readouterr()  # transformers' loading bar
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # TMPDIR, as tempfile.gettempdir() reads it
    folder = AdapterFolder(SPEC, embedded_model_dir, small_tmpfs)
    assert os.path.dirname(folder.root) == small_tmpfs
    path = folder.write(adapter())
    assert folder.bytes + AdapterFolder.HEADROOM > 96 * 1024 and path == folder.path and os.path.dirname(folder.root) == str(temp)
    assert os.path.isfile(os.path.join(path, "adapter_model.safetensors")) and os.listdir(small_tmpfs) == []
    folder.write(adapter())  # the next version: no second warning
    warned = capsys.readouterr().err.splitlines()
    assert len(warned) == 1 and warned[0].startswith("spmdsplit: warning: the LoRA adapter (")
    assert f"does not fit in {small_tmpfs}" in warned[0] and str(temp) in warned[0], warned
    roomy = AdapterFolder(SPEC, embedded_model_dir, str(tmp_path))  # a folder with room keeps it
    roomy.write(adapter())
    assert os.path.dirname(roomy.root) == str(tmp_path) and capsys.readouterr().err == ""


def _lora_in_a_pool(rank, world_size, model_dir, mixed):
    """The policy with an adapter on FSDP2 over two ranks, as roles/build.py builds it."""
    from spmdsplit.config import ActorConfig, OptimConfig, RolloutConfig
    from spmdsplit.engines.fsdp import FSDPEngine
    from spmdsplit.models import ModelSource, load_causal_lm, load_tokenizer
    from spmdsplit.roles.actor import Actor
    from spmdsplit.inference.hf import HFEngine
    from spmdsplit.weight_sync import PolicyWeights

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    base_dtype = mixed or torch.float32
    optim = OptimConfig(lr=5e-2, lr_warmup_steps=0)
    engine = FSDPEngine.from_source(ModelSource("causal_lm", model_dir, base_dtype, seed=3, lora=SPEC), mesh,
                                    torch.device("cpu"), optim, mixed, activation_checkpointing=True)
    params = dict(engine.model.named_parameters())
    out = {"trained": sorted(n for n, p in params.items() if p.requires_grad),
           "optimized": sum(len(g["params"]) for g in engine.optimizer.param_groups),
           "dtypes": {(lora.is_adapter(n), p.dtype) for n, p in params.items()}}
    cfg = ActorConfig(optim=optim, ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=2, shuffle=False)
    actor = Actor(engine, cfg, temperature=1.0, device=torch.device("cpu"))
    ref = Actor(engine, cfg, temperature=1.0, device=torch.device("cpu"), base_only=True)
    tokenizer = load_tokenizer(model_dir)
    batch = make_batch(len(tokenizer)).slice(rank * ROWS // 2, (rank + 1) * ROWS // 2)
    before = ref.compute_log_prob(batch)
    for step in range(3):  # a large learning rate: the adapter moves far from the base
        actor.update_policy(batch, seed=step)
    out["ref_unchanged"] = torch.equal(ref.compute_log_prob(batch), before)
    out["policy_moved"] = (actor.compute_log_prob(batch) - before).abs().max().item()
    # The adapter alone, streamed into an HF engine that holds the base: it computes as the policy.
    copy = HFEngine(load_causal_lm(model_dir, base_dtype, "cpu", seed=0), tokenizer, RolloutConfig(), 4, adapter=SPEC)
    weights = PolicyWeights(engine, copy.dtype, None, None, adapter=SPEC)
    streamed = []
    copy.load_weights((streamed.append(name) or (name, t)) for name, t in weights.stream())
    out["streamed"] = sorted(streamed)
    policy = logits(engine.model, batch["input_ids"]).float()
    out["engine_vs_policy"] = ((logits(copy.model, batch["input_ids"]).float() - policy).abs().max() / policy.abs().max()).item()
    # The checkpoint: the adapter and its optimizer state, nothing of the frozen base.
    state = engine._training_state()
    out["checkpointed"] = sorted(state["model"])
    out["optim_entries"] = len(state["optim"]["state"])
    return out


@pytest.mark.parametrize("mixed", [None, torch.bfloat16], ids=["fp32", "bf16-base"])
def test_an_adapter_trains_on_fsdp2_its_reference_is_the_base_and_an_engine_takes_it_alone(embedded_model_dir, mixed):
    results = run_ranks(_lora_in_a_pool, 2, embedded_model_dir, mixed, timeout=180)
    adapter = [n for n in results[0]["trained"] if lora.is_adapter(n)]
    for got in results:
        assert got["trained"] == adapter and len(adapter) == 28  # 2 blocks x 7 linear layers x (A, B)
        assert got["optimized"] == len(adapter)
        base_dtype = mixed or torch.float32
        assert got["dtypes"] == {(True, torch.float32), (False, base_dtype)}  # adapter fp32, base frozen in the compute dtype
        assert got["ref_unchanged"]  # the adapter off: the base's log-probs, whatever the adapter learned
        assert got["policy_moved"] > 0.05
        assert got["streamed"] == sorted(lora.saved_name(n) for n in adapter)
        # of the largest logit: the engine's adapter in the engine's dtype computes what the trainer's
        # mixed precision computes (an fp32 adapter in a bf16 engine was 17 % off after these updates)
        assert got["engine_vs_policy"] < 1e-6
        assert got["checkpointed"] == adapter and got["optim_entries"] == len(adapter)


def _value_model_on_bf16_base(rank, world_size, model_dir):
    """The critic's value model with an adapter, as roles/build.py builds it at a bf16 compute dtype:
    read and skeleton, then one update on FSDP2 (bf16 compute) at the 7B preset's critic lr."""
    from spmdsplit.config import OptimConfig
    from spmdsplit.engines.fsdp import FSDPEngine
    from spmdsplit.models import ModelSource

    source = ModelSource("value", model_dir, torch.bfloat16, seed=3, lora=SPEC)
    trained = lambda m: {n: p.dtype for n, p in m.named_parameters() if p.requires_grad}  # noqa: E731
    out = {"read": trained(source.read()), "skeleton": trained(source.skeleton())}
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    engine = FSDPEngine.from_source(source, mesh, torch.device("cpu"), OptimConfig(lr=1e-5, lr_warmup_steps=0),
                                    torch.bfloat16)
    head = lambda: next(p for n, p in engine.model.named_parameters() if n.endswith("score.modules_to_save.default.weight"))  # noqa: E731
    before = head().full_tensor().clone()
    values = engine(input_ids=IDS, use_cache=False).logits
    out["values_dtype"] = values.dtype
    engine.backward(values.float().square().mean())
    engine.step()
    out["head_moved"] = (head().full_tensor() - before).abs().max().item()
    out["head_dtype"] = head().dtype
    return out


def test_every_trainable_tensor_of_a_lora_value_model_is_fp32_at_a_bf16_base(embedded_model_dir):
    """PEFT upcasts the adapter's layers only; the value model's score head, trained whole beside
    them (modules_to_save), must get fp32 masters too: a bf16 update at lr 1e-5 of weights near
    0.02 rounds to nothing."""
    [got] = run_ranks(_value_model_on_bf16_base, 1, embedded_model_dir, timeout=120)
    assert got["read"] == got["skeleton"]
    assert "base_model.model.score.modules_to_save.default.weight" in got["read"]
    assert set(got["read"].values()) == {torch.float32}, got["read"]
    assert got["head_dtype"] == torch.float32 and got["values_dtype"] == torch.bfloat16  # computed in bf16
    assert got["head_moved"] > 0  # one Adam step of ~lr on every weight: kept in fp32


def _bytes_per_sync(rank, world_size, model_dir):
    from spmdsplit.engines.fsdp import FSDPEngine
    from spmdsplit.models import ModelSource
    from spmdsplit.weight_sync import PolicyWeights

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    counts = {}
    for name, spec in (("full", None), ("adapter", SPEC)):
        model = ModelSource("causal_lm", model_dir, torch.float32, lora=spec).skeleton()
        model.to_empty(device="cpu")  # what the values are does not matter here, only what moves
        engine = FSDPEngine(model, mesh)
        weights = PolicyWeights(engine, torch.bfloat16, None, None, adapter=spec)
        counts[name] = sum(t.nbytes for _, t in weights.stream())
        counts[name + "_shards"] = sum(s.part.nbytes for s in (engine.iter_weight_shards(torch.bfloat16, lora.is_adapter)
                                                                 if spec else engine.iter_weight_shards(torch.bfloat16)))
        del engine, model
    return counts


def test_a_sync_at_rank_8_on_the_76m_shape_moves_under_3_percent_of_a_full_one(tmp_path):
    from tools.plan.memory import BENCH_76M
    from tools.plan.memory_plan import write_config

    folder = write_config(BENCH_76M, str(tmp_path))
    [counts] = run_ranks(_bytes_per_sync, 1, folder, timeout=180)
    ratio = counts["adapter"] / counts["full"]
    assert counts["full"] > 2 * 75e6  # bf16 of 76M parameters
    assert ratio <= 0.03, (counts, ratio)
    assert counts["adapter_shards"] == counts["adapter"] and counts["full_shards"] == counts["full"]


# --------------------------------------------------------------------------- start-up checks

@pytest.mark.parametrize("overrides, message", [
    (["model.lora_rank=8", "actor.engine=deepspeed"],
     "model.lora_rank=8 with actor.engine=deepspeed: LoRA adapters train on FSDP2 only here"),
    (["critic.model.lora_rank=8", "critic.engine=deepspeed"],
     "critic.model.lora_rank=8 with critic.engine=deepspeed"),
    (["model.lora_adapter_path=/some/adapter"], "model.lora_adapter_path='/some/adapter' with model.lora_rank=0"),
    (["model.lora_merge=true"], "model.lora_merge=true with model.lora_rank=0"),
    (["rollout.max_lora_rank=24"], "rollout.max_lora_rank=24: vLLM starts an engine for one of the ranks"),
    (["model.lora_rank=32", "rollout.name=vllm", "rollout.max_lora_rank=16"],
     "model.lora_rank=32 is above rollout.max_lora_rank=16"),
    (["model.lora_rank=1024", "rollout.name=vllm"], "model.lora_rank=1024 is above rollout.max_lora_rank=512"),
    (["model.lora_rank=-1"], "model.lora_rank=-1: expected >= 0"),
    (["model.target_modules=3"], "model.target_modules=3: expected a module name"),
])
def test_bad_lora_keys_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        check_config(load_config(None, overrides))
    assert str(e.value).startswith(message), str(e.value)


def test_good_lora_keys_pass():
    for overrides in (["model.lora_rank=8", "rollout.name=vllm"], ["model.lora_rank=8", "model.lora_merge=true",
                      "rollout.name=vllm"], ["model.lora_rank=16", "rollout.name=vllm", "rollout.max_lora_rank=16"],
                      ["critic.model.lora_rank=8", "critic.engine=deepspeed", "algorithm.adv_estimator=grpo",
                       "rollout.n=2"],  # no critic built: its keys are not checked
                      ["model.lora_rank=8", "ref.engine=deepspeed"]):  # no reference model built
        check_config(load_config(None, overrides))


def test_adapters_are_checked_against_their_models(embedded_model_dir, tmp_path):
    def checked(*overrides):
        cfg = load_config(None, [f"model.path={embedded_model_dir}", *overrides])
        check_lora_models(cfg)

    checked("model.lora_rank=8", "model.target_modules=[q_proj,v_proj]", "critic.model.lora_rank=4")
    with pytest.raises(ConfigError, match=r"^model.target_modules=\['w_proj'\] \(exclude_modules=None\) names no "
                                          r"layer of .*Target modules \{'w_proj'\} not found in the base model"):
        checked("model.lora_rank=8", "model.target_modules=[w_proj]")
    with pytest.raises(ConfigError, match=r"^critic.model.target_modules='no_such_layer' \(exclude_modules=None\) names "
                                          r"no layer of .*: No modules were targeted"):
        checked("critic.model.lora_rank=8", "critic.model.target_modules=no_such_layer")
    with_head = ["model.lora_rank=8", "model.target_modules=[q_proj,lm_head]", "rollout.name=vllm"]
    with pytest.raises(ConfigError, match=r"^model.target_modules puts an adapter on the model's output head, which vLLM"):
        checked(*with_head)
    checked(*with_head, "model.lora_merge=true")
    checked(*with_head[:2], "rollout.name=hf")
    model = peft_model(embedded_model_dir)
    model.save_pretrained(str(tmp_path))
    checked("model.lora_rank=8", f"model.lora_adapter_path={tmp_path}")
    with pytest.raises(ConfigError, match=r"holds a LORA adapter of rank 8, and model.lora_rank=16; set model.lora_rank=8"):
        checked("model.lora_rank=16", f"model.lora_adapter_path={tmp_path}")
    with pytest.raises(ConfigError, match="no adapter_config.json there"):
        checked("model.lora_rank=8", f"model.lora_adapter_path={embedded_model_dir}")


def test_a_saved_adapter_is_where_training_starts(embedded_model_dir, tmp_path):
    from spmdsplit.models import ModelSource

    saved = peft_model(embedded_model_dir, seed=5)
    saved.save_pretrained(str(tmp_path))
    spec = lora.LoraSpec(8, 16.0, adapter_path=str(tmp_path))
    start = ModelSource("causal_lm", embedded_model_dir, torch.float32, lora=spec).read().eval()
    assert torch.equal(logits(start, IDS), logits(saved, IDS))
    assert all(p.requires_grad == lora.is_adapter(n) for n, p in start.named_parameters())
    skeleton = ModelSource("causal_lm", embedded_model_dir, torch.float32, lora=spec).skeleton()
    assert [n for n, _ in skeleton.named_parameters()] == [n for n, _ in start.named_parameters()]
