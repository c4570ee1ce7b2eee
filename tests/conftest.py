import os

import pytest

# Every rank a test starts keeps NCCL's point-to-point rules (tests/nccl_p2p.py): ranks forked
# warm by tests/launch.py install it themselves, ranks started by torchrun (or by hand) load it
# from tests/nccl_site/sitecustomize.py, found on PYTHONPATH. Launchers that set PYTHONPATH must
# prepend to it, not replace it.
_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nccl_site")
os.environ["SPMDSPLIT_P2P_CONTRACT"] = "1"
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_SITE, os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="session", autouse=True)
def embedded_cache(tmp_path_factory):
    """One embedded-model cache per test session, so tests never touch the user's ~/.cache
    and the first test that needs the model builds it for the rest."""
    path = os.environ.get("SPMDSPLIT_TEST_CACHE") or str(tmp_path_factory.mktemp("spmdsplit-cache"))
    os.environ["SPMDSPLIT_CACHE"] = path
    return path


@pytest.fixture(scope="module", autouse=True)
def persistent_worlds():
    """The worlds tests/launch.py keeps between tests end with their module: the next module
    starts from new processes (a second or two), and no idle world waits through the rest of
    the session holding memory."""
    yield
    from tests import launch

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
