"""What a type checker sees in user code: pyright, in standard mode (its default,
which Equinox runs), on a short user script that reveals the type of every result
eqx_amp hands back. None may be `Unknown` (a user's checker would then check nothing
downstream), the forward results are the model's own `Array`, and an attribute of
the wrapped model on a `filter_amp` wrapper is an error (it raises `AttributeError`
at run time). The script also runs, so that it is real code."""

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest


# `reveal_type` is `typing`'s (Python 3.11): it prints at run time, and pyright
# reports the type it infers. The `if TYPE_CHECKING:` block is checked, never run.
_USER_SCRIPT = textwrap.dedent(
    """
    from typing import TYPE_CHECKING, reveal_type

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import eqx_amp


    class Net(eqx.Module):
        mlp: eqx.nn.MLP

        @eqx_amp.filter_amp(policy="mixed_bfloat16")
        def __call__(self, x: jax.Array) -> jax.Array:
            return self.mlp(x)


    def loss(model: eqx.nn.MLP, x: jax.Array) -> jax.Array:
        return jnp.sum(model(x) ** 2)


    model = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0))
    x = jnp.ones(4)
    xs = jnp.ones((3, 4))

    # The forward roads.
    amp_model = eqx_amp.filter_amp(model)
    reveal_type(amp_model(x))
    reveal_type(eqx_amp.filter_amp(policy="mixed_float16")(model)(x))
    reveal_type(eqx_amp.filter_amp(loss)(model, x))
    reveal_type(jax.vmap(amp_model)(xs))
    reveal_type(eqx.filter_jit(amp_model)(x))
    reveal_type(Net(model)(x))
    reveal_type(eqx_amp.autocast(model)(x))
    reveal_type(eqx_amp.autocast(loss)(model, x))
    reveal_type(eqx_amp.full_precision(model)(x))
    bimodel = eqx_amp.BiModel(model)
    reveal_type(bimodel(x))
    reveal_type(bimodel.with_compute(bimodel.compute)(x))

    # The gradient roads and the optimizer wrappers.
    optimizer = eqx_amp.optim.master_weights(eqx_amp.loss_scaling(optax.adam(1e-3)))
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    scaled_loss = eqx_amp.scaled_value_and_grad(loss)
    reveal_type(scaled_loss(model, x, opt_state=opt_state))
    reveal_type(eqx_amp.scaled_grad(loss)(model, x, opt_state=opt_state))
    loss_scale = eqx_amp.DynamicLossScale()
    reveal_type(eqx_amp.filter_value_and_grad(loss)(model, x, loss_scale=loss_scale))
    reveal_type(optimizer.update)

    # Diagnostics.
    reveal_type(eqx_amp.precision_report(amp_model, x).advice)

    if TYPE_CHECKING:
        amp_model.layers  # the wrapper has no attribute of the model: an error
    """
)

# The forward results whose exact type is known: the model's own.
_EXPECTED = {
    "amp_model(x)": "Array",
    'eqx_amp.filter_amp(policy="mixed_float16")(model)(x)': "Array",
    "eqx_amp.filter_amp(loss)(model, x)": "Array",
    "jax.vmap(amp_model)(xs)": "Array",
    "eqx.filter_jit(amp_model)(x)": "Array",
    "Net(model)(x)": "Array",
    "eqx_amp.autocast(model)(x)": "Array",
    "eqx_amp.autocast(loss)(model, x)": "Array",
    "eqx_amp.full_precision(model)(x)": "Array",
    "bimodel(x)": "Array",
    "bimodel.with_compute(bimodel.compute)(x)": "Array",
    "eqx_amp.precision_report(amp_model, x).advice": "str",
    # An optax transformation (`master_weights` returns updates, as optax's do).
    "optimizer.update": "TransformUpdateExtraArgsFn",
}
# The gradient roads: the nesting of their one return shape, whatever the options.
_EXPECTED_PREFIX = {
    "scaled_loss(model, x, opt_state=opt_state)": "tuple[tuple[Any, Any], ",
    "eqx_amp.scaled_grad(loss)(model, x, opt_state=opt_state)": "tuple[Any, ",
    "eqx_amp.filter_value_and_grad(loss)(model, x, loss_scale=loss_scale)": (
        "tuple[tuple[Array, Any], AbstractLossScale, Array]"
    ),
}


@pytest.fixture(scope="module")
def user_script(tmp_path_factory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("user")
    # A user's own project: standard mode, the oldest Python supported.
    config = {"typeCheckingMode": "standard", "pythonVersion": "3.11"}
    (folder / "pyrightconfig.json").write_text(json.dumps(config))
    script = folder / "user.py"
    script.write_text(_USER_SCRIPT)
    return script


def _pyright(script: pathlib.Path) -> list[dict]:
    command = [sys.executable, "-m", "pyright", "--pythonpath", sys.executable]
    command += ["--outputjson", "--project", str(script.parent), str(script)]
    # No look-up of the newest pyright release: the bundled one runs, offline.
    env = dict(os.environ, PYRIGHT_PYTHON_IGNORE_WARNINGS="1")
    result = subprocess.run(
        command, cwd=script.parent, env=env, capture_output=True, text=True, timeout=300
    )
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:
        pytest.fail(
            f"pyright did not run (exit code {result.returncode}):\n"
            f"{result.stdout}{result.stderr}",
            pytrace=False,
        )
    assert report["summary"]["filesAnalyzed"] == 1, result.stdout
    return report["generalDiagnostics"]


def _line(diagnostic: dict) -> int:
    return diagnostic["range"]["start"]["line"] + 1


@pytest.mark.slow
def test_pyright_infers_every_result_and_flags_model_attributes(user_script):
    diagnostics = _pyright(user_script)
    reveals = [
        match.groups()
        for d in diagnostics
        if d["severity"] == "information"
        and (match := re.fullmatch(r'Type of "(.*)" is "(.*)"', d["message"], re.S))
    ]
    # Every `reveal_type` in the script reported, none `Unknown`.
    assert len(reveals) == _USER_SCRIPT.count("reveal_type("), reveals
    unknown = [(expr, t) for expr, t in reveals if "Unknown" in t]
    assert not unknown, unknown
    revealed = dict(reveals)
    for expression, expected in _EXPECTED.items():
        assert revealed[expression] == expected, (expression, revealed[expression])
    for expression, prefix in _EXPECTED_PREFIX.items():
        assert revealed[expression].startswith(prefix), (expression, revealed)
    # The one problem: the model's attribute read from its wrapper.
    problems = [d for d in diagnostics if d["severity"] in ("error", "warning")]
    lines = _USER_SCRIPT.splitlines()
    assert [lines[_line(d) - 1].strip() for d in problems] == [
        "amp_model.layers  # the wrapper has no attribute of the model: an error"
    ], problems
    (problem,) = problems
    assert problem.get("rule") == "reportAttributeAccessIssue"
    assert (
        'Cannot access attribute "layers" for class "AmpWrapper['
        in (problem["message"])
    )


@pytest.mark.slow
def test_the_user_script_runs(user_script):
    result = subprocess.run(
        [sys.executable, str(user_script)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    # `typing.reveal_type` prints each runtime type: every line of it ran.
    runtime = re.findall(r"Runtime type is '(\w+)'", result.stderr)
    assert len(runtime) == _USER_SCRIPT.count("reveal_type("), result.stderr
    assert runtime[0] == "ArrayImpl" and runtime[-1] == "str"
