import inspect
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqx_amp

from .doc_blocks import run_page
from .helpers import eqns_named, run_on_eight_devices, traced


F16 = jnp.dtype(jnp.float16)
F32 = jnp.dtype(jnp.float32)
ROOT = pathlib.Path(__file__).parent.parent


@pytest.fixture
def model(getkey):
    return eqx.nn.MLP(4, "scalar", 16, 2, key=getkey())


@pytest.fixture
def batch(getkey):
    x = jr.normal(getkey(), (8, 4))
    y = jr.normal(getkey(), (8,))
    return x, y


def mse(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def amp_mse(model, x, y):
    amp_model = eqx_amp.filter_amp(model, policy="mixed_float16")
    return jnp.mean((jax.vmap(amp_model)(x) - y) ** 2)


def _assert_trees_identical(a, b):
    a_leaves, a_def = jax.tree_util.tree_flatten(a)
    b_leaves, b_def = jax.tree_util.tree_flatten(b)
    assert a_def == b_def
    for x, y in zip(a_leaves, b_leaves):
        assert x.dtype == y.dtype
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def _assert_close(grads, ref, rtol):
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref)):
        assert g.dtype == F32
        error = float(jnp.linalg.norm(g - r) / (jnp.linalg.norm(r) + 1e-12))
        assert error < rtol, f"relative error {error:.3g} for shape {r.shape}"


#
# Values and gradients.
#


@pytest.mark.parametrize(
    "loss_scale",
    [
        eqx_amp.NoOpLossScale(),
        eqx_amp.StaticLossScale(2.0**10),
        eqx_amp.DynamicLossScale(2.0**15),
    ],
    ids=["noop", "static", "dynamic"],
)
def test_float32_matches_equinox_bit_for_bit(model, batch, loss_scale):
    # Power-of-two scales are exact: the unscaled gradients are the true ones.
    (value, grads), new_scale, finite = eqx_amp.filter_value_and_grad(mse)(
        model, *batch, loss_scale=loss_scale
    )
    ref_value, ref_grads = eqx.filter_value_and_grad(mse)(model, *batch)
    assert value.dtype == F32 and value.shape == ()
    assert float(value) == float(ref_value)
    _assert_trees_identical(grads, ref_grads)
    assert finite.dtype == jnp.bool_ and finite.shape == () and bool(finite)
    assert type(new_scale) is type(loss_scale)


def test_growth_step_returns_true_gradients(model, batch):
    # The step at which the scale grows: the gradients are unscaled with the scale
    # that produced them, not with the grown one.
    scale = eqx_amp.DynamicLossScale(2.0**10, counter=2, period=3)
    g = eqx_amp.filter_value_and_grad(mse)
    ref_grads = eqx.filter_grad(mse)(model, *batch)
    (value, grads), new_scale, finite = g(model, *batch, loss_scale=scale)
    assert bool(finite) and float(value) == float(mse(model, *batch))
    assert float(new_scale.loss_scale) == 2.0**11 and int(new_scale.counter) == 0
    _assert_trees_identical(grads, ref_grads)
    # Compiled, XLA may fuse differently from the eager reference (an ulp), but the
    # gradients are not off by the factor.
    (_, jit_grads), jit_scale, _ = eqx.filter_jit(g)(model, *batch, loss_scale=scale)
    assert float(jit_scale.loss_scale) == 2.0**11
    _assert_close(jit_grads, ref_grads, rtol=1e-6)


def test_non_finite_step_backs_off(model, batch):
    x, y = batch
    x = x.at[3, 1].set(jnp.inf)
    scale = eqx_amp.DynamicLossScale(2.0**10, counter=2, period=3)
    (_, grads), new_scale, finite = eqx_amp.filter_value_and_grad(mse)(
        model, x, y, loss_scale=scale
    )
    assert not bool(finite)
    assert not bool(eqx_amp.all_finite(grads))
    assert float(new_scale.loss_scale) == 2.0**9 and int(new_scale.counter) == 0


