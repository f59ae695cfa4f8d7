"""The package type-checks cleanly under pyright, configured by `[tool.pyright]` in
pyproject.toml: a wrong annotation or a call that does not match its signature fails
the suite, not a user's type checker."""

import json
import os
import pathlib
import subprocess
import sys

import pytest


ROOT = pathlib.Path(__file__).resolve().parent.parent


def _describe(diagnostic: dict) -> str:
    start = diagnostic.get("range", {}).get("start", {})
    line, column = start.get("line", -1) + 1, start.get("character", -1) + 1
    where = f"{diagnostic.get('file', '?')}:{line}:{column}"
    rule = f" ({diagnostic['rule']})" if "rule" in diagnostic else ""
    return f"{where}: {diagnostic['severity']}: {diagnostic['message']}{rule}"


@pytest.mark.slow  # a lint of the whole package: 8 s, no runtime behaviour
def test_pyright_reports_nothing():
    # The interpreter running the tests is the environment to check against, where
    # the project has no `.venv` (the configuration's `venv` wins where it does).
    command = [sys.executable, "-m", "pyright", "--pythonpath", sys.executable]
    command += ["--outputjson", "--project", str(ROOT)]
    # No look-up of the newest pyright release: the bundled one runs, offline.
    env = dict(os.environ, PYRIGHT_PYTHON_IGNORE_WARNINGS="1")
    result = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:
        pytest.fail(
            f"pyright did not run (exit code {result.returncode}):\n"
            f"{result.stdout}{result.stderr}",
            pytrace=False,
        )
    # A configuration that matched no file would check nothing, and pass.
    assert report["summary"]["filesAnalyzed"] > 0, result.stdout
    # Warnings count too: a clean check is one with nothing to read.
    reported = [
        d for d in report["generalDiagnostics"] if d["severity"] in ("error", "warning")
    ]
    if result.returncode != 0 or reported:
        pytest.fail(
            f"pyright (exit code {result.returncode}) reports:\n"
            + "\n".join(_describe(d) for d in reported),
            pytrace=False,
        )
