"""`python -m build` makes an sdist and a wheel with the right metadata, and the
installed wheel (not the checkout) runs the quickstart."""

import email
import os
import pathlib
import subprocess
import sys
import tarfile
import tomllib
import zipfile

import pytest


# The slow tier: builds the sdist and wheel and installs it.
pytestmark = pytest.mark.slow


REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("dist")
    # No isolation: the `test` extra installs the build backend, so no package index
    # is needed here.
    result = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", out, REPO_ROOT],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def _project() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]


def test_wheel_metadata(dist):
    (wheel,) = dist.glob("eqx_amp-*-py3-none-any.whl")
    project = _project()
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.message_from_string(archive.read(info).decode())
    assert "eqx_amp/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not [n for n in names if n.startswith(("tests/", "examples/"))]
    assert metadata["Name"] == "eqx_amp"
    assert metadata["Version"] == project["version"]
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["Requires-Python"] == ">=3.11"
    requires = metadata.get_all("Requires-Dist")
    for pin in ("jax>=0.10.0", "jaxlib>=0.10.0", "equinox>=0.13.0"):
        assert pin in requires
    classifiers = metadata.get_all("Classifier")
    # Every Python the package supports, and no other.
    versions = {c.rsplit(" ", 1)[-1] for c in classifiers if ":: 3." in c}
    assert versions == {"3.11", "3.12", "3.13"}
    assert "Typing :: Typed" in classifiers
    assert set(metadata.get_all("Provides-Extra")) == set(
        project["optional-dependencies"]
    )


def test_sdist_holds_what_the_readme_commands_need(dist):
    (sdist,) = dist.glob("eqx_amp-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
    for needed in (
        "pyproject.toml",
        "README.md",
        "LICENSE",
        "CHANGELOG.md",
        "mkdocs.yml",
        "eqx_amp/__init__.py",
        "eqx_amp/py.typed",
        "examples/quickstart.py",
        "examples/data/alice29.txt",
        "tests/conftest.py",
        "notebooks/mixed_precision_tour.ipynb",
    ):
        assert needed in names, needed
    assert not [n for n in names if "__pycache__" in n or n.startswith(".venv")]


def test_installed_wheel_runs_the_quickstart(dist, tmp_path):
    (wheel,) = dist.glob("eqx_amp-*-py3-none-any.whl")
    site = tmp_path / "site"
    # The dependencies are this environment's; the package is the wheel's.
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
         "--target", site, wheel],
        check=True,
        timeout=300,
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}
    where = subprocess.run(
        [sys.executable, "-c", "import eqx_amp; print(eqx_amp.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert pathlib.Path(where.stdout.strip()).is_relative_to(site)
    result = subprocess.run(
        [sys.executable, REPO_ROOT / "examples" / "quickstart.py", "--epochs", "1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "accuracy" in result.stdout