def test_mixed_float16_gradients_float32_and_close(model, batch):
    (value, grads), _, finite = eqx_amp.filter_value_and_grad(amp_mse)(
        model, *batch, loss_scale=eqx_amp.DynamicLossScale(2.0**12)
    )
    assert bool(finite) and value.dtype == F32
    ref_value, ref_grads = eqx.filter_value_and_grad(mse)(model, *batch)
    assert float(value) == pytest.approx(float(ref_value), rel=1e-2)
    _assert_close(grads, ref_grads, rtol=2e-2)


def test_half_parameter_gradients_unscaled_in_float32():
    # A 1e-8 gradient of a float16 parameter: float16 cannot hold it, so unscaled
    # gradients in float16 would be 0. Scaled, then unscaled in float32, it survives.
    w = jnp.ones(3, F16)

    def loss(w):
        return jnp.sum(w.astype(F32)) * 1e-8

    assert eqx.filter_grad(loss)(w).tolist() == [0.0, 0.0, 0.0]
    grads, _, finite = eqx_amp.filter_grad(loss)(
        w, loss_scale=eqx_amp.DynamicLossScale(2.0**15)
    )
    assert bool(finite)
    assert grads.dtype == F32
    np.testing.assert_allclose(np.asarray(grads), 1e-8, rtol=1e-3)


def test_half_parameters_whole_model(model, batch):
    half_model = eqx_amp.cast_tree(model, F16)
    x, y = (a.astype(F16) for a in batch)
    (value, grads), _, finite = eqx_amp.filter_value_and_grad(mse)(
        half_model, x, y, loss_scale=eqx_amp.StaticLossScale(2.0**8)
    )
    assert bool(finite) and value.dtype == F32
    for leaf in jax.tree_util.tree_leaves(grads):
        assert leaf.dtype == F32
    _assert_close(grads, eqx.filter_grad(mse)(model, *batch), rtol=3e-2)


def test_float16_loss_is_scaled_in_float32(batch):
    x, _ = batch

    def loss(w, x):  # returns a float16 loss
        return jnp.mean(x.astype(F16) @ w)

    w = jnp.ones(4, F16)
    g = eqx_amp.filter_value_and_grad(loss)
    (value, grads), _, finite = g(w, x, loss_scale=eqx_amp.StaticLossScale(2.0**10))
    assert value.dtype == F32 and grads.dtype == F32 and bool(finite)
    jaxpr = traced(
        lambda w, x: g(w, x, loss_scale=eqx_amp.StaticLossScale(2.0**10)), w, x
    )
    # The loss is multiplied by the scale in float32.
    muls = [e for e, _ in eqns_named(jaxpr, "mul") if e.outvars[0].aval.shape == ()]
    assert muls and all(e.outvars[0].aval.dtype == F32 for e in muls)


def test_has_aux_and_filter_grad(model, batch):
    def loss_aux(model, x, y):
        pred = jax.vmap(model)(x)
        return jnp.mean((pred - y) ** 2), {"pred": pred, "tag": "hello", "n": 3}

    scale = eqx_amp.DynamicLossScale(2.0**4)
    ((value, aux), grads), _, _ = eqx_amp.filter_value_and_grad(loss_aux, has_aux=True)(
        model, *batch, loss_scale=scale
    )
    assert aux["tag"] == "hello" and aux["n"] == 3
    np.testing.assert_array_equal(aux["pred"], jax.vmap(model)(batch[0]))
    assert float(value) == float(mse(model, *batch))

    (grads2, aux2), _, _ = eqx_amp.filter_grad(loss_aux, has_aux=True)(
        model, *batch, loss_scale=scale
    )
    _assert_trees_identical(grads2, grads)
    assert aux2["tag"] == "hello"

    grads3, new_scale3, finite3 = eqx_amp.filter_grad(mse)(
        model, *batch, loss_scale=scale
    )
    _assert_trees_identical(grads3, grads)
    assert bool(finite3) and int(new_scale3.counter) == 1


def test_decorator_factory(model, batch):
    @eqx_amp.filter_value_and_grad(has_aux=True)
    def loss_aux(model, x, y):
        return mse(model, x, y), jnp.float32(7.0)

    @eqx_amp.filter_grad(redo_on_nan=2)
    def grad_fn(model, x, y):
        return mse(model, x, y)

    scale = eqx_amp.StaticLossScale(4.0)
    ((_, aux), _), _, _ = loss_aux(model, *batch, loss_scale=scale)
    assert float(aux) == 7.0
    grads, _, _ = grad_fn(model, *batch, loss_scale=scale)
    _assert_trees_identical(grads, eqx.filter_grad(mse)(model, *batch))


