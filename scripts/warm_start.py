"""A command run in a forked child of this process rather than in a fresh interpreter: `Forked` is a Popen for
`python -m MODULE ...` or `python SCRIPT ...` whose child inherits torch, transformers, Hydra and dpmem already
imported (`preload`). A fresh interpreter spends 8 CPU-s on those imports on 2 cores before a toy run starts; the
toy sequences of gpu_figures.py and tutorial.py start eleven. The child is otherwise a process of its own: its own
session (a kill of its group takes its children), working directory, environment, arguments and exit status, its
stdout and stderr captured (together, or apart).

POSIX only, and not on a machine with a GPU (`available`): there the scripts start fresh interpreters, as before.
The parent must not run torch ops in threads before it forks (neither script does)."""

from __future__ import annotations

import atexit
import glob
import importlib
import io
import os
import random
import runpy
import select
import subprocess
import sys
import threading
import time
import traceback
import warnings

# what the toy steps import; one that fails to import is left to the child, which then says why
PRELOAD = ("torch", "numpy", "transformers", "transformers.models.roberta.modeling_roberta",
           "transformers.models.vit.modeling_vit", "hydra", "dp_accounting", "opacus", "dpmem.cli",
           "dpmem.engine.trainer", "dpmem.methods", "pytest")
LOCK = threading.Lock()  # a fork and the parent's printing, one at a time (a child must not inherit a held lock)


def available() -> bool:
    """Where the system forks and no GPU is attached: a CUDA or ROCm runtime that the parent started (any import may
    ask whether a GPU is there, and asking starts it) fails in a forked child, so a GPU machine keeps fresh
    interpreters."""
    return hasattr(os, "fork") and not glob.glob("/dev/nvidia[0-9]*") and not os.path.exists("/dev/kfd")


def preload() -> None:
    """Import what the children will import, once, in this process (before it starts any thread)."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the child imports it again and reports the error itself
            pass


class Forked:
    """`subprocess.Popen(argv, cwd=cwd, env=env, stdout=PIPE, stderr=STDOUT or PIPE, text=True,
    start_new_session=True)` for argv = [python, "-m", module, ...] or [python, script, ...], run in a fork of this
    process: `pid`, `communicate(timeout)` (stdout, and stderr unless `merged`; raises subprocess.TimeoutExpired,
    then may be called again) and `returncode`."""

    def __init__(self, argv: list[str], cwd, env: dict[str, str], merged: bool = True, new_session: bool = True):
        self.args, self.returncode = argv, None
        pipes = [os.pipe() for _ in range(1 if merged else 2)]
        with LOCK, warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12's note on forking with threads
            sys.stdout.flush(), sys.stderr.flush()
            pid = os.fork()
        if pid == 0:  # the child: never returns
            for read, _ in pipes:
                os.close(read)
            _child(argv, str(cwd), env, pipes[0][1], pipes[-1][1], new_session)
        for _, write in pipes:
            os.close(write)
        self.pid, self._reads = pid, [read for read, _ in pipes]
        self._chunks, self._live = {fd: [] for fd in self._reads}, set(self._reads)

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._live:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            for fd in select.select(list(self._live), [], [], left)[0]:
                if chunk := os.read(fd, 1 << 16):
                    self._chunks[fd].append(chunk)
                else:  # the child and every process that holds the pipe (its own children) have closed it
                    os.close(fd)
                    self._live.discard(fd)
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        texts = [b"".join(self._chunks[fd]).decode(errors="replace") for fd in self._reads]
        return texts[0], (texts[1] if len(texts) > 1 else None)


def start(argv: list[str], cwd, env: dict[str, str], merged: bool = True, new_session: bool = True,
          fork: bool = True) -> Forked | subprocess.Popen:
    """`argv` started as a process of its own: forked (`Forked`) where `fork` and `available()`, else a fresh
    interpreter (subprocess.Popen, the same streams and session); either has pid, communicate and returncode."""
    if fork and available():
        return Forked(argv, cwd, env, merged, new_session)
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merged else subprocess.PIPE, text=True,
                            start_new_session=new_session)


def _child(argv: list[str], cwd: str, env: dict[str, str], out: int, err: int, new_session: bool) -> None:
    """Become the process `argv` starts, as a fresh interpreter would be, and exit with its status."""
    code = 1
    try:
        if new_session:
            os.setsid()
        os.dup2(out, 1), os.dup2(err, 2)
        for fd in {out, err}:
            os.close(fd)
        # new streams on the pipe: the inherited ones may hold a lock another thread of the parent took
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
        atexit._clear()  # the parent's exit handlers are the parent's (a temporary folder it deletes at its end)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        random.seed()  # a fresh interpreter's draws, not a copy of the parent's
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        if "torch" in sys.modules and env.get("OMP_NUM_THREADS"):
            sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))  # read at import, which was ours
        code = _run(argv[1:], [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        atexit._run_exitfuncs()
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except BaseException:  # noqa: BLE001 - reported as a fresh interpreter reports it
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush(), sys.stderr.flush()
        finally:
            os._exit(code)


def _run(args: list[str], pythonpath: list[str]) -> int:
    """`python ARGS` in this process, its path begun as a fresh interpreter's (the working directory under -m, else
    the script's folder, then PYTHONPATH): the exit status it would have."""
    module = args[0] == "-m"
    sys.path[:1] = [os.getcwd() if module else os.path.dirname(os.path.abspath(args[0])), *pythonpath]
    if module:
        sys.argv = [args[1], *args[2:]]
        return exit_status(lambda: runpy.run_module(args[1], run_name="__main__", alter_sys=True))
    sys.argv = list(args)
    return exit_status(lambda: runpy.run_path(args[0], run_name="__main__"))


def exit_status(main) -> int:
    """The status an interpreter ends with after `main()`: SystemExit's code (None is 0; a message is printed and
    is 1), 1 with the traceback printed for an exception. A KeyboardInterrupt goes on up."""
    try:
        main()
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return 1
    return 0
