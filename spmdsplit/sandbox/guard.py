"""verl's reliability guard, re-done: what testing_util switches off before it loads a program
(runner side, standard library only).

It runs at both isolation levels, because verl's scores depend on it: a program that calls
`exit()`, `os.getcwd()` or imports `subprocess` fails in verl, and must fail here. It is also the
only line of defence at the `guard` level, and not a sandbox: what it removes stays reachable
(`posix.kill`, `posix.fork`, `posix.unlink` are the same functions as the `os` ones it clears;
`del sys.modules["ctypes"]` brings ctypes back). spmdsplit/sandbox/isolation.py says what each
level stops.
"""

from __future__ import annotations

import builtins
import faulthandler
import os
import sys

# os functions set to None: those that kill, fork, spawn a shell, change the file system, the
# process's identity or its working folder.
_OS_FUNCTIONS = (
    "kill", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid", "fork", "forkpty",
    "killpg", "rename", "renames", "truncate", "replace", "unlink", "fchmod", "fchown", "chmod", "chown",
    "chroot", "lchflags", "lchmod", "lchown", "getcwd", "chdir",
)
_SHUTIL_FUNCTIONS = ("rmtree", "move", "chown")
# Modules that can then no longer be imported (a None in sys.modules makes `import` raise).
_BLOCKED_MODULES = ("ipdb", "joblib", "resource", "psutil", "tkinter", "subprocess", "ctypes")


def apply() -> None:
    faulthandler.disable()
    builtins.exit = None
    builtins.quit = None
    builtins.help = None
    os.environ["OMP_NUM_THREADS"] = "1"  # before os.putenv goes: setting os.environ calls it
    for name in _OS_FUNCTIONS:
        setattr(os, name, None)
    import shutil

    for name in _SHUTIL_FUNCTIONS:
        setattr(shutil, name, None)
    subprocess = sys.modules.get("subprocess")
    if subprocess is not None:
        subprocess.Popen = None
    for name in _BLOCKED_MODULES:
        sys.modules[name] = None
