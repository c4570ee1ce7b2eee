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
    and the first test that needs the model builds it for the rest."""
    path = os.environ.get("SPMDSPLIT_TEST_CACHE") or str(tmp_path_factory.mktemp("spmdsplit-cache"))
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


# Each tier's time, printed at the end of every run (CI's output shows both; issue 26): the sum of
# each test's setup, call and teardown, by whether it is marked e2e.
_E2E: set[str] = set()
_TIER_S = {"quick": 0.0, "e2e": 0.0}


def pytest_collection_modifyitems(items):
    _E2E.update(item.nodeid for item in items if item.get_closest_marker("e2e"))


def pytest_runtest_logreport(report):
    _TIER_S["e2e" if report.nodeid in _E2E else "quick"] += report.duration


def pytest_terminal_summary(terminalreporter):
    quick, e2e = _TIER_S["quick"], _TIER_S["e2e"]
    terminalreporter.write_line(f"tier times: quick (-m 'not e2e') {quick:.0f}s, e2e {e2e:.0f}s, "
                                f"both {quick + e2e:.0f}s")
