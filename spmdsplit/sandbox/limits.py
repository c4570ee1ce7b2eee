"""A program's limits, as reward.sandbox sets them (spmdsplit/config.py SandboxConfig)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # one test's run; the first run of all tests gets half (prime_code's flow)
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    max_processes: int = 8  # processes and threads the program may start (RLIMIT_NPROC)
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_mb: int = 8  # what one test prints; what the program writes in its folder

    @classmethod
    def from_config(cls, sandbox) -> "Limits":
        """From reward.sandbox (a SandboxConfig or any object with its fields)."""
        return cls(timeout_s=float(sandbox.timeout_s), memory_mb=int(sandbox.memory_mb),
                   max_processes=int(sandbox.max_processes), max_open_files=int(sandbox.max_open_files),
                   max_output_mb=int(sandbox.max_output_mb))

    def for_runner(self, cpu_s: float) -> dict:
        """The request's "limits": these, and the CPU seconds of the run."""
        return {"memory_mb": self.memory_mb, "max_processes": self.max_processes,
                "max_open_files": self.max_open_files, "max_output_mb": self.max_output_mb, "cpu_s": cpu_s}
