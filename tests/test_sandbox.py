r"""The code sandbox (spmdsplit/sandbox/) against hostile programs, at both isolation levels: each
must fail (score 0) and leave this process, its children and threads, the machine's processes and
files as they were.

What each level stops (spmdsplit/sandbox/isolation.py says why):

| program                               | namespaces            | guard                                  |
| ------------------------------------- | --------------------- | -------------------------------------- |
| infinite loop                         | killed at the deadline | killed at the deadline                |
| memory bomb                           | RLIMIT_AS              | RLIMIT_AS                              |
| fork bomb (posix.fork, past the guard)| RLIMIT_NPROC, PID ns   | not run: as root nothing bounds it     |
| fork bomb (os.fork)                   | the guard              | the guard                              |
| prints GBs (sys.stdout / fd 1)        | output cap / /dev/null | output cap / /dev/null                 |
| writes GBs in its folder              | tmpfs full (ENOSPC)    | RLIMIT_FSIZE per file (not file count) |
| deletes a file outside (posix.unlink) | read-only file system  | not run: as root it would              |
| deletes a file outside (os.remove)    | the guard              | the guard                              |
| kill(getppid) past the guard          | reaches nothing        | kills the runner, not the rank         |
| kill(-1) past the guard               | its own PID ns only    | not run: as root it kills the machine  |
| killpg(0) past the guard              | its own session        | the runner's group, not the rank's     |
| os._exit, sys.exit in a function      | counted as a crash     | counted as a crash                     |
| garbles or closes the report channel  | counted as a crash     | counted as a crash                     |
| network                               | no network (own net ns)| not stopped                            |

The rows "not run" are what guard cannot stop as root: a program that sidesteps verl's guard has
root's rights there. Each test below was seen to fail with its protection taken out (the limit
not set, the namespace not entered, the remount skipped, the report not checked).
"""

import asyncio
import os
import signal
import socket
import subprocess
import tempfile
import time
import warnings

import pytest

from spmdsplit.config import SandboxConfig
from spmdsplit.rewards import code
from spmdsplit.sandbox import Limits, Sandbox, SandboxError, isolation, launch, pool, reaper
from spmdsplit.sandbox.pool import CRASHED, DONE, LOAD_ERROR, STOPPED, TIMEOUT

LIMITS = Limits(timeout_s=1.0, memory_mb=256, max_processes=8, max_open_files=64, max_output_mb=1)
NAMESPACES_OFF = isolation.namespaces_work()
LEVELS = [pytest.param("namespaces", marks=pytest.mark.skipif(bool(NAMESPACES_OFF), reason=NAMESPACES_OFF or "-")),
          "guard"]
TRUTH = {"inputs": ["1\n"], "outputs": ["2\n"]}  # right: print(int(input()) + 1)


@pytest.fixture(params=LEVELS)
def sandbox(request):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # guard's start-up warning: test_describe... checks it
        return Sandbox(request.param, workers=1, limits=LIMITS)


def _tasks_and_children() -> tuple[int, int]:
    """This process's threads and its children."""
    children = 0
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            children += len(f.read().split())
    return len(os.listdir("/proc/self/task")), children


def _program_uids() -> list[int]:
    return [launch.program_uid(slot) for slot in range(4)]


@pytest.fixture(autouse=True)
def leaves_all_as_it_was():
    """After each test: no process of a program's uid, no program folder left, and no more threads
    and children in this process than before (asyncio's child watcher threads settle first)."""
    before = _tasks_and_children()
    folders = set(os.listdir(tempfile.gettempdir()))
    yield
    def more_than_before():
        return any(now > then for now, then in zip(_tasks_and_children(), before))

    deadline = time.monotonic() + 5
    while (more_than_before() or any(map(reaper.processes_of, _program_uids()))) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for uid in _program_uids() for pid in reaper.processes_of(uid)]
    assert not more_than_before(), (_tasks_and_children(), before)  # (a thread of an earlier test may end meanwhile)
    mine = f"spmdsplit-program-{os.getpid()}-"
    assert {f for f in set(os.listdir(tempfile.gettempdir())) - folders if f.startswith(mine)} == set()


