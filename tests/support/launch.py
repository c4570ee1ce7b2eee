"""Every process a test starts, started here: the one launcher of the suite.

Most of a test job's time used to be start-up: each rank a fresh interpreter importing torch and
transformers (5-6 s of a 2-core machine's time per rank) against steps of 0.1-0.6 s. So ranks
fork, warm, from a server started once per test session that has imported torch, transformers,
omegaconf and the project (multiprocessing's forkserver with a preload; DeepSpeed and vLLM stay out
of it: their tests fork from servers of their own that have imported them too). A forked rank
starts in a fraction of a second.

- `run_ranks(fn, n, *args)`: `fn(rank, n, *args)` on n ranks of a gloo world; returns each
  rank's result. Worlds persist through a module: the next call with the same shape reuses the
  world (no fork, no rendezvous). `fresh=True` asks for a world of its own, thrown away after (a test that changes
  process-global state, or must hang or fail); a world where a rank failed or hung is never reused.
- `job(n, *overrides)`: a training job, warm: n forked ranks call `spmdsplit.train.main`, the
  entry point torchrun's workers run, with torchrun's environment (its store hosted here, as
  torchrun's agent hosts it); the rest are stopped when one fails, as torchrun does. Returns a
  `CompletedProcess` like `subprocess.run`'s, the ranks' output interleaved as torchrun's is.
  `cached_job` runs a job once per session for every test that reads the same job's outputs.
  `stop_on_request`: such a job, one of its ranks asked to stop (SIGUSR2) once a line is printed.
- `torchrun(n, *args)`, `start_torchrun`: real `torchrun`, for tests whose subject is the
  launcher or the operating system (teardown, signals, preemption); marked `e2e`.
- `ranks_apart(n, argv)`: forked ranks with torchrun's variables and no launcher (each must end on
  its own); `cli(argv)`: `python -m spmdsplit.train` forked; `python(args)`: one plain interpreter.

Every rank here keeps NCCL's point-to-point rules (tests/support/nccl_p2p.py): forked ranks install the
layer themselves; interpreters load it from tests/support/nccl_site (conftest puts it on PYTHONPATH).
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta

from spmdsplit.checkpoint_files import LATEST
from tools.jobs import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What the warm server imports once. The rest of what a job imports (models' code, loggers) is
# imported by the first ranks that need it, each time: cheap next to these.
PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint",
    "transformers", "transformers.models.qwen2.modeling_qwen2", "omegaconf", "numpy", "pyarrow.parquet",
    "spmdsplit.train", "spmdsplit.trainer", "spmdsplit.engines.fsdp", "tests.support.nccl_p2p",
]

# torchrun's rendezvous variables, dropped from what a test hands to a launcher.
RDV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
            "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


def base_env(**extra) -> dict[str, str]:
    """The test session's environment without any rendezvous, one thread per rank (2 cores)."""
    env = {k: v for k, v in os.environ.items() if k not in RDV_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


# ------------------------------------------------------------------ the warm servers

# A server per kind of process, started at its first use: "plain" preloads PRELOAD; "deepspeed"
# and "vllm" that library too (~5 s and ~8 s of imports a process, and their tests start many; the
# vLLM server also compiles what vLLM compiles on first use: tests/support/vllm_compiled.py);
# "cold" is no server at all, a spawned interpreter that has imported nothing (a test of what an
# import does).
EXTRA_PRELOAD = {"plain": [], "deepspeed": ["deepspeed", "spmdsplit.engines.deepspeed"],
                 "vllm": ["vllm", "spmdsplit.inference.vllm_engine", "tests.support.vllm_compiled"]}
_servers: dict = {}


def _start(process, kind: str) -> None:
    """Starts a multiprocessing Process of the forkserver context from the `kind` server. The
    standard library keeps one forkserver per process; a second one is its ForkServer class again,
    put in place for the start only (the forkserver Popen looks the connection up at each start)."""
    from multiprocessing import forkserver

    if kind not in _servers:
        server = forkserver.ForkServer()
        server.set_forkserver_preload(PRELOAD + EXTRA_PRELOAD[kind])
        _servers[kind] = server
    standard = forkserver.connect_to_new_process
    forkserver.connect_to_new_process = _servers[kind].connect_to_new_process
    try:
        process.start()
    finally:
        forkserver.connect_to_new_process = standard


def context(kind: str = "plain"):
    """The multiprocessing context of `kind`'s processes (for the queues and barriers handed to them)."""
    import multiprocessing as mp

    return mp.get_context("spawn" if kind == "cold" else "forkserver")


def _launch(process, kind: str) -> None:
    if kind == "cold":
        process.start()
    else:
        _start(process, kind)


def start_processes(target, arglists: list[tuple], kind: str = "plain") -> list:
    """`target(*args)` in a warm process for each `args`, started: multiprocessing Processes."""
    procs = [context(kind).Process(target=target, args=args) for args in arglists]
    for p in procs:
        _launch(p, kind)
    return procs

def _enter_rank(env: dict[str, str], threads: int = 1) -> None:
    """What a forked rank does first: the environment it was started with (the server's is the
    session's at its start), one thread, and NCCL's point-to-point rules if the session keeps them."""
    os.environ.clear()
    os.environ.update(env)
    for name in filter(None, env.get("SPMDSPLIT_TEST_HIDE", "").split(",")):
        sys.modules[name] = None  # find_spec answers None, an import fails: as if not installed
    import torch

    torch.set_num_threads(threads)
    if env.get("SPMDSPLIT_P2P_CONTRACT") == "1":
        from tests.support import nccl_p2p

        nccl_p2p.install()


# ------------------------------------------------------------------ worlds: a function on N ranks

def _world_rank(rank, world_size, port, local_world_size, env, tasks, results):
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
                  "LOCAL_RANK": str(rank % local_world_size), "LOCAL_WORLD_SIZE": str(local_world_size)}
    _enter_rank({**env, **rendezvous})
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    while True:
        task = tasks.get()
        if task is None:
            break
        seq, fn, args, task_env, last = pickle.loads(task)
        # The test's environment as it is now (a monkeypatched variable too), as a fresh process
        # would have it; put back after, with the default dtype and thread count.
        saved_env, dtype = dict(os.environ), torch.get_default_dtype()
        os.environ.clear()
        os.environ.update({**task_env, **rendezvous})
        try:
            result = fn(rank, world_size, *args)
            # A rank with a point-to-point operation still pending (or one that failed) is not
            # handed another test: what it left would meet that test's messages.
            reusable = _left_nothing_pending()
            # Plain pickle, not torch's shared-memory reduction: the tensors must outlive this process.
            results.put((seq, rank, "ok" if reusable else "ok, not reusable", pickle.dumps(result)))
        except BaseException:
            results.put((seq, rank, "error", traceback.format_exc()))
            results.close()
            results.join_thread()  # the report is out before the process goes
            os._exit(1)
        finally:
            os.environ.clear()
            os.environ.update(saved_env)
            torch.set_default_dtype(dtype)
            torch.set_num_threads(1)
        if last or not dist.is_initialized():  # a world of one test, or the test took it down
            break
    results.close()
    results.join_thread()
    if dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0)


