"""A jax newer than the tested range: `import eqx_amp` warns once and works, the
call-boundary path needs no JAX internals, and the jaxpr layer turns an internal it
does not know (a moved private module, a renamed primitive parameter) into one
`UnsupportedJaxError` naming the jax version and the tested range."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import eqx_amp
from eqx_amp._jaxpr import _compat as compat
from eqx_amp._jaxpr._evaluate import evaluate
from eqx_amp._jaxpr._hook import Hook


TESTED = r"0\.10\.x to 0\.12\.x"


@pytest.mark.parametrize("version", ["0.10.0", "0.12.9", "0.12.0.1", "0.10.2.dev1"])
def test_tested_versions_do_not_warn(version, recwarn):
    assert not compat.warn_if_untested(version)
    assert not recwarn.list


@pytest.mark.parametrize("version", ["0.13.0", "0.13.0rc1", "1.0.0", "0.99.1.dev2"])
def test_newer_versions_warn_with_the_tested_range(version):
    with pytest.warns(UserWarning, match=rf"tested with jax {TESTED}; this is jax"):
        assert compat.warn_if_untested(version)


def test_an_unparseable_version_does_not_warn(recwarn):
    assert not compat.warn_if_untested("nightly")
    assert not recwarn.list


def _scan_program():
    def f(x):
        return lax.scan(lambda c, y: (c + y, c * y), x[0], x)

    return jax.make_jaxpr(f)(jnp.arange(3.0))


def test_an_unknown_primitive_parameter_is_one_clear_error():
    """A scan equation whose counts are stored under names this eqx_amp does not
    know, as a future jax might store them."""
    closed = _scan_program()
    jaxpr = closed.jaxpr
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    renamed = {
        ("consts_and_carry" if k in ("num_consts", "ft_in") else k): v
        for k, v in scan.params.items()
        if k != "num_carry"
    }
    eqns = [e.replace(params=renamed) if e is scan else e for e in jaxpr.eqns]
    future = closed.replace(jaxpr=jaxpr.replace(eqns=eqns))
    with pytest.raises(compat.UnsupportedJaxError) as info:
        evaluate(future, [jnp.arange(3.0)], Hook())
    message = str(info.value)
    assert f"jax {jax.__version__}" in message
    assert "0.10.x to 0.12.x" in message
    assert "`scan` equation" in message and "consts_and_carry" in message
    assert "KeyError" in message


def test_user_errors_inside_the_program_are_not_reported_as_jax_internals():
    @jax.custom_jvp
    def f(x):
        return x

    @f.defjvp
    def f_jvp(primals, tangents):
        raise KeyError("the user's own bug")

    with pytest.raises(KeyError, match="the user's own bug"):
        jax.grad(eqx_amp.autocast(lambda x: f(x) @ x))(jnp.ones((2, 2)))


def test_known_internals_are_all_present_on_the_tested_jax():
    assert compat.MISSING_INTERNALS == []
    compat.require_known_internals()


_NEWER_JAX = textwrap.dedent(
    """
    import sys, warnings
    import jax
    jax.__version__ = "0.99.0"  # a jax newer than the tested range ...
    sys.modules["jax._src.shard_map"] = None  # ... that moved a private module
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import equinox as eqx, jax.numpy as jnp, jax.random as jr, optax
        import eqx_amp
    report = {"warnings": [str(w.message) for w in caught
                           if "eqx_amp is tested" in str(w.message)]}

    model = eqx.nn.MLP(3, 2, 8, 2, key=jr.key(0))
    x = jnp.ones((3,))
    report["filter_amp"] = str(eqx_amp.filter_amp(model)(x).dtype)
    bimodel = eqx_amp.BiModel(model)
    report["bimodel"] = str(bimodel(x).dtype)

    def loss(m, x):
        return jnp.sum(eqx_amp.filter_amp(m, policy="mixed_float16")(x) ** 2)

    grad = eqx_amp.filter_value_and_grad(loss)
    (value, grads), scale, finite = grad(
        model, x, loss_scale=eqx_amp.DynamicLossScale(jnp.float32(2.0**10)))
    report["loss_scaling"] = bool(finite)
    optimizer = eqx_amp.optim.master_weights(optax.adam(1e-3))
    half = eqx_amp.get_policy("bf16").cast_to_compute(
        eqx.filter(model, eqx.is_inexact_array))
    state = optimizer.init(half)
    report["master_weights"] = type(state).__name__
    try:
        eqx_amp.autocast(model)(x)
    except RuntimeError as error:
        report["autocast"] = f"{type(error).__name__}: {error}"
    """
)


@pytest.fixture(scope="module")
def newer_jax():
    program = _NEWER_JAX + "\nimport json\nprint(json.dumps(report))\n"
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    import json

    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_import_on_a_newer_jax_warns_once(newer_jax):
    (warning,) = newer_jax["warnings"]
    assert "tested with jax 0.10.x to 0.12.x; this is jax 0.99.0" in warning


@pytest.mark.slow
def test_the_call_boundary_path_needs_no_jax_internals(newer_jax):
    assert newer_jax["filter_amp"] == "float32"
    assert newer_jax["bimodel"] == "float32"
    assert newer_jax["loss_scaling"] is True
    assert newer_jax["master_weights"] == "MasterWeightsState"


@pytest.mark.slow
def test_the_jaxpr_layer_names_the_missing_internal(newer_jax):
    error = newer_jax["autocast"]
    assert error.startswith("UnsupportedJaxError: ")
    assert "jax 0.99.0" in error and "0.10.x to 0.12.x" in error
    assert "jax._src.shard_map" in error