def test_non_differentiable_leaves_get_none(model, batch):
    tree = {"model": model, "steps": jnp.int32(3), "name": "mlp"}

    def loss(tree, x, y):
        return mse(tree["model"], x, y)

    grads, _, finite = eqx_amp.filter_grad(loss)(
        tree, *batch, loss_scale=eqx_amp.DynamicLossScale()
    )
    assert grads["steps"] is None and grads["name"] is None
    assert grads["model"].activation is None
    assert bool(finite)


def test_wrapper_under_filter_jit_and_signature(model, batch):
    g = eqx_amp.filter_value_and_grad(mse)
    assert isinstance(g, eqx.Module)
    assert g.__wrapped__ is mse and g.__name__ == "mse"
    signature = inspect.signature(g)
    assert list(signature.parameters) == ["model", "x", "y", "loss_scale"]
    assert signature.parameters["loss_scale"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "loss_scale" in inspect.signature(eqx_amp.filter_grad(mse)).parameters

    jitted = eqx.filter_jit(g)
    scale = eqx_amp.DynamicLossScale(2.0**5, counter=1, period=2)
    (_, grads), new_scale, _ = jitted(model, *batch, loss_scale=scale)
    assert float(new_scale.loss_scale) == 2.0**6
    _assert_close(grads, eqx.filter_grad(mse)(model, *batch), rtol=1e-6)
    # A second call with the new scale does not retrace.
    compiled = jitted._cached._cache_size()
    jitted(model, *batch, loss_scale=new_scale)
    assert jitted._cached._cache_size() == compiled


def test_as_a_method(getkey, batch):
    class Regressor(eqx.Module):
        mlp: eqx.nn.MLP

        @eqx_amp.filter_value_and_grad
        def loss(self, x, y):
            return mse(self.mlp, x, y)

    reg = Regressor(eqx.nn.MLP(4, "scalar", 8, 1, key=getkey()))
    (value, grads), _, _ = reg.loss(*batch, loss_scale=eqx_amp.NoOpLossScale())
    assert float(value) == float(mse(reg.mlp, *batch))
    assert isinstance(grads, Regressor)
    _assert_trees_identical(grads.mlp, eqx.filter_grad(mse)(reg.mlp, *batch))


#
# redo_on_nan.
#


def _two_layer(params, x):
    w1, w2 = params
    return jnp.sum(jnp.tanh(x @ w1) @ w2)


def _stablehlo(redo_on_nan, loss_scale):
    g = eqx_amp.filter_value_and_grad(_two_layer, redo_on_nan=redo_on_nan)
    params = (jnp.ones((4, 8)), jnp.ones((8, 2)))
    x = jnp.ones((3, 4))
    lowered = jax.jit(lambda p, x, s: g(p, x, loss_scale=s)).lower(
        params, x, loss_scale
    )
    return lowered.as_text()


def test_redo_compiles_forward_and_backward_once():
    scale = eqx_amp.DynamicLossScale()
    once = _stablehlo(0, scale)
    redo = _stablehlo(3, scale)
    n_dots = once.count("stablehlo.dot_general")
    assert n_dots >= 3  # forward and backward
    assert redo.count("stablehlo.dot_general") == n_dots
    assert "stablehlo.while" in redo and "stablehlo.while" not in once


def test_redo_traces_the_loss_once():
    traces = []

    def loss(params, x):
        traces.append(None)  # a Python side effect runs once per trace
        return _two_layer(params, x)

    g = eqx.filter_jit(eqx_amp.filter_value_and_grad(loss, redo_on_nan=3))
    params = (jnp.ones((4, 8)), jnp.ones((8, 2)))
    (value, _), _, finite = g(
        params, jnp.ones((3, 4)), loss_scale=eqx_amp.DynamicLossScale()
    )
    assert len(traces) == 1
    assert bool(finite) and value == _two_layer(params, jnp.ones((3, 4)))


def test_redo_stops_once_the_scale_reaches_its_floor():
    tries = []

    def always_nan(params, x):
        jax.debug.callback(lambda: tries.append(None))
        return _two_layer(params, x) * jnp.nan

    g = eqx.filter_jit(eqx_amp.filter_value_and_grad(always_nan, redo_on_nan=30))
    params = (jnp.ones((4, 8)), jnp.ones((8, 2)))
    scale = eqx_amp.DynamicLossScale(2.0, min_loss_scale=1.0)
    _, new_scale, finite = g(params, jnp.ones((3, 4)), loss_scale=scale)
    jax.effects_barrier()
    # At 2.0, then at the floor 1.0; a third try at 1.0 would fail the same way.
    assert len(tries) == 2
    assert not bool(finite) and float(new_scale.loss_scale) == 1.0


def test_redo_skipped_for_fixed_scales():
    # Recomputing with a scale that `adjust` leaves unchanged cannot help.
    for scale in (eqx_amp.StaticLossScale(8.0), eqx_amp.NoOpLossScale()):
        assert "stablehlo.while" not in _stablehlo(3, scale)


def test_redo_until_finite_matches_a_single_try_at_the_right_scale(model, batch):
    # float16 backward overflows at a huge scale; each retry halves it.
    start = 2.0**24
    single = eqx.filter_jit(eqx_amp.filter_value_and_grad(amp_mse))
    scale = start
    while True:
        (value, grads), _, finite = single(
            model, *batch, loss_scale=eqx_amp.DynamicLossScale(scale)
        )
        if bool(finite):
            break
        scale /= 2
    tries = int(np.log2(start / scale)) + 1
    assert tries >= 3, "the test needs a few non-finite tries"

    redo = eqx.filter_jit(eqx_amp.filter_value_and_grad(amp_mse, redo_on_nan=tries))
    (redo_value, redo_grads), redo_scale, redo_finite = redo(
        model, *batch, loss_scale=eqx_amp.DynamicLossScale(start)
    )
    assert bool(redo_finite)
    assert float(redo_scale.loss_scale) == scale and int(redo_scale.counter) == 1
    assert float(redo_value) == float(value)
    _assert_trees_identical(redo_grads, grads)

    # One retry fewer is not enough: the scale is the one adjusted after the last
    # failure, and the flag says so.
    short = eqx_amp.filter_value_and_grad(amp_mse, redo_on_nan=tries - 2)
    _, short_scale, short_finite = short(
        model, *batch, loss_scale=eqx_amp.DynamicLossScale(start)
    )
    assert not bool(short_finite)
    assert float(short_scale.loss_scale) == scale
    assert int(short_scale.counter) == 0


def test_redo_when_every_try_fails(model, batch):
    x, y = batch
    x = x.at[0, 0].set(jnp.nan)

    def loss_aux(model, x, y):
        return mse(model, x, y), ("aux", jnp.arange(3), jr.key(1))

    g = eqx_amp.filter_value_and_grad(loss_aux, has_aux=True, redo_on_nan=3)
    ((value, aux), _), new_scale, finite = eqx.filter_jit(g)(
        model, x, y, loss_scale=eqx_amp.DynamicLossScale(2.0**10)
    )
    assert not bool(finite)
    # Four tries, four back-offs.
    assert float(new_scale.loss_scale) == 2.0**6 and int(new_scale.counter) == 0
    assert aux[0] == "aux" and aux[1].tolist() == [0, 1, 2]
    assert jr.key_data(aux[2]).tolist() == jr.key_data(jr.key(1)).tolist()
    assert np.isnan(float(value))


#
# axis_name.
#


def test_axis_name_averages_over_vmap(model, batch):
    x, y = batch
    g = eqx_amp.filter_value_and_grad(mse, axis_name="batch")
    scale = eqx_amp.DynamicLossScale(2.0**8)

    def per_example(x, y):
        return g(model, x[None], y[None], loss_scale=scale)

    step = jax.jit(jax.vmap(per_example, axis_name="batch"))
    (values, grads), new_scales, finite = step(x, y)
    ref_value, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(mse))(model, x, y)
    np.testing.assert_allclose(values, float(ref_value), rtol=1e-5)
    first = jax.tree_util.tree_map(lambda g: g[0], grads)
    _assert_close(first, ref_grads, rtol=1e-5)
    assert finite.tolist() == [True] * 8

    x = x.at[5, 2].set(jnp.nan)
    _, new_scales, finite = step(x, y)
    assert finite.tolist() == [False] * 8
    assert new_scales.loss_scale.tolist() == [2.0**7] * 8


