"""Loads NCCL's point-to-point contract (tests/support/nccl_p2p.py) into every rank the tests start with
torchrun (or by hand): tests/conftest.py puts this folder on PYTHONPATH and sets
SPMDSPLIT_P2P_CONTRACT=1 for the whole session. Other processes (torchrun's agent, pytest's own
helpers) carry no LOCAL_RANK and are left alone."""

import os

if os.environ.get("SPMDSPLIT_P2P_CONTRACT") == "1" and "LOCAL_RANK" in os.environ:
    import importlib.util
    import sys

    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nccl_p2p.py")
    _spec = importlib.util.spec_from_file_location("nccl_p2p", _path)
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["nccl_p2p"] = _module
    _spec.loader.exec_module(_module)
    _module.install()
