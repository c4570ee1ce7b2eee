import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def embedded_cache(tmp_path_factory):
    """One embedded-model cache per test session, so tests never touch the user's ~/.cache
    and the first test that needs the model builds it for the rest."""
    path = os.environ.get("SPMDSPLIT_TEST_CACHE") or str(tmp_path_factory.mktemp("spmdsplit-cache"))
    os.environ["SPMDSPLIT_CACHE"] = path
    return path