def test_axis_name_unbound(model, batch):
    g = eqx_amp.filter_value_and_grad(mse, axis_name="data")
    with pytest.raises(NameError, match="`axis_name='data'`"):
        g(model, *batch, loss_scale=eqx_amp.DynamicLossScale())


@pytest.mark.slow
def test_shard_map_on_eight_devices():
    """Runs tests/_multidevice_grad.py on 8 fake CPU devices (the flag must be set
    before JAX is imported, so it runs in a fresh interpreter)."""
    report = run_on_eight_devices("_multidevice_grad.py")
    assert report["devices"] == 8

    # Every device takes a finite step and agrees on the scale.
    finite_step = report["finite_step"]
    assert finite_step["grads_finite"] == [True] * 8
    assert finite_step["loss_scale"] == [2.0**10] * 8
    assert finite_step["counter"] == [1] * 8
    assert finite_step["params_changed"] == [True] * 8

    # A NaN in one device's shard: every device skips and backs off identically.
    nan_step = report["nan_step"]
    assert nan_step["grads_finite"] == [False] * 8
    assert nan_step["loss_scale"] == [2.0**9] * 8
    assert nan_step["counter"] == [0] * 8
    assert nan_step["params_unchanged"] == [True] * 8
    assert nan_step["params_finite"] is True

    # The short form (`loss_scaling` + `scaled_value_and_grad(..., axis_name=...)`):
    # the same step, the same agreement on finiteness and on the scale.
    short = report["short_finite_step"]
    assert short["grads_finite"] == [True] * 8
    assert short["loss_scale"] == [2.0**10] * 8
    assert short["same_as_explicit"] is True
    short_nan = report["short_nan_step"]
    assert short_nan["grads_finite"] == [False] * 8
    assert short_nan["loss_scale"] == [2.0**9] * 8
    assert short_nan["total_notfinite"] == [1] * 8
    assert short_nan["same_as_explicit"] is True  # both skipped: params unchanged

    # What JAX does with gradients of replicated parameters (see the docstring of
    # `filter_value_and_grad`): with check_vma=True they are summed over devices, so
    # the mean needs the global-mean loss; with check_vma=False, axis_name averages.
    semantics = report["semantics"]
    assert semantics["check_vma_local_loss"] == pytest.approx(8.0, rel=1e-4)
    assert semantics["check_vma_global_loss"] == pytest.approx(1.0, rel=1e-4)
    assert semantics["no_check_vma_local_loss"] == pytest.approx(1.0, rel=1e-4)
    assert semantics["no_check_vma_global_loss"] == pytest.approx(1.0, rel=1e-4)
    assert semantics["identical_on_devices"] is True


