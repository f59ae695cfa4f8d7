"""The examples run end to end (with tiny settings, so the suite stays fast)."""

import os
import pathlib
import subprocess
import sys

import pytest


REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_quickstart():
    pytest.importorskip("sklearn")
    # The checkout's `eqx_amp` comes first, installed or not.
    pythonpath = [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in pythonpath if p)}
    result = subprocess.run(
        [sys.executable, "examples/quickstart.py", "--epochs", "1", "--batch-size", "64"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "fp32 test accuracy:" in out
    assert "amp test accuracy:" in out
    assert "variant  | test accuracy | final train loss | compiled step memory" in out
    assert "amp/fp32:" in out
