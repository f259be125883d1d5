import os
import sys
import time
from dataclasses import dataclass

import pytest

# the shared helpers' asserts (assert_close, released) report their operands as a test module's do
pytest.register_assert_rewrite("helpers")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# pytest -n N runs N workers: each takes its share of the cores, so that torch's threads do not oversubscribe them.
# The processes a worker starts (scripts, `dpmem` commands, launcher jobs) take the same share, through the
# environment they inherit, and so do the BLAS threads of numpy and scipy (read at their import, which is after
# this): OpenMP and OpenBLAS threads spin while they wait, and two workers' children, each with a thread per core,
# spent several times their own work spinning (bench_peers' smoke run: 73 CPU-s with 2 threads, 8 with 1)
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    _threads = max(1, (os.cpu_count() or 1) // _workers)
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_var, str(_threads))
    import torch

    torch.set_num_threads(_threads)


@pytest.fixture(autouse=True)
def stream_every_layer(request, monkeypatch):
    """The tests' tiny layers stream as a large model's do: an eager step keeps a layer whole below
    `taps.STREAM_MIN_ELEMENTS` (tests/test_persample.py checks that default). Runs in subprocesses keep the default,
    and so does a test marked default_streaming that compares with one."""
    from dpmem.persample import taps

    if request.node.get_closest_marker("default_streaming") is None:
        monkeypatch.setattr(taps, "STREAM_MIN_ELEMENTS", 0)


def pytest_sessionstart(session):
    session.config._dpmem_started = time.monotonic()


def pytest_sessionfinish(session, exitstatus):
    """The whole suite fails past its ceiling (tests/suite_time.py), measured by the controller (not each xdist
    worker) from its session's start."""
    import suite_time

    config = session.config
    if hasattr(config, "workerinput") or not suite_time.whole_suite(
            list(config.args), config.option.keyword, config.option.markexpr, str(config.rootpath)):
        return
    line = suite_time.verdict(time.monotonic() - config._dpmem_started, suite_time.ceiling())
    if line is not None:
        config.get_terminal_writer().line(f"FAILED: {line}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config):
    config.addinivalue_line("markers", "long: an end-to-end test of ten CPU-seconds or more (most of them in "
                                       "processes of their own): collected first (tests/conftest.py)")


def pytest_collection_modifyitems(config, items):
    """Tests marked cuda run where a GPU is, and are skipped elsewhere. Tests marked long are collected first: xdist
    hands out the tests in their collection order (after its groups, largest first), so each long one starts
    early, beside the short ones on the other workers, and none is left to run alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable: the order otherwise kept
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# Hydra's own logging set-up (dpmem's config already leaves out the job's), left out in-process: its
# logging.config.dictConfig closes every handler it finds, and absl's (dp-accounting's) closes the stream it was
# made with, which under pytest is pytest's capture file
NO_HYDRA_LOGGING = ["hydra/hydra_logging=none"]


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def float64():
    """torch's default dtype float64 for the test (the oracles and dpmem then agree to ~1e-12), put back after."""
    import torch
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture
def cli(tmp_path, monkeypatch, capsys):
    """`dpmem ARGS...` in this process, in tmp_path: dpmem.cli.main's exit code (SystemExit's, 0 without one) and
    what it printed. The code of the console entry point without a fresh interpreter's imports per call
    (tests/test_cli.py runs the entry point itself as a subprocess where a process is what is tested)."""
    import dpmem.cli
    from dpmem.engine import job

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(job, "failed", [])  # the runs that did not finish ok, per invocation

    def run(*args) -> CliResult:
        args = [*args, *NO_HYDRA_LOGGING] if args and args[0] == "train" else list(args)
        monkeypatch.setattr(sys, "argv", ["dpmem", *args])  # main rewrites it for Hydra
        job.failed.clear()
        capsys.readouterr()
        code = 0
        try:
            dpmem.cli.main(args)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        out, err = capsys.readouterr()
        return CliResult(code, out, err)

    return run