def _left_nothing_pending() -> bool:
    from tests.support import nccl_p2p

    if not nccl_p2p.installed():
        return True
    for _ in range(20):  # a send whose receive was just posted finishes within moments
        if not nccl_p2p.unfinished():
            return True
        time.sleep(0.05)
    return False


class World:
    def __init__(self, world_size: int, local_world_size: int, kind: str = "plain"):
        ctx = context(kind)
        self.world_size, self.seq, self.reusable = world_size, 0, True
        self.results = ctx.Queue()
        self.tasks = [ctx.SimpleQueue() for _ in range(world_size)]
        port, env = free_port(), base_env()
        self.procs = [ctx.Process(target=_world_rank, daemon=True,
                                  args=(r, world_size, port, local_world_size, env, self.tasks[r], self.results))
                      for r in range(world_size)]
        for p in self.procs:
            _launch(p, kind)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, args, timeout: float, last: bool = False):
        """`last`: the processes leave once done (the test's ranks may count on the others
        leaving, as ranks of a world of their own do)."""
        self.seq += 1
        task = pickle.dumps((self.seq, fn, args, base_env(), last))
        for q in self.tasks:
            q.put(task)
        results, errors = {}, {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                seq, rank, status, payload = self.results.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(self.procs) if not p.is_alive() and i not in results and i not in errors]
                for i in dead:  # died without a word (a segfault, os._exit): say so
                    errors[i] = f"rank {i} exited with code {self.procs[i].exitcode} without reporting"
                continue
            if seq != self.seq:
                continue
            if status == "ok, not reusable":
                self.reusable = False
            (results if status.startswith("ok") else errors)[rank] = payload
            if errors:
                # One rank failed: give the others a moment to report, then stop waiting for them.
                deadline = min(deadline, time.monotonic() + 10)
        hung = [i for i in range(self.world_size) if i not in results and i not in errors]
        return results, errors, hung

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=5)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()


_worlds: dict[tuple[int, int, str], World] = {}