def run(sandbox: Sandbox, source: str, inputs=("1\n",), fn_name=None, timeout_s=1.0):
    return asyncio.run(sandbox.run({"code": source, "fn_name": fn_name, "inputs": list(inputs)}, timeout_s))


def score(sandbox: Sandbox, source: str, truth=None) -> dict:
    return asyncio.run(code.compute_score(source, truth or TRUTH, sandbox))


def test_a_right_program_passes(sandbox):
    assert score(sandbox, "print(int(input()) + 1)")["score"] == 1.0


def test_infinite_loop_is_killed_at_the_deadline(sandbox):
    started = time.monotonic()
    result = run(sandbox, "while True:\n    pass", timeout_s=0.5)
    assert result.status == TIMEOUT and time.monotonic() - started < 3


def test_a_sleeping_program_is_killed_too(sandbox):
    result = run(sandbox, "import time\ntime.sleep(60)", timeout_s=0.5)
    assert result.status == TIMEOUT


def test_memory_bomb_hits_the_address_space_limit(sandbox):
    started = time.monotonic()
    result = run(sandbox, "x = b'x' * (2 * 10**9)\nprint(2)")
    assert result.status == STOPPED and result.outcomes[0].error == "runtime_error"  # MemoryError
    assert time.monotonic() - started < 3


def test_fork_bomb_through_os_fork_is_stopped_by_the_guard(sandbox):
    result = run(sandbox, "import os\nwhile True:\n    os.fork()")
    assert result.status == STOPPED and result.outcomes[0].error == "runtime_error"


def test_fork_bomb_past_the_guard_is_bounded_and_leaves_nothing():
    """posix.fork is os.fork's function, which the guard leaves. Namespaces only: under guard as
    root nothing bounds it."""
    if NAMESPACES_OFF:
        pytest.skip(NAMESPACES_OFF)
    sandbox = Sandbox("namespaces", workers=1, limits=LIMITS)
    bomb = "import posix, time\nwhile True:\n    try:\n        posix.fork()\n    except OSError:\n        time.sleep(0.001)"
    most = []

    async def watched():
        task = asyncio.ensure_future(sandbox.run({"code": bomb, "fn_name": None, "inputs": ["1\n"]}, 1.0))
        while not task.done():
            most.append(len(reaper.processes_of(launch.program_uid(0))))
            await asyncio.sleep(0.02)
        return await task

    result = asyncio.run(watched())
    assert result.status == TIMEOUT
    # P, G and the 8 it may start (each forked child forks on until the limit)
    assert 3 < max(most) <= 2 + LIMITS.max_processes


def test_printing_gigabytes_is_cut_at_the_output_cap(sandbox):
    started = time.monotonic()
    result = run(sandbox, "while True:\n    print('x' * 10**5)")
    assert result.status == STOPPED and result.outcomes[0].error == "output_too_large"
    assert time.monotonic() - started < 3
    # and when the program catches the error and goes on
    result = run(sandbox, "for _ in range(100):\n    try:\n        print('x' * 10**5)\n    except OSError:\n        pass")
    assert result.outcomes[0].error == "output_too_large"


def test_printing_to_fd_1_goes_nowhere(sandbox):
    result = run(sandbox, "import os\nfor _ in range(10**4):\n    os.write(1, b'x' * 10**5)\nprint(2)")
    assert result.status == DONE and result.outcomes[0].output == "2\n"


def test_writing_gigabytes_in_its_folder_stops_at_the_cap(sandbox):
    result = run(sandbox, "written = 0\ntry:\n    with open('big', 'wb') as f:\n        while True:\n"
                          "            f.write(b'x' * 65536)\n            f.flush()\n            written += 65536\n"
                          "except OSError as e:\n    print(written, e.errno)")
    written, errno = result.outcomes[0].output.split()
    assert int(written) <= LIMITS.max_output_mb << 20
    assert int(errno) in (27, 28)  # EFBIG (RLIMIT_FSIZE), ENOSPC (the tmpfs, as big)


