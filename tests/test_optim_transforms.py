"""The optax transformations of `eqx_amp.optim`: `master_weights`,
`kahan_summation`, `stochastic_rounding`, their errors and compositions."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
import pytest

import eqx_amp

from .helpers import rel_error
from .optim_helpers import (
    BF16,
    assert_bitwise_equal,
    float_params,
    mse_loss,
    regression_data,
    small_mlp,
)


#
# Errors of the optax pieces.
#


def test_compensation_refuses_float16_and_integer_params():
    for optimizer in (
        eqx_amp.optim.kahan_summation(),
        eqx_amp.optim.stochastic_rounding(jr.key(0)),
    ):
        with pytest.raises(ValueError, match=r"need bfloat16 weights .* float16 has"):
            optimizer.init({"w": jnp.ones(3, jnp.float16)})
        with pytest.raises(
            ValueError,
            match=r"was given \['step'\], an array of dtype int32, which is not a "
            r"floating array and cannot be trained\. Give it the floating leaves "
            r"only: `eqx\.filter\(model, eqx\.is_inexact_array\)`\.",
        ):
            optimizer.init({"w": jnp.ones(3, BF16), "step": jnp.zeros((), jnp.int32)})
        state = optimizer.init({"w": jnp.ones(3, BF16)})
        with pytest.raises(ValueError, match=r"needs the current weights to round"):
            optimizer.update({"w": jnp.ones(3)}, state)
        with pytest.raises(TypeError, match=r"must be the one its `init` made"):
            optimizer.update({"w": jnp.ones(3)}, (), {"w": jnp.ones(3, BF16)})


def test_kahan_summation_notices_weights_that_changed_dtype():
    # `eqx.apply_updates` adds a float32 update to a bfloat16 weight in float32 and
    # keeps the float32 sum: the buffer would then silently stop mattering.
    params = {"w": jnp.ones(3, BF16)}
    optimizer = eqx_amp.optim.kahan_summation()
    state = optimizer.init(params)
    updates, state = optimizer.update({"w": jnp.full(3, 1e-3)}, state, params)
    with jax.numpy_dtype_promotion("standard"):
        promoted = eqx.apply_updates(params, updates)
    with pytest.raises(
        ValueError,
        match=r"keeps a bfloat16 compensation buffer for a weight that is now an "
        r"array of dtype float32 and shape \(3,\)\. Apply its updates with "
        r"`eqx_amp\.optim\.apply_updates",
    ):
        optimizer.update({"w": jnp.full(3, 1e-3)}, state, promoted)


def test_apply_updates_refuses_a_complex_update_of_a_real_weight():
    # The sum would drop the imaginary part; a complex weight takes one.
    with pytest.raises(
        ValueError,
        match=r"`updates` must hold floating arrays .* it has an array of dtype "
        r"complex64 .* where `params` has an array of dtype bfloat16",
    ):
        eqx_amp.optim.apply_updates({"w": jnp.ones(3, BF16)}, {"w": jnp.full(3, 1j)})
    new = eqx_amp.optim.apply_updates({"w": jnp.full(3, 1j)}, {"w": jnp.full(3, 1j)})
    np.testing.assert_array_equal(new["w"], jnp.full(3, 2j))


def test_compensated_updates_take_none_for_a_whole_submodule():
    model = small_mlp(jr.key(0), BF16)
    params = float_params(model)
    updates = jtu.tree_map(lambda p: jnp.full(p.shape, 1e-3), params)
    updates = eqx.tree_at(lambda m: m.layers[0], updates, None)
    for optimizer in (
        eqx_amp.optim.kahan_summation(),
        eqx_amp.optim.stochastic_rounding(jr.key(0)),
    ):
        # The update jitted; `apply_updates` eagerly, where the `None` subtree's
        # layer keeps its identity.
        update = jax.jit(lambda u, p: optimizer.update(u, optimizer.init(p), p))
        out, _ = update(updates, params)
        new = eqx_amp.optim.apply_updates(model, out)
        assert new.layers[0] is model.layers[0]
        assert new.layers[1].weight.dtype == BF16


def test_stochastic_rounding_needs_a_key():
    with pytest.raises(TypeError, match=r"needs a PRNG key .* but got int 0"):
        eqx_amp.optim.stochastic_rounding(0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"needs a PRNG key .* but got NoneType"):
        eqx_amp.optim.stochastic_rounding(None)  # type: ignore[arg-type]
    optimizer = eqx_amp.optim.stochastic_rounding(jr.key(0))
    keyless = eqx_amp.optim.StochasticRoundingState(None)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"The `StochasticRoundingState` holds no PRNG key .* but NoneType None",
    ):
        optimizer.update({"w": jnp.ones(3)}, keyless, {"w": jnp.ones(3, BF16)})
    # Old-style raw keys are keys too, and keys of other implementations work.
    optimizer = eqx_amp.optim.stochastic_rounding(jr.PRNGKey(0))
    assert optimizer.init({"w": jnp.ones(3, BF16)}).key.dtype == jnp.uint32
    with pytest.raises(TypeError, match=r"needs a PRNG key"):
        eqx_amp.optim.stochastic_rounding(jnp.zeros(3, jnp.uint32))
    params = {"w": jnp.ones(3, BF16)}
    for make in (
        lambda k: eqx_amp.optim.stochastic_rounding(k),
        lambda k: eqx_amp.optim.low_precision_moments(optax.adam(1e-3), key=k),
    ):
        optimizer = make(jr.key(0, impl="rbg"))
        state = optimizer.init(params)
        with jax.numpy_dtype_promotion("standard"):
            jax.jit(optimizer.update)({"w": jnp.ones(3)}, state, params)


def test_float32_params_pass_through():
    params = {"w": jnp.ones(3), "half": jnp.ones(3, BF16)}
    updates = {"w": jnp.full(3, 1e-9), "half": jnp.full(3, 1e-9)}
    for optimizer in (
        eqx_amp.optim.kahan_summation(),
        eqx_amp.optim.stochastic_rounding(jr.key(0)),
    ):
        state = optimizer.init(params)
        out, _ = optimizer.update(updates, state, params)
        assert out["w"] is updates["w"]
    assert eqx_amp.optim.kahan_summation().init(params).compensation["w"] is None


#
# master_weights.
#


def test_master_weights_is_float32_training_of_a_bfloat16_model():
    model = small_mlp(jr.key(0), BF16)
    x, y = regression_data(jr.key(1))
    optimizer = eqx_amp.optim.master_weights(optax.adam(1e-2))
    state = optimizer.init(model)
    master_leaves = [m for m in jtu.tree_leaves(state.master)]
    assert master_leaves and all(m.dtype == jnp.float32 for m in master_leaves)

    # The reference: a float32 master trained by hand on the bfloat16 copy's grads.
    reference = eqx_amp.cast_tree(model, jnp.float32)
    ref_opt = optax.adam(1e-2)
    ref_state = ref_opt.init(float_params(reference))

    @eqx.filter_jit
    def step(model, state):
        grads = eqx.filter_grad(mse_loss)(model, x, y)
        updates, state = optimizer.update(grads, state, model)
        # Float32 updates landing exactly on the rounded master, by either road.
        assert {u.dtype for u in jtu.tree_leaves(updates)} == {np.dtype(jnp.float32)}
        new = eqx_amp.optim.apply_updates(model, updates)
        by_optax = optax.apply_updates(float_params(model), updates)
        return new, state, by_optax

    @eqx.filter_jit
    def reference_step(master, ref_state):
        half = eqx_amp.cast_tree(master, BF16)
        grads = eqx.filter_grad(mse_loss)(half, x, y)
        grads = jtu.tree_map(lambda g: g.astype(jnp.float32), grads)
        with jax.numpy_dtype_promotion("standard"):
            updates, ref_state = ref_opt.update(grads, ref_state, master)
        return eqx.apply_updates(master, updates), ref_state

    with jax.numpy_dtype_promotion("standard"):
        for _ in range(5):
            model, state, by_optax = step(model, state)
            assert_bitwise_equal(by_optax, float_params(model))
            reference, ref_state = reference_step(reference, ref_state)
    assert_bitwise_equal(state.master, float_params(reference))
    assert_bitwise_equal(model, eqx_amp.cast_tree(reference, BF16))
    assert {leaf.dtype for leaf in jtu.tree_leaves(float_params(model))} == {
        np.dtype(BF16)
    }


def test_master_weights_with_loss_scaling_skips_and_multisteps():
    model = small_mlp(jr.key(0), jnp.float16)
    x, y = regression_data(jr.key(1))
    # Either order composes: master_weights is a GradientTransformation.
    optimizer = eqx_amp.loss_scaling(
        eqx_amp.optim.master_weights(optax.MultiSteps(optax.adam(1e-2), 2))
    )
    state = optimizer.init(model)

    @eqx_amp.scaled_value_and_grad
    def loss(model, x, y, blow_up):
        return mse_loss(model, x, y) * blow_up

    @eqx.filter_jit
    def step(model, state, blow_up):
        (value, grads), state = loss(model, x, y, blow_up, opt_state=state)
        updates, state = optimizer.update(grads, state, model)
        return eqx_amp.optim.apply_updates(model, updates), state

    with jax.numpy_dtype_promotion("standard"):
        first, state1 = step(model, state, jnp.float32(1.0))
        # MultiSteps: the first of two steps only accumulates.
        assert_bitwise_equal(first, model)
        second, state2 = step(first, state1, jnp.float32(1.0))
        assert (
            rel_error(
                second.layers[0].weight.astype(jnp.float32),
                model.layers[0].weight.astype(jnp.float32),
            )
            > 0
        )
        # An overflowing step: skipped, the scale halves, nothing else moves.
        third, state3 = step(second, state2, jnp.float32(3e38))
    assert_bitwise_equal(third, second)
    assert_bitwise_equal(state3.inner_state.master, state2.inner_state.master)
    scale2 = state2.loss_scale.loss_scale
    assert float(state3.loss_scale.loss_scale) == float(scale2) / 2


def test_master_weights_bad_input():
    with pytest.raises(TypeError, match=r"`master_weights` wraps an optax optimizer"):
        eqx_amp.optim.master_weights("adam")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dtype"):
        eqx_amp.optim.master_weights(optax.adam(1e-3), jnp.int32)
    model = small_mlp(jr.key(0), BF16)
    optimizer = eqx_amp.optim.master_weights(optax.adam(1e-3))
    state = optimizer.init(model)
    with pytest.raises(
        ValueError, match=r"^`grads` must have the structure of `params`"
    ):
        optimizer.update((float_params(model),), state, model)
    with pytest.raises(TypeError, match=r"must be the `MasterWeightsState` its `init`"):
        optimizer.update(float_params(model), state.inner_state, model)
    with pytest.raises(ValueError, match=r"`eqx_amp.optim.master_weights` needs the"):
        optimizer.update(float_params(model), state)
    with_counter = (model, jnp.zeros((), jnp.int32))
    state = optimizer.init(with_counter)
    grads = (float_params(model), jnp.ones((), jnp.float32))
    with pytest.raises(ValueError, match=r"which is not a floating array"):
        optimizer.update(grads, state, with_counter)