def run_ranks(fn, world_size: int, *args, timeout: float = 120, local_world_size: int | None = None,
              fresh: bool = False, kind: str = "plain"):
    """`fn(rank, world_size, *args)` on every rank of a gloo world; the list of what each returned.
    A rank that raises fails the test with its traceback; ranks still busy after `timeout`
    seconds are killed and the test fails, so a hang shows up as a failure, not a stuck suite.

    `fn` sees the test's environment as it is at the call. Worlds of `kind="plain"` are kept by
    shape and reused; `fresh=True` asks for a world of this call's own, for a test that changes
    process-global state on purpose or whose ranks count on the others leaving when done.
    `kind="deepspeed"` or `"vllm"`: ranks forked from a server that has imported that library,
    always a world of their own (both patch torch or keep state per process). `kind="cold"`: spawned
    interpreters that have imported nothing, for a test of what an import does."""
    key = (world_size, local_world_size or world_size, kind)
    fresh = fresh or kind != "plain"
    world = None if fresh else _worlds.pop(key, None)
    if world is not None and not world.alive():
        world.close(kill=True)
        world = None
    world = world or World(*key)
    try:
        results, errors, hung = world.run(fn, args, timeout, last=fresh)
    except BaseException:
        world.close(kill=True)
        raise
    if errors or hung or fresh or not world.reusable or not world.alive():
        world.close(kill=bool(errors or hung or not world.reusable))
    else:
        _worlds[key] = world
    if errors:
        msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise AssertionError(f"rank(s) {sorted(errors)} failed:\n{msg}")
    if hung:
        raise AssertionError(f"rank(s) {hung} still running after {timeout}s (hang) and were killed")
    return [pickle.loads(results[r]) for r in range(world_size)]


def close_worlds() -> None:
    while _worlds:
        _worlds.popitem()[1].close()


# ------------------------------------------------------------------ training jobs, warm

