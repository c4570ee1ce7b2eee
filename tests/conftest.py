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


@pytest.fixture(scope="session", autouse=True)
def persistent_worlds():
    """The worlds tests/launch.py keeps between tests end with the session."""
    yield
    from tests import launch

    launch.close_worlds()