def test_many_files_fill_only_the_tmpfs():
    """RLIMIT_FSIZE bounds one file; under namespaces the tmpfs bounds them all (guard: nothing,
    so not run there)."""
    if NAMESPACES_OFF:
        pytest.skip(NAMESPACES_OFF)
    sandbox = Sandbox("namespaces", workers=1, limits=LIMITS)
    result = run(sandbox, "n = 0\ntry:\n    while True:\n        with open(f'f{n}', 'wb') as f:\n"
                          "            f.write(b'x' * 262144)\n        n += 1\nexcept OSError as e:\n    print(n, e.errno)")
    files, errno = result.outcomes[0].output.split()
    assert int(files) * 262144 <= LIMITS.max_output_mb << 20 and int(errno) == 28  # ENOSPC


@pytest.fixture
def outside_file():
    """A file any uid may delete, in a folder any uid may write: only a read-only file system
    protects it."""
    folder = tempfile.mkdtemp(prefix="sandbox-victim-")
    os.chmod(folder, 0o1777 & ~0o1000 | 0o777)
    path = os.path.join(folder, "keep.txt")
    with open(path, "w") as f:
        f.write("keep")
    os.chmod(path, 0o666)
    yield path
    reaper.remove_folder(folder)


def test_deleting_a_file_outside_is_stopped_by_the_guard(sandbox, outside_file):
    result = run(sandbox, f"import os\nos.remove({outside_file!r})")
    assert result.outcomes[0].error == "runtime_error" and os.path.exists(outside_file)


def test_deleting_or_writing_a_file_outside_past_the_guard_fails(outside_file):
    if NAMESPACES_OFF:
        pytest.skip(NAMESPACES_OFF)
    sandbox = Sandbox("namespaces", workers=1, limits=LIMITS)
    attempts = (f"import posix\nfor act in (lambda: posix.unlink({outside_file!r}), lambda: open({outside_file!r}, 'a').write('x'),"
                f" lambda: open({os.path.dirname(outside_file)!r} + '/new', 'w')):\n"
                "    try:\n        act()\n        print('done')\n    except OSError as e:\n        print(e.errno)")
    result = run(sandbox, attempts)
    assert result.outcomes[0].output.split() == ["30", "30", "30"]  # EROFS
    with open(outside_file) as f:
        assert f.read() == "keep"
    assert os.listdir(os.path.dirname(outside_file)) == ["keep.txt"]


def test_killing_its_parent_reaches_neither_the_rank_nor_the_runner(sandbox):
    """os.kill is gone (the guard): a runtime error. posix.kill is the same function: under
    namespaces getppid() is 0 (the parent is outside the PID namespace) and kill(0), killpg(0)
    reach only the program's own session, whose leader is PID 1 of its namespace, which ignores
    signals from inside it: nothing happens. Under guard the parent is the runner (not this
    process): it dies, and the run with it; killpg(0) is the program's own group."""
    naive = run(sandbox, "import os\nos.kill(os.getppid(), 9)\nprint(2)")
    assert naive.outcomes[0].error == "runtime_error"
    for attack in ("import posix\nposix.kill(posix.getppid(), 9)", "import posix\nposix.killpg(0, 9)"):
        result = run(sandbox, attack + "\nimport time\ntime.sleep(0.2)\nprint(2)")
        if sandbox.isolation == "namespaces":
            assert result.status == DONE and result.outcomes[0].output == "2\n"
        else:
            assert result.status == CRASHED
            assert score(sandbox, attack + "\nimport time\ntime.sleep(0.2)\nprint(int(input()) + 1)")["score"] == 0.0
    os.kill(os.getpid(), 0)  # still here


def test_kill_minus_one_reaches_only_its_own_namespace():
    """Namespaces only: under guard, as root, kill(-1) past the guard kills every process of the
    machine. The witness runs as the program's own uid: only the PID namespace stands between."""
    if NAMESPACES_OFF:
        pytest.skip(NAMESPACES_OFF)
    sandbox = Sandbox("namespaces", workers=1, limits=LIMITS)
    uid = launch.program_uid(0) if launch.runs_as_root() else os.getuid()
    witness = subprocess.Popen(["sleep", "30"], user=uid, group=uid if launch.runs_as_root() else None,
                               start_new_session=True)
    try:
        result = run(sandbox, "import posix\ntry:\n    posix.kill(-1, 9)\nexcept OSError as e:\n    print(e.errno)")
        assert result.outcomes[0].output == "3\n"  # ESRCH: nothing it may signal but itself
        assert witness.poll() is None
    finally:
        witness.kill()
        witness.wait()