#
# Bad input.
#


def test_missing_loss_scale(model, batch):
    g = eqx_amp.filter_value_and_grad(mse)
    with pytest.raises(TypeError, match="`loss_scale` keyword"):
        g(model, *batch)
    with pytest.raises(TypeError, match="`loss_scale` keyword"):
        eqx_amp.filter_grad(mse)(model, *batch)
    # `eqx.filter_jit` binds the arguments to the signature, where `loss_scale` is
    # a required keyword, before calling.
    with pytest.raises(TypeError, match="'loss_scale'"):
        eqx.filter_jit(g)(model, *batch)


@pytest.mark.parametrize("bad", [2.0**15, None, "dynamic", jnp.float32(8.0)])
def test_loss_scale_of_the_wrong_type(model, batch, bad):
    with pytest.raises(TypeError, match="`loss_scale` must be an"):
        eqx_amp.filter_value_and_grad(mse)(model, *batch, loss_scale=bad)


def test_no_positional_argument():
    g = eqx_amp.filter_value_and_grad(lambda x: jnp.sum(x))
    with pytest.raises(TypeError, match="first argument passed by position"):
        g(loss_scale=eqx_amp.NoOpLossScale())
    with pytest.raises(TypeError, match="first argument passed by position"):
        g(x=jnp.ones(2), loss_scale=eqx_amp.NoOpLossScale())


