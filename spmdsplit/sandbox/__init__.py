"""Programs under test (verl's code data sources), each run in a process of its own under limits,
isolated as the kernel allows (spmdsplit/sandbox/isolation.py).

The rank's API: `Sandbox` (pool.py), `Limits` (limits.py), `SandboxError` (isolation.py). The
runner's modules (runner, namespaces, rlimits, guard, harness, stdio, protocol, values) use the
standard library only and are imported by the runner process, which imports this package first:
so nothing is imported here until asked for.
"""

from __future__ import annotations

_EXPORTS = {"Sandbox": "pool", "RunResult": "pool", "Outcome": "pool", "Limits": "limits",
            "SandboxError": "isolation"}


def __getattr__(name: str):
    if name in _EXPORTS:
        from importlib import import_module

        return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