def test_exiting_the_runner_early_is_a_crash(sandbox):
    result = run(sandbox, "print(int(input()) + 1)\nimport os\nos._exit(0)")
    assert result.status == CRASHED
    assert score(sandbox, "print(int(input()) + 1)\nimport os\nos._exit(0)")["score"] == 0.0
    calls = {"fn_name": "f", "inputs": ["1"], "outputs": ["2"]}
    assert score(sandbox, "import sys\ndef f(a):\n    sys.exit(0)", calls)["score"] == 0.0
    assert run(sandbox, "import sys\ndef f(a):\n    sys.exit(0)", ["1"], fn_name="f").status == CRASHED
    assert run(sandbox, "raise SystemExit", ["1"], fn_name="f").status == CRASHED  # at load


# The report channel: the runner's only descriptor that is a pipe besides fds 0-2 (/dev/null).
FIND_REPORT = ("import posix, stat\nreport = [fd for fd in range(3, 64) if _is_pipe(fd)][0]\n")
IS_PIPE = ("def _is_pipe(fd):\n    try:\n        return stat.S_ISFIFO(posix.fstat(fd).st_mode)\n"
           "    except OSError:\n        return False\n")


@pytest.mark.parametrize("attack", [
    "posix.write(report, b'garbage\\n')",
    "posix.write(report, b'{\"e\": \"done\"}\\n')",  # done before any test
    "posix.write(report, b'{\"e\": \"test\", \"i\": 5, \"out\": \"2\"}\\n')",  # out of order
    "posix.write(report, b'{\"e\": \"test\", \"i\": 0, \"out\": 2}\\n')",  # not text
    "posix.write(report, b'x' * (3 << 20))",  # a line over the limit, never ended
    "posix.close(report)",
    "posix.dup2(posix.open('/dev/null', posix.O_WRONLY), report)",
])
def test_garbling_the_report_channel_is_a_crash(sandbox, attack):
    result = run(sandbox, IS_PIPE + FIND_REPORT + attack + "\nprint(int(input()) + 1)")
    assert result.status == CRASHED
    assert score(sandbox, IS_PIPE + FIND_REPORT + attack + "\nprint(int(input()) + 1)")["score"] == 0.0


def test_forging_the_right_answer_needs_the_answer(sandbox):
    """A program may write its own well-formed events; what they carry is still an output that the
    rank judges, and the expected one is nowhere in the program's process (verl's program can find
    it with gc)."""
    secret = "zq8Xw-the-expected-output"
    # Every string held by a list, tuple or dict in the process (the program's own text must not
    # hold the secret: it looks for it spelled in two halves).
    hunt = ("import gc\nmark = 'zq8X' + 'w-the'\nfound = 'nothing'\nfor o in gc.get_objects():\n"
            "    items = o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple)) else ()\n"
            "    for item in items:\n        if isinstance(item, str) and mark in item and item != mark:\n"
            "            found = item\nprint(found.strip())")
    truth = {"inputs": ["1\n"], "outputs": [secret + "\n"]}
    assert score(sandbox, hunt, truth)["score"] == 0.0
    assert run(sandbox, hunt).outcomes[0].output == "nothing\n"


def test_no_network_under_namespaces():
    if NAMESPACES_OFF:
        pytest.skip(NAMESPACES_OFF)
    sandbox = Sandbox("namespaces", workers=1, limits=LIMITS)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    try:
        result = run(sandbox, f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                              "    print('connected')\nexcept OSError as e:\n    print(e.errno)")
        assert result.outcomes[0].output == "101\n"  # ENETUNREACH: its network namespace has no up link
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


