"""A custom reward function from a Python file (`reward.custom_fn.path`, `reward.custom_fn.name`),
verl's `custom_reward_function`.

The function is called as verl calls it, by keyword:

    fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...)

and returns a number or a dict with the score under "score" (its other numeric keys are logged,
e.g. "acc"). It replaces the built-in scorers for every data_source. Every rank that computes
rewards loads the file itself: nothing is pickled between processes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from typing import Callable

from spmdsplit.errors import ConfigError


class CustomRewardError(ConfigError):
    """The custom reward function cannot be loaded; the message names the config key at fault.
    A ConfigError, so loading it in `preflight.check_job` stops every rank before the first collective."""


def load_custom_reward_fn(path: str, name: str = "compute_score", key: str = "reward.custom_fn") -> Callable:
    """The function `name` of the file at `path`; `key`: the config keys that name them, for errors."""
    path_key, name_key = f"{key}.path", f"{key}.name"
    path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isfile(path):
        raise CustomRewardError(f"{path_key}={path!r}: no such file")
    # A module name of its own per file, so two reward files (or a file named like a real
    # module, e.g. `math.py`) never replace each other or shadow anything in sys.modules.
    module_name = "spmdsplit_custom_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise CustomRewardError(f"{path_key}={path!r}: not a Python file that can be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses, pickling and the like look the module up there
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # SystemExit: a file that calls sys.exit() on import
        sys.modules.pop(module_name, None)
        raise CustomRewardError(f"{path_key}={path!r}: importing it failed: {type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise CustomRewardError(f"{name_key}={name!r}: {path} defines no {name!r} (callables there: {public})")
    fn = getattr(module, name)
    if not callable(fn):
        raise CustomRewardError(f"{name_key}={name!r}: {path} defines {name!r} but it is a {type(fn).__name__}, not a function")
    return fn
