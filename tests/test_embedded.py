"""The embedded tiny model (spmdsplit/embedded.py): built once, found again, loadable through the
Hugging Face auto classes, safe to build from several processes at once, deterministic; and the
default task gives a random policy a reward signal."""

import json
import os

import pytest
import torch

from spmdsplit.batch import Batch
from spmdsplit.config import DataConfig
from spmdsplit.data.synthetic import TASKS, make_dataset
from spmdsplit.embedded import ensure_embedded_model
from spmdsplit.models import load_tokenizer
from spmdsplit.inference.hf import response_mask_until_eos
from spmdsplit.roles.reward import RuleReward
from tests.support import launch

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def mtimes(path):
    return {f: os.stat(os.path.join(path, f)).st_mtime_ns for f in os.listdir(path)}


def test_builds_once_then_finds_it(tmp_path, monkeypatch):
    import spmdsplit.embedded as embedded

    cache = str(tmp_path / "cache")
    path = ensure_embedded_model(cache)
    assert os.path.dirname(path) == cache
    for f in FILES:
        assert os.path.isfile(os.path.join(path, f)), f
    before = mtimes(path)

    def no_rebuild(*a, **k):
        raise AssertionError("the embedded model was built again")

    monkeypatch.setattr(embedded, "build_model", no_rebuild)
    monkeypatch.setattr(embedded, "save_hf_folder", no_rebuild)
    assert ensure_embedded_model(cache) == path
    assert mtimes(path) == before
    assert sorted(os.listdir(cache)) == [os.path.basename(path)]


def test_default_cache_dir_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SPMDSPLIT_CACHE", str(tmp_path))
    path = ensure_embedded_model()
    assert os.path.dirname(path) == str(tmp_path)


def test_folder_loads_through_the_auto_classes():
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    path = ensure_embedded_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    lm = AutoModelForCausalLM.from_pretrained(path)
    value = AutoModelForTokenClassification.from_pretrained(path, num_labels=1)
    assert lm.config.vocab_size == len(tokenizer)
    assert lm.get_output_embeddings().weight.shape[0] == len(tokenizer)
    assert value.config.num_labels == 1
    # Same backbone weights in both heads.
    assert torch.equal(lm.model.embed_tokens.weight, value.model.embed_tokens.weight)
    with torch.no_grad():
        ids = tokenizer("123=", add_special_tokens=False, return_tensors="pt")["input_ids"]
        assert lm(ids).logits.shape == (1, 4, len(tokenizer))
        assert value(ids).logits.shape == (1, 4, 1)
    # The special ids in the config are the tokenizer's.
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        assert getattr(lm.config, name) == getattr(tokenizer, name), name
    assert len({tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id}) == 3


def test_tokenizer_is_one_token_per_character_and_round_trips():
    tokenizer = load_tokenizer(ensure_embedded_model())
    for text in ("0123456789=", "98=", "5"):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text)
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == text
    assert tokenizer.padding_side == "left"


def _concurrent_build(cache_dir, barrier, queue):
    import time

    import tokenizers  # noqa: F401  - imports done before the race, so the builds overlap
    import transformers  # noqa: F401
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM  # noqa: F401

    import spmdsplit.embedded as embedded

    real_save, built = embedded.save_hf_folder, []

    def slow_save(*args, **kwargs):
        real_save(*args, **kwargs)
        built.append(True)
        time.sleep(1.0)  # hold the finished staging folder, so the others finish theirs too

    embedded.save_hf_folder = slow_save
    barrier.wait(timeout=60)
    try:
        path = embedded.ensure_embedded_model(cache_dir)
        queue.put(("ok", path, bool(built), sorted(os.listdir(path))))
    except BaseException as e:  # noqa: BLE001
        queue.put(("error", repr(e), False, []))
    queue.close()
    queue.join_thread()
    os._exit(0)  # skip tearing down torch/transformers: seconds on a loaded machine