@pytest.mark.parametrize(
    "fun, has_aux, error, match",
    [
        (
            lambda x: x,
            False,
            ValueError,
            r"output of `fun` must be a scalar loss \(shape",
        ),
        (lambda x: (jnp.sum(x), 1), False, TypeError, "pass `has_aux=True`"),
        (lambda x: jnp.sum(x).astype(jnp.int32), False, TypeError, "floating scalar"),
        (lambda x: "loss", False, TypeError, "output of `fun`"),
        (lambda x: jnp.sum(x), True, TypeError, r"pair `\(loss, aux\)`"),
        (lambda x: (jnp.sum(x), 1, 2), True, TypeError, r"pair `\(loss, aux\)`"),
        (lambda x: (x, 1), True, ValueError, "output of `fun`"),
    ],
)
def test_bad_loss(fun, has_aux, error, match):
    x = jnp.ones(3)
    scale = eqx_amp.DynamicLossScale()
    with pytest.raises(error, match=match):
        eqx_amp.filter_value_and_grad(fun, has_aux=has_aux)(x, loss_scale=scale)
    with pytest.raises(error, match=match):
        eqx_amp.filter_grad(fun, has_aux=has_aux, redo_on_nan=2)(x, loss_scale=scale)


@pytest.mark.parametrize(
    "transform", [eqx_amp.filter_value_and_grad, eqx_amp.filter_grad]
)
def test_bad_options(transform):
    with pytest.raises(ValueError, match="`redo_on_nan` must be 0 or more"):
        transform(mse, redo_on_nan=-1)
    with pytest.raises(ValueError, match="`redo_on_nan` must be 0 or more"):
        transform(redo_on_nan=-1)  # the decorator-factory form fails early too
    # The retries are counted in int32: past it the loop could not compare.
    with pytest.raises(ValueError, match=r"`redo_on_nan` must be at most 2147483646"):
        transform(mse, redo_on_nan=2**40)
    with pytest.raises(TypeError, match="`redo_on_nan`"):
        transform(mse, redo_on_nan=1.5)
    with pytest.raises(TypeError, match="`redo_on_nan`"):
        transform(mse, redo_on_nan=True)
    with pytest.raises(TypeError, match="`has_aux`"):
        transform(mse, has_aux="yes")
    with pytest.raises(TypeError, match="`axis_name`"):
        transform(mse, axis_name=["data"])
    with pytest.raises(TypeError, match="`fun` must be callable"):
        transform(3)


#
# The documentation snippet runs.
#


# Slow tier, with the other docs pages' code.
@pytest.mark.slow
def test_docs_snippets_run():
    """The Python blocks of docs/guides/loss-scaling.md run as written, in order (as
    users run optax, under JAX's default promotion: tests/doc_blocks.py)."""
    namespace = run_page("docs/guides/loss-scaling.md")
    assert np.isfinite(float(namespace["loss"]))


def test_complex_parameters_are_unscaled_like_real_ones(getkey):
    """`eqx.filter_grad` differentiates complex arrays too (a diagonal state-space
    layer, a complex network), so their gradients were scaled and must be unscaled."""
    params = {
        "diag": jax.lax.complex(jr.normal(getkey(), (4,)), jr.normal(getkey(), (4,))),
        "proj": jr.normal(getkey(), (4,)),
    }
    x = jr.normal(getkey(), (4,))

    def loss(params, x):
        diag = params["diag"] * x.astype(jnp.complex64)
        return jnp.sum(jnp.abs(diag) ** 2) + jnp.sum(params["proj"] * x)

    g = eqx_amp.filter_grad(loss)
    grads, _, finite = g(params, x, loss_scale=eqx_amp.DynamicLossScale(2.0**15))
    expected = eqx.filter_grad(loss)(params, x)
    assert bool(finite)
    assert grads["diag"].dtype == jnp.complex64
    np.testing.assert_allclose(grads["diag"], expected["diag"], rtol=1e-6)
    np.testing.assert_allclose(grads["proj"], expected["proj"], rtol=1e-6)