def test_namespaces_view_of_the_machine():
    """What a program sees under namespaces: uid 0 without capabilities, PID 1, a /proc of its own
    processes, its folder the only writable place."""
    if NAMESPACES_OFF:
        pytest.skip(NAMESPACES_OFF)
    sandbox = Sandbox("namespaces", workers=1, limits=LIMITS)
    look = ("import posix\nprint(posix.getuid(), posix.getpid())\n"
            "print(sorted(e for e in posix.listdir('/proc') if e.isdigit()))\n"
            "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
            "print(posix.statvfs('/').f_flag & 1, posix.statvfs('.').f_flag & 1)")
    lines = run(sandbox, look).outcomes[0].output.splitlines()
    assert lines == ["0 1", "['1']", "0000000000000000", "1 0"]


def test_limits_and_environment_are_set(sandbox):
    look = ("import os\nlimits = {}\nfor line in open('/proc/self/limits').read().splitlines()[1:]:\n"
            "    limits[line[:26].strip()] = tuple(line[26:].split()[:2])\n"
            "print(limits)\nprint(sorted(os.environ))\nprint(os.environ['HOME'] == os.readlink('/proc/self/cwd'))")
    limits, environment, home = run(sandbox, look).outcomes[0].output.splitlines()
    limits = eval(limits)
    both = lambda n: (str(n), str(n))  # noqa: E731
    assert limits["Max address space"] == both(256 << 20) and limits["Max open files"] == both(64)
    assert limits["Max core file size"] == both(0) and limits["Max file size"] == both(1 << 20)
    assert limits["Max cpu time"] == ("3", "4")  # the run's 1 s + 1 s, and 1 s more: SIGKILL at 4
    # RLIMIT_NPROC: what the kernel counts already (P and G in their own user namespace) and 8 more
    if sandbox.isolation == "namespaces":
        assert limits["Max processes"] == both(2 + 8)
    assert eval(environment) == ["GOTOBLAS_MAIN_FREE", "HOME", "LANG", "LC_ALL", "MKL_NUM_THREADS", "OMP_NUM_THREADS",
                                 "OPENBLAS_MAIN_FREE", "OPENBLAS_NUM_THREADS", "PATH", "TMPDIR"]
    assert home == "True"


def test_at_most_workers_programs_at_once():
    sandbox = Sandbox("guard" if NAMESPACES_OFF else "namespaces", workers=1, limits=LIMITS)

    async def three():
        program = {"code": "import time\ntime.sleep(0.3)\nprint(1)", "fn_name": None, "inputs": [""]}
        return await asyncio.gather(*(sandbox.run(program, 2.0) for _ in range(3)))

    started = time.monotonic()
    assert [r.status for r in asyncio.run(three())] == [DONE] * 3
    assert time.monotonic() - started >= 0.9


def test_a_load_error_is_reported(sandbox):
    assert run(sandbox, "print(").status == LOAD_ERROR


def test_describe_names_the_isolation_and_the_limits():
    line = Sandbox("guard" if NAMESPACES_OFF else "namespaces", workers=3, limits=LIMITS).describe()
    assert "1 s a test (0.5 s in the first run of all tests)" in line and "256 MB" in line and "3 at once" in line
    if not NAMESPACES_OFF:
        assert line.startswith("code sandbox: namespaces")
    pool._warned.clear()
    with pytest.warns(UserWarning, match="guard only"):
        guard = Sandbox("guard", workers=1, limits=Limits(timeout_s=3.0)).describe()
    assert guard.startswith("WARNING: code sandbox: guard only")


def test_built_from_reward_sandbox_config():
    config = SandboxConfig(workers=0, isolation="auto", timeout_s=4.0, memory_mb=512, max_processes=4,
                           max_open_files=32, max_output_mb=2)
    sandbox = Sandbox.from_config(config)
    assert sandbox.workers == len(os.sched_getaffinity(0))
    assert sandbox.limits == Limits(timeout_s=4.0, memory_mb=512, max_processes=4, max_open_files=32, max_output_mb=2)
    assert sandbox.isolation == ("guard" if NAMESPACES_OFF else "namespaces")


def test_isolation_levels_are_checked():
    with pytest.raises(ValueError):
        isolation.resolve("docker")
    if NAMESPACES_OFF:
        with pytest.raises(SandboxError):
            isolation.resolve("namespaces")
