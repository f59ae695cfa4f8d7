"""Every Python block of the README and of docs/ runs as written (see
tests/doc_blocks.py for how a page sets up its blocks or marks a fragment).

Pages whose code needs more than one CPU device and the `test` extra are run by the
tests named in `RUN_ELSEWHERE`; every other page runs here, so a new page's code is
run without being listed."""

import ast
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_amp

from .doc_blocks import REPO_ROOT, blocks, run, run_page


# A page whose whole code another test runs, as its setting needs: 8 devices, orbax.
RUN_ELSEWHERE = {
    "docs/guides/loss-scaling.md": "tests/test_grad.py::test_docs_snippets_run",
    "docs/guides/checkpoints.md": "tests/test_orbax.py::test_the_checkpoints_guide_runs",
}
# The extras a page's code may need, by the module that is missing without them.
EXTRAS = {"flax": "flax", "orbax": "orbax", "sklearn": "examples"}


def pages() -> list[str]:
    docs = sorted(
        p.relative_to(REPO_ROOT).as_posix()
        for p in (REPO_ROOT / "docs").rglob("*.md")
        if "_hooks" not in p.parts
    )
    return ["README.md", *docs]


def _page_blocks(page: str):
    return blocks((REPO_ROOT / page).read_text())


# Slow tier, with the docs build: the pages' code runs as written (eagerly,
# op by op: a tenth of the fast tier's time).
@pytest.mark.slow
@pytest.mark.parametrize(
    "page", [p for p in pages() if p not in RUN_ELSEWHERE and p != "README.md"]
)
def test_page_runs(page):
    try:
        run_page(page)
    except ModuleNotFoundError as e:
        if e.name not in EXTRAS:
            raise
        extra = EXTRAS[e.name]
        pytest.skip(f'{page} needs the {extra} extra: pip install -e ".[{extra}]"')


def test_pages_run_elsewhere_are_run_there():
    for page, test in RUN_ELSEWHERE.items():
        path, name = test.split("::")
        source = (REPO_ROOT / path).read_text()
        assert page.rsplit("/", 1)[-1] in source, f"{test} does not read {page}"
        names = {
            node.name
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef)
        }
        assert name in names, f"{test}, which runs {page}, does not exist"


def test_fragments_say_why_and_are_few():
    """`<!-- no-run -->` is for a block that is deliberately a fragment; each says why."""
    left_out = []
    for page in pages():
        text = (REPO_ROOT / page).read_text()
        for line in text.splitlines():
            if line.strip().startswith("<!-- no-run"):
                assert line.strip().startswith("<!-- no-run: "), (
                    f"{page}: {line.strip()!r} gives no reason"
                )
        left_out += [(page, b.line) for b in _page_blocks(page) if not b.runs]
    assert len(left_out) <= 6, left_out


def test_every_page_with_code_has_code_that_runs():
    for page in pages():
        code = _page_blocks(page)
        if any(not b.hidden for b in code):
            assert any(b.runs and not b.hidden for b in code), page


#
# The README: three snippets, each a whole program (PyPI shows the README alone).
#


def _readme() -> list:
    code = _page_blocks("README.md")
    assert not any(b.hidden for b in code), "the README's snippets set themselves up"
    assert len(code) == 3 and all(b.runs for b in code), [b.line for b in code]
    return code


def test_readme_bfloat16_snippet():
    ns = run(_readme()[:1], "README.md")
    assert "filter_amp" in _readme()[0].source
    assert ns["loss"].dtype == jnp.float32
    assert {g.dtype for g in jax.tree.leaves(ns["grads"])} == {jnp.dtype(jnp.float32)}


def test_readme_float16_snippet_trains_with_the_short_form():
    source = _readme()[1].source
    assert "@eqx_amp.scaled_value_and_grad\n" in source
    assert "eqx_amp.loss_scaling(optax.adam(" in source
    assert "(loss, grads), opt_state = loss_fn(model, x, y, opt_state=opt_state)" in (
        source
    )
    ns = run(_readme()[1:2], "README.md")
    assert isinstance(ns["opt_state"], eqx_amp.optim.LossScalingState)
    assert np.isfinite(float(ns["loss"])) and float(ns["loss"]) < 0.5
    weights = jax.tree.leaves(eqx.filter(ns["model"], eqx.is_inexact_array))
    assert {w.dtype for w in weights} == {jnp.dtype(jnp.float32)}


def test_readme_fp8_snippet():
    source = _readme()[2].source
    assert "fp8=eqx_amp.fp8.TENSORWISE" in source
    ns = run(_readme()[2:], "README.md")
    assert ns["logits"].dtype == jnp.float32
    report = eqx_amp.precision_report(ns["forward"], ns["x"])
    assert ("float8_e4m3fn", "float8_e4m3fn") in report.flops_by_dtypes
    assert len(report.fp8_skipped) == 1  # the 10-class head


def test_readme_keeps_the_set_up_commands_and_links_pages_that_exist():
    text = (REPO_ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 260
    for target in set(
        part.split(")")[0].split("#")[0]
        for part in text.split("](")[1:]
        if not part.startswith(("http", "#"))
    ):
        assert pathlib.Path(REPO_ROOT / target).exists(), target
