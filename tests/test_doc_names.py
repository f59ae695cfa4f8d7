"""No document names what the 1.0 API removed: the old names of CHANGELOG.md's
"1.0 API: old -> new" table that no longer resolve appear in no doc but the
CHANGELOG, and the new names it gives exist.

```python
removed = removed_names()  # {"eqx_amp.master_weights", "bimodel.grad", ...}
```
"""

import json
import pathlib
import re

import pytest

import eqx_amp


REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
CHANGELOG = REPO_ROOT / "CHANGELOG.md"
TABLE_HEADING = "### 1.0 API: old -> new"
# An instance of `BiModel` is written `bimodel` in the table and the guides.
ROOTS = {"eqx_amp": eqx_amp, "BiModel": eqx_amp.BiModel, "bimodel": eqx_amp.BiModel}
_DOTTED = re.compile(r"(?<![\w.])(?:eqx_amp|BiModel|bimodel)(?:\.[A-Za-z_]\w*)+")
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


def table_rows() -> list[tuple[str, str]]:
    """`(old, new)` cells of the table, header and rule left out."""
    lines = CHANGELOG.read_text().splitlines()
    start = lines.index(TABLE_HEADING) + 1
    rows = []
    for line in lines[start:]:
        if line.startswith("#"):
            break
        if not line.startswith("|"):
            continue
        # `\|` is a `|` inside a cell (one of `BiModel`'s old keyword values).
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if cells[0] in ("old", "---"):
            continue
        rows.append((cells[0], cells[1]))
    return rows


def cell_names(cell: str, bare_too: bool) -> list[str]:
    """The dotted names in a cell's backticked spans (`eqx_amp.X(...)` gives
    `eqx_amp.X`); with `bare_too`, a span that is one identifier is taken in the
    namespace of the dotted name before it (`eqx_amp.master_weights`,
    `kahan_summation` gives `eqx_amp.kahan_summation`). A bare name with no dotted
    one before it (`(none: no scaled `filter_grad` ...)`) names nothing."""
    names, namespace = [], None
    for span in re.findall(r"`([^`]+)`", cell):
        if dotted := _DOTTED.findall(span):
            names += dotted
            namespace = dotted[-1].rsplit(".", 1)[0]
        elif bare_too and namespace and _IDENTIFIER.fullmatch(span):
            names.append(f"{namespace}.{span}")
    return names


def resolves(name: str) -> bool:
    root, *attributes = name.split(".")
    value = ROOTS[root]
    for attribute in attributes:
        if not hasattr(value, attribute):
            return False
        value = getattr(value, attribute)
    return True


def removed_names() -> set[str]:
    return {
        name
        for old, _ in table_rows()
        for name in cell_names(old, bare_too=True)
        if not resolves(name)
    }


def mention(name: str) -> re.Pattern:
    """How a doc names `name`: in full (`eqx_amp.X`, not `eqx_amp.optim.X`), an
    import of it (`from eqx_amp import X`), or for a `BiModel` method either
    spelling (`BiModel.grad`, `bimodel.grad`)."""
    root, rest = name.split(".", 1)
    if root == "eqx_amp":
        last = re.escape(rest)
        return re.compile(
            rf"(?<![\w.])eqx_amp\.{last}(?!\w)|from eqx_amp import [^\n]*\b{last}\b"
        )
    return re.compile(rf"(?<![\w.])(?:BiModel|bimodel)\.{re.escape(rest)}(?!\w)")


def documents() -> list[pathlib.Path]:
    """Every doc but the CHANGELOG: Markdown pages, the examples, the notebook, and
    the package's docstrings (which the API reference renders)."""
    paths = [
        *REPO_ROOT.glob("*.md"),
        *(REPO_ROOT / "docs").rglob("*.md"),
        *(REPO_ROOT / "benchmarks").rglob("*.md"),
        *(REPO_ROOT / "examples").rglob("*.md"),
        *(REPO_ROOT / "examples").glob("*.py"),
        *(REPO_ROOT / "notebooks").glob("*.ipynb"),
        *(REPO_ROOT / "eqx_amp").rglob("*.py"),
    ]
    return sorted(p for p in paths if p != CHANGELOG)


def document_lines(path: pathlib.Path) -> list[tuple[str, str]]:
    """`(where, line)` for every line of a doc; a notebook's by cell."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return [
            (f"cell {i}", line)
            for i, cell in enumerate(cells)
            for line in "".join(cell["source"]).splitlines()
        ]
    return [
        (f"line {i}", line) for i, line in enumerate(path.read_text().splitlines(), 1)
    ]


def stale_mentions(paths: list[pathlib.Path]) -> list[str]:
    patterns = {name: mention(name) for name in sorted(removed_names())}
    return [
        f"{path.relative_to(REPO_ROOT)}, {where}: {name}"
        for path in paths
        for where, line in document_lines(path)
        for name, pattern in patterns.items()
        if pattern.search(line)
    ]


def test_the_table_yields_the_removed_names():
    # A table whose layout changed must not leave the check below with nothing to
    # look for.
    removed = removed_names()
    for name in (
        "eqx_amp.FP8",
        "eqx_amp.fp8_dot_general",
        "eqx_amp.master_weights",
        "eqx_amp.kahan_summation",
        "eqx_amp.QuantizedMoment",
        "eqx_amp.gather_params",
        "eqx_amp.NonfiniteOp",
        "eqx_amp.MasterWeights",
        "bimodel.value_and_grad",
        "bimodel.grad",
    ):
        assert name in removed
    # Renamed in their signatures, not removed: still there.
    assert "eqx_amp.scaled_value_and_grad" not in removed
    assert not any(name.endswith(".filter_grad") for name in removed)


@pytest.mark.parametrize(
    "text, name",
    [
        ("`BiModel.value_and_grad` take `axis_name`", "bimodel.value_and_grad"),
        ("grads = bimodel.grad(loss)(x)", "bimodel.grad"),
        ("opt = eqx_amp.master_weights(optax.adam(1e-3))", "eqx_amp.master_weights"),
        ("from eqx_amp import FP8, cast_tree", "eqx_amp.FP8"),
    ],
)
def test_mentions_are_found(text, name):
    assert mention(name).search(text)


@pytest.mark.parametrize(
    "text, name",
    [
        ("`eqx_amp.optim.master_weights`", "eqx_amp.master_weights"),
        ("`eqx_amp.fp8.TENSORWISE`", "eqx_amp.FP8"),
        ("`eqx_amp.sharding.gather_params`", "eqx_amp.gather_params"),
        ("bimodel.grad_target", "bimodel.grad"),
        ("jax.value_and_grad(loss)", "bimodel.value_and_grad"),
    ],
)
def test_new_names_are_not_mentions(text, name):
    assert not mention(name).search(text)


def test_no_doc_names_a_removed_name():
    stale = stale_mentions(documents())
    assert not stale, (
        "These docs name what the 1.0 API removed (see CHANGELOG.md's old -> new "
        "table):\n" + "\n".join(stale)
    )


def test_the_new_names_exist():
    missing = [
        name
        for _, new in table_rows()
        for name in cell_names(new, bare_too=False)
        if not resolves(name)
    ]
    assert not missing
