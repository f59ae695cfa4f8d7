"""The package, its tests and examples are clean under ruff (lint and format), as
configured in pyproject.toml: the README's test command enforces it."""

import pathlib
import subprocess
import sys

import pytest


REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
CHECKED = ("eqx_amp", "tests", "examples")


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff(command):
    pytest.importorskip("ruff")
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *command, *CHECKED],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