def _job_rank(env: dict[str, str], argv: list[str], script: str | None, out_path: str, err_path: str):
    _enter_rank(env)
    # Both streams into the job's two files, every rank appending: interleaved as torchrun's are.
    for fd, path in ((1, out_path), (2, err_path)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    code = 1
    try:
        if script is None:
            from spmdsplit.train import main

            sys.argv = ["spmdsplit/train.py", *argv]
            code = main(argv)
        else:
            import runpy

            sys.argv = [script, *argv]
            runpy.run_path(script, run_name="__main__")
            code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


class Job:
    """A warm job's ranks, started: `wait()` gives its CompletedProcess. `apart`: no launcher
    stops the others when one fails, and each rank has its own output (`ranks()`)."""

    def __init__(self, nproc: int, argv: list[str], env: dict | None = None, script: str | None = None,
                 cwd: str | None = None, apart: bool = False, rank_envs: list[dict] | None = None,
                 kind: str = "plain"):
        ctx = context(kind)
        self.args = ["<warm>", f"--nproc-per-node={nproc}", script or "-m spmdsplit.train", *argv]
        self.apart, self.dir, self.store = apart, tempfile.mkdtemp(prefix="spmdsplit-job-"), None
        # One pair of files for the job (interleaved, as torchrun's output), or one per rank (apart).
        self.files = [(os.path.join(self.dir, f"stdout{r}"), os.path.join(self.dir, f"stderr{r}"))
                      for r in range(nproc if apart else 1)]
        for path in sum(self.files, ()):
            open(path, "w").close()
        here = os.getcwd()
        os.chdir(cwd or here)  # a forked process starts in the client's folder
        try:
            self.procs = []
            for rank, rank_env in enumerate(rank_envs or self._rendezvous(nproc, env or {})):
                out, err = self.files[rank if apart else 0]
                p = ctx.Process(target=_job_rank, args=(rank_env, list(argv), script, out, err), daemon=True)
                _launch(p, kind)
                self.procs.append(p)
        finally:
            os.chdir(here)

    def _rendezvous(self, nproc: int, env: dict) -> list[dict]:
        """Each rank's environment: torchrun's variables, its store hosted here as torchrun's agent
        hosts it (a rank that dies takes no store along); apart, rank 0 hosts it, as by hand."""
        import torch.distributed as dist

        port = free_port()
        common = {**base_env(), **env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                  "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1"}
        if self.apart:
            common["TORCH_DIST_INIT_BARRIER"] = "0"
            return [{**common, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(nproc)]
        self.store = dist.TCPStore("127.0.0.1", port, nproc, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=600))
        common.update(GROUP_RANK="0", ROLE_NAME="default", ROLE_WORLD_SIZE=str(nproc), TORCHELASTIC_RUN_ID=f"warm-{port}",
                      TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0",
                      TORCHELASTIC_MAX_RESTARTS="0", TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
        return [{**common, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)} for r in range(nproc)]

    def poll(self):
        """None while it runs; else its exit code (as torchrun: 1 once a rank failed, the others
        stopped). Ranks started apart are left to end on their own."""
        codes = [p.exitcode for p in self.procs]
        if not self.apart and any(c not in (None, 0) for c in codes):
            self.stop()
            return 1
        return None if None in codes else max(codes, key=abs)

    def stop(self, sig=signal.SIGTERM, grace: float = 5.0) -> None:
        """What torchrun's agent does when a worker fails: every other worker is sent SIGTERM,
        then SIGKILL after a grace period."""
        for p in self.procs:
            if p.is_alive():
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:  # it ended between the look and the signal
                    pass
        end = time.monotonic() + grace
        for p in self.procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()

    def output(self, rank: int = 0) -> tuple[str, str]:
        out, err = self.files[rank]
        with open(out, errors="replace") as o, open(err, errors="replace") as e:
            return o.read(), e.read()

    def wait(self, timeout: float = 600) -> subprocess.CompletedProcess:
        deadline = time.monotonic() + timeout
        code = self.poll()
        while code is None:
            if time.monotonic() > deadline:
                self.stop(signal.SIGKILL, 0)
                out, err = self.output()
                raise subprocess.TimeoutExpired(self.args, timeout, out, err)
            time.sleep(0.1)
            code = self.poll()
        self.store = None
        return subprocess.CompletedProcess(self.args, code, *self.output())

    def ranks(self) -> list[subprocess.CompletedProcess]:
        """Each rank's exit code and output (ranks started apart, all ended)."""
        return [subprocess.CompletedProcess(self.args, p.exitcode, *self.output(r)) for r, p in enumerate(self.procs)]


def job(nproc: int, *overrides: str, timeout: float = 600, env: dict | None = None, script: str | None = None,
        cwd: str | None = None, fresh_dir: bool = True) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node nproc -m spmdsplit.train trainer.progress_bar=false *overrides`,
    run warm. Unless the overrides say where, its checkpoints go to a fresh folder: never resume
    from (or write to) checkpoints another run left in the working folder."""
    return Job(nproc, _job_argv(overrides, fresh_dir), env=env, script=script, cwd=cwd,
               kind=_kind(overrides)).wait(timeout)


def _kind(overrides) -> str:
    """A job with vLLM rollout or a DeepSpeed engine forks from the server that has it imported."""
    if "rollout.name=vllm" in overrides:
        return "vllm"
    return "deepspeed" if any(o.endswith("engine=deepspeed") for o in overrides) else "plain"


def ranks_apart(nproc: int, argv: list[str], env: dict | None = None) -> Job:
    """Warm ranks of `spmdsplit.train` with torchrun's variables but no launcher to stop the
    others when one fails: each rank must end on its own. `wait()`
    returns once all have; `ranks()` gives each one's exit code and output."""
    return Job(nproc, list(argv), env=env, apart=True)


def cli(argv: list[str], env: dict | None = None, hide: tuple[str, ...] = (), cwd: str | None = None) -> Job:
    """`python -m spmdsplit.train *argv` as a user types it, warm: one process with exactly the
    session's environment plus `env` (no rendezvous unless `env` sets one). `hide`: packages the
    process must see as not installed."""
    rank_env = {**base_env(), **(env or {}), "SPMDSPLIT_TEST_HIDE": ",".join(hide)}
    return Job(1, list(argv), apart=True, rank_envs=[rank_env], cwd=cwd)


def tool_job(nproc: int, args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """tools/jobs.py's LAUNCH, warm: the benchmark tools' harness checked on forked ranks."""
    return Job(nproc, list(args), env=env, kind=_kind(args)).wait(timeout)


def _job_argv(overrides, fresh_dir: bool = True) -> list[str]:
    overrides = list(overrides)
    if fresh_dir and not any(o.startswith("trainer.default_local_dir=") for o in overrides):
        overrides.insert(0, f"trainer.default_local_dir={tempfile.mkdtemp(prefix='spmdsplit-ckpt-')}")
    return ["trainer.progress_bar=false", *overrides]


_job_cache: dict[tuple, tuple[subprocess.CompletedProcess, str]] = {}


def cached_job(nproc: int, *overrides: str, timeout: float = 600, env: dict | None = None):
    """One job per session for every test that reads the same job's outputs: (result, out), the
    job's folder `out` holding tb/ (trainer.log_dir) and ckpt/ (trainer.default_local_dir). The
    key is the job's shape and overrides; `{out}` in an override is replaced by the folder."""
    key = (nproc, overrides, tuple(sorted((env or {}).items())))
    if key not in _job_cache:
        out = tempfile.mkdtemp(prefix="spmdsplit-cached-job-")
        argv = [o.replace("{out}", out) for o in overrides]
        result = job(nproc, f"trainer.log_dir={out}/tb", f"trainer.default_local_dir={out}/ckpt", *argv,
                     timeout=timeout, env=env)
        _job_cache[key] = (result, out)
    return _job_cache[key]


# ------------------------------------------------------------------ real processes

def torchrun_cmd(nproc: int, *args: str, script: str | None = None) -> list[str]:
    """`torchrun ... -m spmdsplit.train *args`, or `torchrun ... script *args`."""
    target = [script] if script else ["-m", "spmdsplit.train"]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
            *target, *args]


def torchrun(nproc: int, *overrides: str, timeout: float = 600, cwd=None, env: dict | None = None,
             script: str | None = None) -> subprocess.CompletedProcess:
    """Real `torchrun -m spmdsplit.train` (or a script), as a user runs it: for tests whose
    subject is torchrun itself (its teardown, signals) or one job per layout end to end."""
    cmd = torchrun_cmd(nproc, *_job_argv(overrides), script=script)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=base_env(PYTHONPATH=_pythonpath(), **(env or {})))


def start_torchrun(nproc: int, *args: str, script: str | None = None, env: dict | None = None) -> subprocess.Popen:
    """Real torchrun, started: its merged output readable line by line while it runs."""
    return subprocess.Popen(torchrun_cmd(nproc, *args, script=script), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=base_env(PYTHONPATH=_pythonpath(), **(env or {})))


def _pythonpath() -> str:
    """The repository first (scripts under tests/ import `tests.*`), then what the session has
    (tests/support/nccl_site, put there by conftest)."""
    return os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))


def python(args: list[str], env: dict | None = None, cwd=None, timeout: float = 600) -> subprocess.CompletedProcess:
    """One plain interpreter, `python *args`, in the session's environment less any rendezvous."""
    return subprocess.run([sys.executable, *args], cwd=cwd, env=base_env(**(env or {})), capture_output=True,
                          text=True, timeout=timeout)


# ------------------------------------------------------------------ stopping a job; controlling a torchrun job
def stop_on_request(nproc: int, argv, ckpt_dir, after: str, rank: int, timeout: float = 240) -> int:
    """Starts the job warm (as `job`), asks world rank `rank` alone to stop (SIGUSR2; the others
    learn it by the vote) once `after` is printed, and returns the step it checkpointed and
    stopped after. Its callers' subject is what the checkpoint holds and the exact resume from it;
    the same stop under real torchrun, whose teardown of ranks that exit stopped is the subject,
    is tests/test_resume.py's (a cold torchrun cost 8-13 s more a stop on a quiet 2-core machine, 19-41 s
    on a busy one, in each of five tests)."""
    stopped = Job(nproc, _job_argv(argv), kind=_kind(argv))
    deadline = time.monotonic() + timeout
    while after not in "".join(stopped.output()):
        assert stopped.poll() is None, f"the job ended before {after!r}:\n{''.join(stopped.output())[-3000:]}"
        assert time.monotonic() < deadline, f"no {after!r} within {timeout}s:\n{''.join(stopped.output())[-3000:]}"
        time.sleep(0.05)
    os.kill(stopped.procs[rank].pid, signal.SIGUSR2)
    result = stopped.wait(timeout)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "stopped on request" in output, output[-3000:]  # EXIT_STOPPED, as torchrun reports it
    return int(open(os.path.join(ckpt_dir, LATEST)).read())


def read_until(proc, marker: str, timeout: float = 240) -> str:
    seen, deadline = [], time.monotonic() + timeout
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            return "".join(seen)
        assert time.monotonic() < deadline, f"no {marker!r} within {timeout}s:\n{''.join(seen)[-3000:]}"
    raise AssertionError(f"the job ended before {marker!r}:\n{''.join(seen)[-3000:]}")


def worker_pid(torchrun_pid: int, rank: int) -> int:
    """The pid of torchrun's worker with this RANK (read from /proc, Linux)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != torchrun_pid:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            if env.get(b"RANK") == str(rank).encode():
                return int(pid)
        except (FileNotFoundError, ProcessLookupError):
            continue
    raise AssertionError(f"no worker with RANK={rank} under torchrun pid {torchrun_pid}")
