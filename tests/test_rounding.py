"""The rounding recipes: Kahan summation, stochastic rounding, and
`eqx_amp.optim.apply_updates` (each sum in float32, rounded once)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
import pytest

import eqx_amp

from .optim_helpers import (
    BF16,
    BF16_MASTER,
    float_params,
    small_mlp,
)


#
# The roundings themselves.
#


def test_stochastic_rounding_is_unbiased_and_exact_on_bfloat16_values():
    from eqx_amp._optim._rounding import stochastic_round

    # 1 + a quarter of a bfloat16 ulp (2^-7 at 1.0), positive and negative.
    x = jnp.array([1 + 2**-9, -(1 + 2**-9)], jnp.float32)
    draws = jax.vmap(lambda k: stochastic_round(x, BF16, k))(jr.split(jr.key(0), 20000))
    assert draws.dtype == BF16
    assert set(np.unique(np.asarray(draws[:, 0], np.float32))) == {1.0, 1 + 2**-7}
    ups = np.mean(np.asarray(draws[:, 0], np.float32) > 1.0)
    assert abs(ups - 0.25) < 0.015
    np.testing.assert_allclose(
        np.mean(np.asarray(draws, np.float32), axis=0), x, rtol=2**-12
    )
    # bfloat16 values, zeros, infinities and NaN come back as they are.
    exact = jnp.array([1.5, -3.0, 0.0, -0.0, jnp.inf, -jnp.inf, jnp.nan], jnp.float32)
    once = stochastic_round(exact, BF16, jr.key(1))
    np.testing.assert_array_equal(
        np.asarray(once, np.float32), np.asarray(exact.astype(BF16), np.float32)
    )
    assert np.signbit(np.asarray(once, np.float32)[3])
    # Finite values above the largest bfloat16 round to it, never up into inf.
    huge = jnp.full((10000,), 3.39e38, jnp.float32)
    rounded = stochastic_round(huge, BF16, jr.key(2))
    assert bool(jnp.all(rounded == jnp.finfo(BF16).max))


def test_kahan_summation_keeps_updates_plain_bfloat16_loses():
    weight = jnp.full((4,), 1.0, BF16)
    tiny = jnp.full((4,), 1e-4, jnp.float32)  # below half an ulp (2^-8) of 1.0
    optimizer = eqx_amp.optim.kahan_summation()
    state = optimizer.init(weight)
    plain = compensated = weight
    for _ in range(1000):
        plain = eqx_amp.optim.apply_updates(plain, tiny)
        updates, state = optimizer.update(tiny, state, compensated)
        compensated = eqx_amp.optim.apply_updates(compensated, updates)
    assert compensated.dtype == BF16 and state.compensation.dtype == BF16
    np.testing.assert_array_equal(np.asarray(plain, np.float32), 1.0)
    # The float32 sum is 1.1; the weight is within one bfloat16 ulp (2^-7) of it.
    assert np.all(np.abs(np.asarray(compensated, np.float32) - 1.1) <= 2**-7)
    # Weight + compensation follows the float32 sum more closely still: the
    # buffer is bfloat16 too, so each step's residue is itself rounded (to 2^-9
    # of a residue below half an ulp).
    total = np.asarray(compensated, np.float32) + np.asarray(
        state.compensation, np.float32
    )
    assert np.all(np.abs(total - 1.1) <= 2**-8)


def test_stochastic_rounding_keeps_updates_in_expectation():
    weight = jnp.full((4096,), 1.0, BF16)
    tiny = jnp.full((4096,), 1e-4, jnp.float32)
    optimizer = eqx_amp.optim.stochastic_rounding(jr.key(0))
    state = optimizer.init(weight)
    step = jax.jit(lambda w, s: optimizer.update(tiny, s, w))
    for _ in range(500):
        updates, state = step(weight, state)
        weight = eqx_amp.optim.apply_updates(weight, updates)
    assert weight.dtype == BF16
    assert abs(float(jnp.mean(weight.astype(jnp.float32))) - 1.05) < 2e-3


def test_updates_land_exactly_on_the_rounded_weights():
    key = jr.key(3)
    weight = jr.normal(key, (1000,)).astype(BF16)
    update = 1e-3 * jr.normal(jr.fold_in(key, 1), (1000,))
    for optimizer in (
        eqx_amp.optim.kahan_summation(),
        eqx_amp.optim.stochastic_rounding(jr.key(0)),
    ):
        state = optimizer.init(weight)
        out, _ = optimizer.update(update, state, weight)
        assert out.dtype == jnp.float32
        new = eqx_amp.optim.apply_updates(weight, out)
        # `out` is `new - weight` exactly, for optax's apply too.
        np.testing.assert_array_equal(
            np.asarray(new.astype(jnp.float32) - weight.astype(jnp.float32)),
            np.asarray(out),
        )
        with jax.numpy_dtype_promotion("standard"):
            via_optax = optax.apply_updates(weight, out)
        np.testing.assert_array_equal(
            np.asarray(via_optax, np.float32), np.asarray(new, np.float32)
        )


def test_apply_updates_keeps_dtypes_and_non_arrays():
    model = small_mlp(jr.key(0), BF16)
    updates = jtu.tree_map(
        lambda p: jnp.full(p.shape, 0.5, jnp.float32), float_params(model)
    )
    new = eqx_amp.optim.apply_updates(model, updates)
    assert jtu.tree_structure(new) == jtu.tree_structure(model)
    for old, leaf in zip(
        jtu.tree_leaves(float_params(model)), jtu.tree_leaves(float_params(new))
    ):
        assert leaf.dtype == BF16
        expected = (old.astype(jnp.float32) + 0.5).astype(BF16)
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(expected))
    assert new.activation is model.activation
    # `None` for a whole submodule leaves it as it is.
    partial = eqx.tree_at(lambda m: m.layers[0], updates, None)
    kept = eqx_amp.optim.apply_updates(model, partial)
    assert kept.layers[0] is model.layers[0]


def test_apply_updates_bad_input():
    model = small_mlp(jr.key(0), BF16)
    updates = jtu.tree_map(jnp.zeros_like, float_params(model))
    with pytest.raises(
        ValueError, match=r"^`updates` must have the structure of `params`"
    ):
        eqx_amp.optim.apply_updates(model, (updates,))
    wrong = eqx.tree_at(lambda m: m.layers[0].bias, updates, jnp.zeros(3))
    with pytest.raises(
        ValueError,
        match=r"it has an array of dtype float32 and shape \(3,\) where `params` has "
        r"an array of dtype bfloat16 and shape \(32,\)",
    ):
        eqx_amp.optim.apply_updates(model, wrong)
    counter = (jnp.zeros((), jnp.int32), jnp.ones(2, BF16))
    with pytest.raises(
        ValueError, match=r"is not a floating array and is never updated"
    ):
        eqx_amp.optim.apply_updates(counter, (jnp.ones((), jnp.float32), None))


#
# A bfloat16 master: the optim road, not BiModel.
#


def test_bimodel_with_a_bfloat16_master_points_to_the_compensated_road():
    model = small_mlp(jr.key(0))
    with pytest.warns(UserWarning, match=r"eqx_amp\.optim\.kahan_summation\(\)"):
        eqx_amp.BiModel(model, policy=BF16_MASTER)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'compensation'"):
        eqx_amp.BiModel(model, policy=BF16_MASTER, compensation="kahan")  # type: ignore[call-arg]


def test_kahan_tracks_the_float32_sum_of_tiny_updates():
    """What `BiModel(compensation="kahan")` did, on the one road left."""
    params = (jnp.full((4,), 1.0, BF16),)
    optimizer = eqx_amp.optim.kahan_summation()
    state = optimizer.init(params)
    tiny = (jnp.full((4,), 1e-4),)
    for _ in range(1000):
        updates, state = optimizer.update(tiny, state, params)
        params = eqx_amp.optim.apply_updates(params, updates)
    assert np.all(np.abs(np.asarray(params[0], np.float32) - 1.1) <= 2**-7)


def _kahan_run(update: float, steps: int) -> tuple[float, float]:
    """A bfloat16 weight of 1 after `steps` Kahan-compensated steps of `update`,
    and the float32 sum it follows."""
    optimizer = eqx_amp.optim.kahan_summation()
    weight = jnp.ones((1,), BF16)
    step = jnp.full((1,), update, jnp.float32)

    def body(carry, _):
        weight, state = carry
        updates, state = optimizer.update(step, state, weight)
        return (eqx_amp.optim.apply_updates(weight, updates), state), None

    (weight, _), _ = jax.jit(lambda c: jax.lax.scan(body, c, None, length=steps))(
        (weight, optimizer.init(weight))
    )
    return float(weight[0]), 1.0 + steps * update


def test_kahan_summation_follows_updates_down_to_2_to_the_minus_17_of_the_weight():
    # The documented limit: down to about 2^-17 of the weight, within one ulp of
    # the float32 sum (2^-8 below 1.0); 16 ulps of movement each.
    for update in (-(2.0**-12), -(2.0**-15), -(2.0**-17)):
        weight, exact = _kahan_run(update, int(2.0**-4 / -update))
        assert abs(weight - exact) <= 2.0**-8
    # Below it the bfloat16 buffer rounds each update away: the weight stalls.
    weight, exact = _kahan_run(-(2.0**-20), 2**16)
    assert weight == 1.0 and exact == 1.0 - 2.0**-4
