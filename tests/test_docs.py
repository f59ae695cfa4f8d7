"""The documentation site builds with `mkdocs build --strict`, documents every public
name of `eqx_amp` in its API reference, and shows the tour notebook with its stored
outputs. The site needs the `docs` extra (`pip install -e ".[docs]"`), which the
README's test command installs."""

import importlib
import inspect
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

import eqx_amp


# The slow tier: builds the documentation site.
pytestmark = pytest.mark.slow


REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK = REPO_ROOT / "notebooks" / "mixed_precision_tour.ipynb"
NOTEBOOK_PAGE = pathlib.Path("notebooks", "mixed_precision_tour", "index.html")
PNG = "data:image/png;base64,"
# What `mkdocs build` needs: the `docs` extra of pyproject.toml.
DOCS_EXTRA = (
    "mkdocs",
    "material",
    "mkdocstrings",
    "mkdocstrings_handlers.python",
    "mkdocs_jupyter",
)


def public_names() -> list[str]:
    """Every name `eqx_amp` exports, with those of its sub-namespaces as
    `namespace.name`; not private, not a module (`importlib`)."""
    names = []
    for name, value in vars(eqx_amp).items():
        if name.startswith("_"):
            continue
        if inspect.ismodule(value) and value.__name__.startswith("eqx_amp."):
            names += [
                f"{name}.{inner}"
                for inner, v in vars(value).items()
                if not inner.startswith("_") and not inspect.ismodule(v)
            ]
        elif not inspect.ismodule(value):
            names.append(name)
    return sorted(names)


def aliases(name: str) -> list[str]:
    """The other public names of the object `name` names: a sub-namespace re-exports
    some everyday names (`eqx_amp.diagnostics.precision_report` is
    `eqx_amp.precision_report`), and one entry documents the object."""
    value = _resolve(name)
    return [
        other for other in public_names() if other != name and _resolve(other) is value
    ]


def _resolve(name: str):
    value = eqx_amp
    for part in name.split("."):
        value = getattr(value, part)
    return value


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    for module in DOCS_EXTRA:
        try:
            importlib.import_module(module)
        except ImportError as e:
            pytest.skip(f'{e}: the site needs the docs extra, pip install -e ".[docs]"')
    site_dir = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", site_dir],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert result.returncode == 0, (
        "`mkdocs build --strict` failed:\n"
        + result.stdout[-4000:]
        + result.stderr[-8000:]
    )
    return site_dir


def test_public_names_are_documented(site):
    anchors = {}
    for page in sorted((site / "api").rglob("*.html")):
        for name in re.findall(
            r'id="eqx_amp\.([A-Za-z_][A-Za-z0-9_.]*)"', page.read_text()
        ):
            anchors.setdefault(name, page.relative_to(site).as_posix())
    missing = [
        name
        for name in public_names()
        if name not in anchors and not any(alias in anchors for alias in aliases(name))
    ]
    assert not missing, (
        f"public names of eqx_amp with no entry in the API reference: {missing}. Add "
        "`::: eqx_amp.NAME` to the page of docs/api/ where it belongs (names with no "
        "other home go in docs/api/training_state.md)."
    )


def test_notebook_page_has_its_outputs(site):
    page = site / NOTEBOOK_PAGE
    assert page.is_file(), f"{NOTEBOOK_PAGE} was not built"
    html = page.read_text()
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    images = sum(
        "image/png" in output.get("data", {})
        for cell in cells
        for output in cell.get("outputs", [])
    )
    assert images > 0, "the notebook has no stored figures: was it saved unexecuted?"
    assert html.count(PNG) >= images, (
        f"{NOTEBOOK_PAGE} shows {html.count(PNG)} of the notebook's {images} figures"
    )
    # A printed line from the stored outputs reaches the page too.
    streams = [
        line.strip()
        for cell in cells
        for output in cell.get("outputs", [])
        if output.get("output_type") == "stream"
        for line in "".join(output["text"]).splitlines()
        if re.fullmatch(r"[\w .,:%()+-]{20,}", line.strip())
    ]
    assert streams, "the notebook has no stored printed output"
    assert streams[0] in html, f"{streams[0]!r} is missing from {NOTEBOOK_PAGE}"


def test_setup_commands_match_the_readme():
    """Getting started quotes the README's set-up commands; they must not drift."""
    readme = (REPO_ROOT / "README.md").read_text()
    page = (REPO_ROOT / "docs" / "getting-started.md").read_text()
    commands = re.findall(r"^python3 -m venv .*$", page, flags=re.MULTILINE)
    assert len(commands) == 2, commands
    for command in commands:
        assert command in readme.splitlines(), (
            f"docs/getting-started.md gives {command!r}, which README.md does not"
        )