def test_concurrent_builds_into_one_fresh_dir(tmp_path):
    cache = str(tmp_path / "shared")
    ctx = launch.context()
    barrier, queue = ctx.Barrier(3), ctx.Queue()
    procs = launch.start_processes(_concurrent_build, [(cache, barrier, queue)] * 3)
    try:
        results = [queue.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(r[0] == "ok" for r in results), results
    paths = {r[1] for r in results}
    assert len(paths) == 1, paths
    path = paths.pop()
    assert sum(r[2] for r in results) >= 2, "the builds did not race; the test proves nothing"
    for f in FILES:
        assert os.path.isfile(os.path.join(path, f)), f
    assert all(set(FILES) <= set(r[3]) for r in results)  # each saw a complete folder when it returned
    assert os.listdir(cache) == [os.path.basename(path)]  # no `.building-*` leftovers
    # And the raced folder is the same model a lone build makes.
    assert_same_build(path, ensure_embedded_model(str(tmp_path / "alone")))


def assert_same_build(a, b):
    from safetensors.torch import load_file

    wa, wb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    for f in ("config.json", "tokenizer.json"):
        with open(os.path.join(a, f)) as fa, open(os.path.join(b, f)) as fb:
            assert json.load(fa) == json.load(fb), f


def test_builds_are_deterministic(tmp_path):
    a = ensure_embedded_model(str(tmp_path / "a"))
    torch.manual_seed(987)  # whatever the caller's RNG state, the build is the same
    torch.randn(1000)
    b = ensure_embedded_model(str(tmp_path / "b"))
    assert a != b
    assert os.path.basename(a) == os.path.basename(b)
    assert_same_build(a, b)
    # Not a degenerate model: weights actually random.
    from safetensors.torch import load_file

    head = load_file(os.path.join(a, "model.safetensors"))["lm_head.weight"]
    assert head.std() > 0


# --------------------------------------------------------------------------- the task's signal


def score_responses(tokenizer, responses, rows):
    """Scores raw [B, R] responses the way the job does: cut at the first EOS, pad after it, and
    let the reward role decode and score them."""
    mask = response_mask_until_eos(responses, tokenizer.eos_token_id)
    responses = responses.masked_fill(mask == 0, tokenizer.pad_token_id)
    batch = Batch(
        {"responses": responses, "response_mask": mask},
        {"data_source": [r["data_source"] for r in rows],
         "ground_truth": [r["reward_model"]["ground_truth"] for r in rows]},
    )
    return RuleReward(tokenizer).compute(batch)[1]


def test_a_random_policy_scores_above_zero_on_the_default_task():
    cfg = DataConfig()
    assert cfg.task == "repeat"
    tokenizer = load_tokenizer(ensure_embedded_model())
    n, R = 2000, cfg.max_response_length
    rows = make_dataset(cfg.task, n, seed=0)
    g = torch.Generator().manual_seed(0)
    responses = torch.randint(0, len(tokenizer), (n, R), generator=g)
    scores = score_responses(tokenizer, responses, rows)
    assert scores.shape == (n,)
    assert ((scores >= 0) & (scores <= 1)).all()
    # A uniform token hits a given digit 1 time in 15: a few percent of the best score on average.
    assert scores.mean().item() > 0.005
    assert (scores > 0).float().mean().item() > 0.05


@pytest.mark.parametrize("task", sorted(TASKS))
def test_the_ground_truth_scores_exactly_one(task):
    tokenizer = load_tokenizer(ensure_embedded_model())
    R = DataConfig().max_response_length
    rows = make_dataset(task, 300, seed=1)
    eos = tokenizer.eos_token_id
    responses = []
    for r in rows:
        assert len(r["reward_model"]["ground_truth"]) <= R, "the answer does not fit data.max_response_length"
        ids = tokenizer(r["reward_model"]["ground_truth"], add_special_tokens=False)["input_ids"] + [eos]
        ids = ids[:R]  # a full-length answer leaves no room for the EOS: truncated, still right
        responses.append(ids + [tokenizer.pad_token_id] * (R - len(ids)))
    scores = score_responses(tokenizer, torch.tensor(responses), rows)
    assert scores.tolist() == [1.0] * len(rows)
