"""A non-editable install (`pip install .`) carries the config groups inside the package and composes them."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_plain_install_composes_every_config_group_from_the_package(tmp_path):
    source = tmp_path / "src"  # a copy, so the build leaves nothing in the working tree
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "outputs", "build", "*.egg-info",
                                                                "__pycache__", "tests"))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(site), str(source)], check=True, capture_output=True)
    shipped = sorted(p.relative_to(site / "dpmem").as_posix() for p in (site / "dpmem" / "conf").rglob("*.yaml"))
    want = sorted(p.relative_to(ROOT / "dpmem").as_posix() for p in (ROOT / "dpmem" / "conf").rglob("*.yaml"))
    assert shipped == want and len(want) > 100
    probe = ("import dpmem.cli as c; from pathlib import Path; "
             "assert Path(c.CONF_DIR).is_relative_to(Path(c.__file__).parent), c.CONF_DIR; "
             "(cfg,) = c.compose_points([['method=dp-sgd-rc', 'privacy=eps2', 'experiment=minilm-rt']]); "
             "print(cfg.method.name, cfg.privacy.epsilon, cfg.model.name)")
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["dp-sgd-rc", "2.0", "minilm"]
    assert str(site) in subprocess.run([sys.executable, "-c", "import dpmem; print(dpmem.__file__)"], cwd=tmp_path,
                                       env=env, capture_output=True, text=True).stdout  # not the editable checkout
