import os

import pytest

# Every rank a test starts keeps NCCL's point-to-point rules (tests/support/nccl_p2p.py): ranks forked
# warm by tests/support/launch.py install it themselves, ranks started by torchrun (or by hand) load it
# from tests/support/nccl_site/sitecustomize.py, found on PYTHONPATH. Launchers that set PYTHONPATH must
# prepend to it, not replace it.
_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support", "nccl_site")
os.environ["SPMDSPLIT_P2P_CONTRACT"] = "1"
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_SITE, os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="session", autouse=True)
def embedded_cache(tmp_path_factory):
    """One embedded-model cache per test session, so tests never touch the user's ~/.cache
    and the first test that needs the model builds it for the rest. With pytest-xdist's workers
    (pyproject.toml's addopts) the session's one is shared: their temporary folders have one
    parent, and a model is built into a staging folder and renamed, so two builders never clash."""
    shared = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        shared = shared.parent
    path = os.environ.get("SPMDSPLIT_TEST_CACHE") or str(shared / "spmdsplit-cache")
    os.makedirs(path, exist_ok=True)
    os.environ["SPMDSPLIT_CACHE"] = path
    return path


# The models and data several test files read, each built once a session (the embedded ones into
# the session's cache above, the others into a folder of their own).

@pytest.fixture(scope="session")
def embedded_model_dir(embedded_cache):
    """The embedded model (spmdsplit/embedded.py), as a job with no model.path builds it."""
    from spmdsplit.embedded import ensure_embedded_model

    return ensure_embedded_model()


@pytest.fixture(scope="session")
def head32_model_dir(tmp_path_factory):
    """A random tiny Qwen2 with heads of size 32, which vLLM's CPU attention kernel takes
    (tests/support/engines.py build_model, seed 0)."""
    from spmdsplit.models import save_hf_folder
    from tests.support.engines import build_model

    model, tokenizer = build_model(seed=0)
    path = str(tmp_path_factory.mktemp("tiny-qwen2-head32"))
    save_hf_folder(model, model.state_dict(), path, tokenizer)
    return path


@pytest.fixture(scope="session")
def agent_model_dir(embedded_cache, tmp_path_factory):
    """The embedded agent model with the "@" row of its LM head scaled 4x: greedy turns then end in
    a call in some contexts and not in others, so episodes have holes and answers after them."""
    import torch

    from spmdsplit.embedded import ensure_embedded_model
    from spmdsplit.models import hf_tensors, load_causal_lm, load_tokenizer, save_hf_folder

    source = ensure_embedded_model(agent=True)
    tokenizer = load_tokenizer(source)
    model = load_causal_lm(source, torch.float32, torch.device("cpu"), 0)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.convert_tokens_to_ids("@")] *= 4
    path = str(tmp_path_factory.mktemp("agent_model"))
    save_hf_folder(model, hf_tensors(model), path, tokenizer)
    return path


@pytest.fixture(scope="session")
def lookup_setup(embedded_cache):
    """configs/agent_lookup.yaml loaded on the embedded agent model: (cfg, tokenizer, EOS ids, the
    training rows with the tools' schemas). Read-only: the agent tests share it."""
    from spmdsplit.agent import check_multi_turn
    from spmdsplit.config import load_config
    from spmdsplit.data.sources import build_rows
    from spmdsplit.embedded import ensure_embedded_model
    from spmdsplit.models import eos_token_ids, load_tokenizer

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, "configs", "agent_lookup.yaml"), [])
    cfg.model.path = ensure_embedded_model(agent=True)
    tokenizer = load_tokenizer(cfg.model.path)
    tools = check_multi_turn(cfg, tokenizer)
    rows, _ = build_rows(cfg.data, tokenizer, "train", tools=tools.schemas)
    return cfg, tokenizer, eos_token_ids(cfg.model.path, tokenizer), rows


@pytest.fixture(scope="module", autouse=True)
def persistent_worlds():
    """The worlds tests/support/launch.py keeps between tests end with their module: the next module
    starts from new processes (a second or two), and no idle world waits through the rest of
    the session holding memory."""
    yield
    from tests.support import launch

    launch.close_worlds()


# The suite runs on two workers (pytest-xdist, pyproject.toml's addopts: -n 2 --dist loadfile, each
# test file on one worker, so a file's module fixtures and cached jobs run once). A worker takes the
# next file when it is done with its own: the files that take longest go first, so that the two
# workers end together instead of one running the last long file alone. Seconds a file took alone
# (docs/development.md's table); the other files follow in their usual order.
LONGEST_FIRST = ("test_e2e.py", "test_vllm_e2e.py", "test_slurm.py", "test_lora_e2e.py", "test_continuous.py",
                 "test_deepspeed.py", "test_bench.py", "test_failure.py", "test_agent_e2e.py", "test_judge.py",
                 "test_resume.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: each file's order kept


# Each tier's time, printed at the end of every run (CI's output shows both; issue 26): the sum of
# each test's setup, call and teardown, by whether it is marked e2e. With two workers the sums are
# of both workers' time, so together they exceed the run's wall time.
_TIER_S = {"quick": 0.0, "e2e": 0.0}


def pytest_runtest_logreport(report):
    _TIER_S["e2e" if "e2e" in report.keywords else "quick"] += report.duration


def pytest_terminal_summary(terminalreporter):
    quick, e2e = _TIER_S["quick"], _TIER_S["e2e"]
    terminalreporter.write_line(f"tier times: quick (-m 'not e2e') {quick:.0f}s, e2e {e2e:.0f}s, "
                                f"both {quick + e2e:.0f}s")
