"""scripts/warm_start.py: a command forked from this process behaves as one started fresh: its arguments, working
directory, environment, exit status and two streams are its own, a timeout can stop it and its group, and its end
runs no exit handler of the parent's (which would delete the parent's temporary folders)."""

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import warm_start  # noqa: E402

pytestmark = pytest.mark.skipif(not warm_start.available(), reason="no fork on this system")

SCRIPT = """
import atexit, os, sys
from pathlib import Path
atexit.register(lambda: print("its own exit handler ran"))
print("argv", sys.argv[1:], "cwd", Path.cwd().name, "var", os.environ.get("WARM_VAR"), "path0", Path(sys.path[0]).name)
print("to stderr", file=sys.stderr)
if sys.argv[1] == "sleep":
    import time
    time.sleep(60)
sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else sys.argv[1])
"""


def script(tmp_path):
    (tmp_path / "here").mkdir()
    path = tmp_path / "prog" / "prog.py"
    path.parent.mkdir()
    path.write_text(SCRIPT)
    return path


def test_a_forked_command_has_its_own_arguments_folder_environment_status_and_streams(tmp_path):
    prog = script(tmp_path)
    kept = tempfile.TemporaryDirectory(dir=tmp_path)  # deleted at this process's exit, not at the child's
    env = {**os.environ, "WARM_VAR": "set"}
    child = warm_start.Forked([sys.executable, str(prog), "3", "x"], tmp_path / "here", env, merged=False)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 3
    assert out.splitlines() == ["argv ['3', 'x'] cwd here var set path0 prog", "its own exit handler ran"]
    assert err == "to stderr\n"
    assert "WARM_VAR" not in os.environ and Path.cwd() != tmp_path / "here" and Path(kept.name).is_dir()
    # a message given to sys.exit is printed and is status 1, as an interpreter does; merged streams
    child = warm_start.Forked([sys.executable, str(prog), "stop"], tmp_path, env)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 1 and err is None and "to stderr" in out
    assert out.splitlines()[-2:] == ["stop", "its own exit handler ran"]  # the message, then the exit handlers
    kept.cleanup()


def test_a_forked_command_past_its_timeout_is_stopped_with_its_group(tmp_path):
    prog = script(tmp_path)
    child = warm_start.Forked([sys.executable, str(prog), "sleep"], tmp_path, dict(os.environ))
    with pytest.raises(subprocess.TimeoutExpired):
        child.communicate(timeout=1)
    assert os.getpgid(child.pid) == child.pid  # a session of its own: the group is the child's alone
    os.killpg(child.pid, signal.SIGKILL)
    out, _ = child.communicate()
    assert child.returncode == -signal.SIGKILL and out.startswith("argv ['sleep']")


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "fresh"])
def test_start_gives_a_fork_or_a_fresh_interpreter_the_same_streams_status_and_session(tmp_path, fork):
    prog = script(tmp_path)
    child = warm_start.start([sys.executable, str(prog), "2"], tmp_path, dict(os.environ), merged=False,
                             new_session=False, fork=fork)
    assert isinstance(child, warm_start.Forked) == fork
    assert os.getpgid(child.pid) == os.getpgid(0)  # in this session: a Ctrl-C at the terminal reaches it too
    out, err = child.communicate(timeout=60)
    assert child.returncode == 2 and out.startswith("argv ['2']") and err == "to stderr\n"


def test_a_module_runs_as_under_python_m_from_the_working_folder(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "__main__.py").write_text("import sys\nprint(__name__, sys.argv[1:], sys.argv[0].endswith("
                                                  "'__main__.py'))\nraise SystemExit(None)\n")
    child = warm_start.Forked([sys.executable, "-m", "pkg", "a"], tmp_path, dict(os.environ))
    out, _ = child.communicate(timeout=60)
    assert (child.returncode, out) == (0, "__main__ ['a'] True\n")
