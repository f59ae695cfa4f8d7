"""`tools/check_jax.sh` answers `--help` with its usage and a bad version with one
line, before it creates or installs anything."""

import pathlib
import subprocess

import pytest


REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def _check_jax(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO_ROOT / "tools" / "check_jax.sh"), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("flag", ["--help", "-h", "help"])
def test_help_prints_the_usage(flag):
    result = _check_jax(flag)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: bash tools/check_jax.sh [VERSION|newest]")
    assert not (REPO_ROOT / f".venv-jax-{flag}").exists()


@pytest.mark.parametrize("version", ["--bogus", "latest", "0.12.x", "jax==0.12"])
def test_a_bad_version_is_one_line(version):
    result = _check_jax(version)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"check_jax: '{version}' is not a jax version (expected e.g. 0.12.0, or "
        "newest; --help for usage)"
    ]
    assert not (REPO_ROOT / f".venv-jax-{version}").exists()
