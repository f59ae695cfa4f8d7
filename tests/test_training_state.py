"""Low-precision training state: master weights kept by the optimizer, compensated
bfloat16 weights (Kahan summation, stochastic rounding), low-precision moments."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
import pytest

import eqx_amp

from .helpers import rel_error, run_script_on_eight_devices


BF16 = jnp.bfloat16
BF16_MASTER = "p=bf16,c=bf16,o=f32"


def _mlp(key, dtype=jnp.float32, out=4):
    model = eqx.nn.MLP(8, out, 32, 2, key=key)
    return eqx_amp.cast_tree(model, dtype)


def _data(key, n=64):
    kx, ky = jr.split(key)
    return jr.normal(kx, (n, 8)), jr.normal(ky, (n, 4))


def _loss(model, x, y):
    out = jax.vmap(model)(x.astype(BF16) if _is_half(model) else x)
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)


def _is_half(model):
    return jtu.tree_leaves(eqx.filter(model, eqx.is_inexact_array))[0].dtype == BF16


def _params(model):
    return eqx.filter(model, eqx.is_inexact_array)


def _assert_bitwise_equal(a, b):
    a_leaves, a_def = jtu.tree_flatten(a)
    b_leaves, b_def = jtu.tree_flatten(b)
    assert a_def == b_def
    for x, y in zip(a_leaves, b_leaves):
        if eqx.is_array(x):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(
                np.asarray(x).reshape(-1).view(np.uint8),
                np.asarray(y).reshape(-1).view(np.uint8),
            )
        else:
            assert x == y or (callable(x) and x is y)


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
    model = _mlp(jr.key(0), BF16)
    updates = jtu.tree_map(
        lambda p: jnp.full(p.shape, 0.5, jnp.float32), _params(model)
    )
    new = eqx_amp.optim.apply_updates(model, updates)
    assert jtu.tree_structure(new) == jtu.tree_structure(model)
    for old, leaf in zip(
        jtu.tree_leaves(_params(model)), jtu.tree_leaves(_params(new))
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
    model = _mlp(jr.key(0), BF16)
    updates = jtu.tree_map(jnp.zeros_like, _params(model))
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


def test_compensated_updates_take_none_for_a_whole_submodule():
    model = _mlp(jr.key(0), BF16)
    params = _params(model)
    updates = jtu.tree_map(lambda p: jnp.full(p.shape, 1e-3), params)
    updates = eqx.tree_at(lambda m: m.layers[0], updates, None)
    for optimizer in (
        eqx_amp.optim.kahan_summation(),
        eqx_amp.optim.stochastic_rounding(jr.key(0)),
    ):
        out, _ = optimizer.update(updates, optimizer.init(params), params)
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
            optimizer.update({"w": jnp.ones(3)}, state, params)


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
    model = _mlp(jr.key(0), BF16)
    x, y = _data(jr.key(1))
    optimizer = eqx_amp.optim.master_weights(optax.adam(1e-2))
    state = optimizer.init(model)
    master_leaves = [m for m in jtu.tree_leaves(state.master)]
    assert master_leaves and all(m.dtype == jnp.float32 for m in master_leaves)

    # The reference: a float32 master trained by hand on the bfloat16 copy's grads.
    reference = eqx_amp.cast_tree(model, jnp.float32)
    ref_opt = optax.adam(1e-2)
    ref_state = ref_opt.init(_params(reference))

    @eqx.filter_jit
    def step(model, state):
        grads = eqx.filter_grad(_loss)(model, x, y)
        updates, state = optimizer.update(grads, state, model)
        # Float32 updates landing exactly on the rounded master, by either road.
        assert {u.dtype for u in jtu.tree_leaves(updates)} == {np.dtype(jnp.float32)}
        new = eqx_amp.optim.apply_updates(model, updates)
        by_optax = optax.apply_updates(_params(model), updates)
        return new, state, by_optax

    @eqx.filter_jit
    def reference_step(master, ref_state):
        half = eqx_amp.cast_tree(master, BF16)
        grads = eqx.filter_grad(_loss)(half, x, y)
        grads = jtu.tree_map(lambda g: g.astype(jnp.float32), grads)
        with jax.numpy_dtype_promotion("standard"):
            updates, ref_state = ref_opt.update(grads, ref_state, master)
        return eqx.apply_updates(master, updates), ref_state

    with jax.numpy_dtype_promotion("standard"):
        for _ in range(5):
            model, state, by_optax = step(model, state)
            _assert_bitwise_equal(by_optax, _params(model))
            reference, ref_state = reference_step(reference, ref_state)
    _assert_bitwise_equal(state.master, _params(reference))
    _assert_bitwise_equal(model, eqx_amp.cast_tree(reference, BF16))
    assert {leaf.dtype for leaf in jtu.tree_leaves(_params(model))} == {np.dtype(BF16)}


def test_master_weights_with_loss_scaling_skips_and_multisteps():
    model = _mlp(jr.key(0), jnp.float16)
    x, y = _data(jr.key(1))
    # Either order composes: master_weights is a GradientTransformation.
    optimizer = eqx_amp.loss_scaling(
        eqx_amp.optim.master_weights(optax.MultiSteps(optax.adam(1e-2), 2))
    )
    state = optimizer.init(model)

    @eqx_amp.scaled_value_and_grad
    def loss(model, x, y, blow_up):
        return _loss(model, x, y) * blow_up

    @eqx.filter_jit
    def step(model, state, blow_up):
        (value, grads), state = loss(model, x, y, blow_up, opt_state=state)
        updates, state = optimizer.update(grads, state, model)
        return eqx_amp.optim.apply_updates(model, updates), state

    with jax.numpy_dtype_promotion("standard"):
        first, state1 = step(model, state, jnp.float32(1.0))
        # MultiSteps: the first of two steps only accumulates.
        _assert_bitwise_equal(first, model)
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
    _assert_bitwise_equal(third, second)
    _assert_bitwise_equal(state3.inner_state.master, state2.inner_state.master)
    scale2 = state2.loss_scale.loss_scale
    assert float(state3.loss_scale.loss_scale) == float(scale2) / 2


def test_master_weights_bad_input():
    with pytest.raises(TypeError, match=r"`master_weights` wraps an optax optimizer"):
        eqx_amp.optim.master_weights("adam")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dtype"):
        eqx_amp.optim.master_weights(optax.adam(1e-3), jnp.int32)
    model = _mlp(jr.key(0), BF16)
    optimizer = eqx_amp.optim.master_weights(optax.adam(1e-3))
    state = optimizer.init(model)
    with pytest.raises(
        ValueError, match=r"^`grads` must have the structure of `params`"
    ):
        optimizer.update((_params(model),), state, model)
    with pytest.raises(TypeError, match=r"must be the `MasterWeightsState` its `init`"):
        optimizer.update(_params(model), state.inner_state, model)
    with pytest.raises(ValueError, match=r"`eqx_amp.optim.master_weights` needs the"):
        optimizer.update(_params(model), state)
    with_counter = (model, jnp.zeros((), jnp.int32))
    state = optimizer.init(with_counter)
    grads = (_params(model), jnp.ones((), jnp.float32))
    with pytest.raises(ValueError, match=r"which is not a floating array"):
        optimizer.update(grads, state, with_counter)


#
# A bfloat16 master: the optim road, not BiModel.
#


def test_bimodel_with_a_bfloat16_master_points_to_the_compensated_road():
    model = _mlp(jr.key(0))
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


#
# Low-precision moments.
#


def _encode_decode(x, storage, square_root, key=jr.key(0)):
    from eqx_amp._optim._codec import encode

    return encode(x, storage, square_root, 256, key).decode()


def test_moment_encodings_error_bounds():
    key = jr.key(0)
    signed = jr.normal(key, (1000,)) * jnp.exp(jr.normal(jr.fold_in(key, 1), (1000,)))
    second = signed**2
    decoded = _encode_decode(signed, "bfloat16", False)
    assert decoded.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(decoded - signed) / jnp.abs(signed))) <= 2**-7
    decoded = _encode_decode(second, "bfloat16", True)
    # sqrt stored to 2^-7 relative, squared: 2^-6.
    assert float(jnp.max(jnp.abs(decoded - second) / second)) <= 2**-6
    # 8-bit: within a map step of the block's largest value.
    decoded = _encode_decode(signed, "8bit", False)
    blocks = jnp.pad(signed, (0, 24)).reshape(-1, 256)
    scale = jnp.repeat(jnp.max(jnp.abs(blocks), axis=1), 256)[:1000]
    assert float(jnp.max(jnp.abs(decoded - signed) / scale)) <= 0.9 / 64 + 1e-6


@pytest.mark.parametrize("signed", [True, False])
def test_eight_bit_codes_are_the_maps_neighbours(signed):
    # The encoding computes where a value falls in the dynamic map from the map's
    # layout; it must agree with searching the map itself.
    from eqx_amp._optim._codec import _SIGNED_MAP, _UNSIGNED_MAP, _map_position

    table = _SIGNED_MAP if signed else _UNSIGNED_MAP
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.uniform(-1 if signed else 0, 1, 20000),
            10.0 ** rng.uniform(-9, 0, 20000)
            * (rng.choice([-1, 1], 20000) if signed else 1),
            table,
        ]
    ).astype(np.float32)
    above = np.clip(np.searchsorted(table, x), 1, len(table) - 1)
    below = above - 1
    expected = below + np.clip((x - table[below]) / (table[above] - table[below]), 0, 1)
    position = np.asarray(_map_position(jnp.asarray(x), signed))
    np.testing.assert_allclose(position, expected, atol=1e-4)


def test_eight_bit_second_moments_keep_small_values():
    # Second moments spanning 12 decades in one block: the square-root storage
    # keeps every one above zero, and those within six decades of the largest
    # within a factor of 2.5, where signed codes of the moment itself flush the
    # small ones to zero (an infinite Adam step).
    second = jnp.logspace(-12, 0, 256)
    decoded = _encode_decode(second, "8bit", True)
    assert float(jnp.min(decoded)) > 0
    ratio = np.asarray(decoded / second)[np.asarray(second) >= 1e-6]
    assert np.all((ratio > 0.4) & (ratio < 2.5))
    signed = _encode_decode(second, "8bit", False)
    assert float(jnp.min(signed)) == 0.0


def test_moment_encoding_is_unbiased():
    x = jnp.full((4096,), 0.3337)
    decoded = jax.vmap(lambda k: _encode_decode(x, "bfloat16", False, k))(
        jr.split(jr.key(1), 64)
    )
    assert abs(float(jnp.mean(decoded)) - 0.3337) < 1e-5
    x = jnp.concatenate([jnp.ones(1), jnp.full((255,), 0.0537)])
    decoded = jax.vmap(lambda k: _encode_decode(x, "8bit", False, k))(
        jr.split(jr.key(2), 256)
    )
    assert abs(float(jnp.mean(decoded[:, 1:])) - 0.0537) < 2e-4


@pytest.mark.parametrize("storage", ["bfloat16", "8bit"])
def test_low_precision_moments_train_like_float32_moments(storage):
    model = _mlp(jr.key(0))
    x, y = _data(jr.key(1))
    reference = optax.adam(3e-3)
    compressed = eqx_amp.optim.low_precision_moments(optax.adam(3e-3), storage)
    states = [o.init(_params(model)) for o in (reference, compressed)]
    moments = [
        leaf
        for leaf in jtu.tree_leaves(
            states[1], is_leaf=lambda n: isinstance(n, eqx_amp.optim.QuantizedMoment)
        )
        if isinstance(leaf, eqx_amp.optim.QuantizedMoment)
    ]
    assert len(moments) == 2 * len(jtu.tree_leaves(_params(model)))
    expected = BF16 if storage == "bfloat16" else jnp.uint8
    assert all(m.values.dtype == expected for m in moments)
    assert sum(m.square_root for m in moments) == len(moments) // 2

    def train(optimizer, state, steps=100):
        @eqx.filter_jit
        def step(model, state):
            loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
            updates, state = optimizer.update(grads, state, model)
            return eqx.apply_updates(model, updates), state, loss

        m = model
        for _ in range(steps):
            m, state, loss = step(m, state)
        return m, state, float(loss)

    with jax.numpy_dtype_promotion("standard"):
        ref_model, _, ref_loss = train(reference, states[0])
        low_model, low_state, low_loss = train(compressed, states[1])
    assert int(low_state.step) == 100
    # 100 Adam steps fitting noise: where the two runs land differs by a few
    # percent either way (measured: bfloat16 0.5%, 8-bit 3.7% lower), and the
    # weights by 2% (bfloat16) and 8% (8-bit: a moment a decade below its block's
    # largest is stored to ~10%).
    assert low_loss < 1.05 * ref_loss
    error = rel_error(ref_model.layers[0].weight, low_model.layers[0].weight)
    assert error < (0.05 if storage == "bfloat16" else 0.15)


def test_low_precision_moments_bytes_per_weight():
    params = {"w": jnp.ones((1024, 256)), "b": jnp.ones(256)}
    weights = 1024 * 256 + 256

    def nbytes(state):
        return sum(x.nbytes for x in jtu.tree_leaves(state) if eqx.is_array(x))

    plain = nbytes(optax.adamw(1e-3).init(params))
    bf16 = nbytes(eqx_amp.optim.low_precision_moments(optax.adamw(1e-3)).init(params))
    int8 = nbytes(
        eqx_amp.optim.low_precision_moments(optax.adamw(1e-3), "8bit").init(params)
    )
    assert plain / weights == pytest.approx(8, abs=0.01)
    assert bf16 / weights == pytest.approx(4, abs=0.01)
    assert int8 / weights == pytest.approx(2 + 8 / 256, abs=0.01)


def test_low_precision_moments_leave_kahan_buffers_and_scalars_alone():
    params = {"w": jnp.ones((4, 8), BF16)}
    optimizer = eqx_amp.optim.low_precision_moments(
        optax.chain(optax.adam(1e-3), eqx_amp.optim.kahan_summation()), "8bit"
    )
    state = optimizer.init(params)
    adam_state, kahan_state = state.inner_state
    assert kahan_state.compensation["w"].dtype == BF16
    assert adam_state[0].count.dtype == jnp.int32
    assert isinstance(adam_state[0].mu["w"], eqx_amp.optim.QuantizedMoment)


def test_only_the_optimizers_moments_are_compressed():
    class StudentT(eqx.Module):
        loc: jax.Array
        nu: jax.Array  # a model field with a moment's name

    params = StudentT(jnp.zeros(4), jnp.ones(4))
    optimizer = eqx_amp.optim.low_precision_moments(optax.adam(1e-1), "8bit")
    state = optimizer.init(params)
    adam = state.inner_state[0]
    # Decided by the optimizer's field (`mu`), not the model's (`nu`).
    assert not adam.mu.nu.square_root and adam.nu.nu.square_root
    grads = StudentT(jnp.ones(4), -jnp.ones(4))
    with jax.numpy_dtype_promotion("standard"):
        for _ in range(3):
            updates, state = optimizer.update(grads, state)
    np.testing.assert_allclose(np.asarray(updates.nu), 0.1, rtol=0.05)

    # Accumulated gradients, slow weights: per-weight state that is not a moment.
    accumulating = eqx_amp.optim.low_precision_moments(
        optax.MultiSteps(optax.adam(1e-3), 4), "8bit"
    )
    state = accumulating.init({"w": jnp.ones((4, 8))})
    assert state.inner_state.acc_grads["w"].dtype == jnp.float32
    assert isinstance(
        state.inner_state.inner_opt_state[0].mu["w"], eqx_amp.optim.QuantizedMoment
    )
    schedule_free = eqx_amp.optim.low_precision_moments(
        optax.contrib.schedule_free_adamw(1e-3), "8bit"
    )
    state = schedule_free.init({"w": jnp.ones((4, 8))})
    assert state.inner_state.z["w"].dtype == jnp.float32  # a copy of the weights
    moments = [
        leaf
        for leaf in jtu.tree_leaves(
            state, is_leaf=lambda n: isinstance(n, eqx_amp.optim.QuantizedMoment)
        )
        if isinstance(leaf, eqx_amp.optim.QuantizedMoment)
    ]
    assert len(moments) == 1  # AdamW's `nu` (schedule-free keeps no `mu`)


def test_low_precision_moments_inside_and_outside_loss_scaling():
    params = {"w": jnp.ones((4, 8))}
    grads = {"w": jnp.full((4, 8), 0.5)}
    for optimizer in (
        eqx_amp.loss_scaling(eqx_amp.optim.low_precision_moments(optax.adam(1e-3))),
        eqx_amp.optim.low_precision_moments(
            eqx_amp.loss_scaling(optax.adam(1e-3, mu_dtype=BF16))
        ),
    ):
        state = optimizer.init(params)
        with jax.numpy_dtype_promotion("standard"):
            jax.jit(optimizer.update)(grads, state, params)


def test_composes_with_apply_if_finite_on_float32_gradients():
    params = {"w": jnp.ones((4, 8), BF16)}
    grads = {"w": jnp.full((4, 8), 0.5)}  # float32, as eqx_amp's gradients are
    optimizer = optax.apply_if_finite(
        optax.chain(
            eqx_amp.optim.low_precision_moments(optax.adam(1e-3)),
            eqx_amp.optim.kahan_summation(),
        ),
        5,
    )
    state = optimizer.init(params)
    with jax.numpy_dtype_promotion("standard"):
        update = jax.jit(optimizer.update)
        _, state = update(grads, state, params)
        updates, skipped = update({"w": jnp.full((4, 8), jnp.inf)}, state, params)
    np.testing.assert_array_equal(np.asarray(updates["w"]), 0.0)
    assert int(skipped.notfinite_count) == 1


def test_eight_bit_second_moments_never_round_to_zero():
    # One large value in the block and many tiny ones: each tiny sqrt(nu) must
    # keep at least the smallest code, or its Adam step would be mu / eps.
    second = jnp.concatenate([jnp.ones(1), jnp.full((255,), 1e-17)])
    decoded = jax.vmap(lambda k: _encode_decode(second, "8bit", True, k))(
        jr.split(jr.key(0), 16)
    )
    assert float(jnp.min(decoded)) > 0


def test_eight_bit_blocks_follow_the_last_axis():
    from eqx_amp._optim._codec import encode

    moment = jr.normal(jr.key(0), (4, 512))
    stored = encode(moment, "8bit", False, 256, jr.key(1))
    assert stored.values.shape == (4, 512) and stored.scales.shape == (4, 2)
    kernel = jr.normal(jr.key(0), (8, 4, 3, 3))  # 288 values: one padded run
    stored = encode(kernel, "8bit", False, 256, jr.key(1))
    assert stored.values.shape == (8, 4, 3, 3) and stored.scales.shape == (2,)
    error = jnp.max(jnp.abs(stored.decode() - kernel)) / jnp.max(jnp.abs(kernel))
    assert float(error) < 0.02


def test_low_precision_moments_bad_input():
    with pytest.raises(TypeError, match=r"`low_precision_moments` wraps an optax"):
        eqx_amp.optim.low_precision_moments(1e-3)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=r"`storage` must be one of 'bfloat16', '8bit', but got 'float16'\. "
        r"float16 cannot hold",
    ):
        eqx_amp.optim.low_precision_moments(optax.adam(1e-3), "float16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"but got '4bit'\.$"):
        eqx_amp.optim.low_precision_moments(optax.adam(1e-3), "4bit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`block_size` must be a positive integer"):
        eqx_amp.optim.low_precision_moments(optax.adam(1e-3), "8bit", block_size=0)
    with pytest.raises(TypeError, match=r"needs a PRNG key"):
        eqx_amp.optim.low_precision_moments(optax.adam(1e-3), key=0)  # type: ignore[arg-type]
    optimizer = eqx_amp.optim.low_precision_moments(optax.adam(1e-3))
    with pytest.raises(TypeError, match=r"must be the `LowPrecisionMomentsState`"):
        optimizer.update({"w": jnp.ones(3)}, optax.adam(1e-3).init({"w": jnp.ones(3)}))


#
# Resuming and sharding.
#


def _recipes():
    """(name, start(model) -> (held, opt_state), step) for every form of state."""
    key = jr.key(7)

    def plain(wrap):
        def start(model):
            model = eqx_amp.cast_tree(model, BF16)
            return model, wrap.init(_params(model))

        def step(model, opt_state, grads):
            updates, opt_state = wrap.update(grads, opt_state, _params(model))
            return eqx_amp.optim.apply_updates(model, updates), opt_state

        return start, step

    def master():
        optimizer = eqx_amp.optim.master_weights(optax.adam(1e-2))

        def start(model):
            model = eqx_amp.cast_tree(model, BF16)
            return model, optimizer.init(model)

        def step(model, opt_state, grads):
            updates, opt_state = optimizer.update(grads, opt_state, model)
            return eqx_amp.optim.apply_updates(model, updates), opt_state

        return start, step

    def bimodel(storage):
        optimizer = eqx_amp.optim.low_precision_moments(
            optax.adam(1e-2), storage, key=key
        )

        def start(model):
            bm = eqx_amp.BiModel(model, policy="mixed_bfloat16")
            return bm, optimizer.init(_params(bm.master))

        def step(bm, opt_state, grads):
            updates, opt_state = optimizer.update(grads, opt_state, _params(bm.master))
            return bm.apply_updates(updates), opt_state

        return start, step

    return {
        "master_weights": master(),
        "kahan + bf16 moments": plain(
            optax.chain(
                eqx_amp.optim.low_precision_moments(optax.adam(1e-2)),
                eqx_amp.optim.kahan_summation(),
            )
        ),
        "sr + 8-bit moments": plain(
            optax.chain(
                eqx_amp.optim.low_precision_moments(optax.adam(1e-2), "8bit", key=key),
                eqx_amp.optim.stochastic_rounding(key),
            )
        ),
        "bimodel + bf16 moments": bimodel("bfloat16"),
        "bimodel + 8-bit moments": bimodel("8bit"),
    }


def _runnable(held):
    return held.compute if isinstance(held, eqx_amp.BiModel) else held


def _save_eqx(path, state):
    eqx.tree_serialise_leaves(path / "state.eqx", state)


def _restore_eqx(path, like):
    return eqx.tree_deserialise_leaves(path / "state.eqx", like)


@pytest.mark.parametrize("serialiser", ["tree_serialise_leaves", "orbax"])
@pytest.mark.parametrize("name", list(_recipes()))
def test_state_serialises_and_resumes_bit_exactly(name, serialiser, tmp_path):
    from .test_orbax import restore_with_orbax, save_with_orbax

    save, restore = {
        "tree_serialise_leaves": (_save_eqx, _restore_eqx),
        "orbax": (
            lambda path, state: save_with_orbax(path / "ckpt", state),
            lambda path, like: restore_with_orbax(path / "ckpt", like),
        ),
    }[serialiser]
    start, update = _recipes()[name]
    x, y = _data(jr.key(1))

    @eqx.filter_jit
    def step(held, opt_state):
        grads = eqx.filter_grad(_loss)(_runnable(held), x, y)
        return update(held, opt_state, grads)

    with jax.numpy_dtype_promotion("standard"):
        state = start(_mlp(jr.key(0)))
        for _ in range(3):
            state = step(*state)
        save(tmp_path, state)
        uninterrupted = state
        for _ in range(3):
            uninterrupted = step(*uninterrupted)

        # A state built from other weights: everything must come from the file.
        resumed = restore(tmp_path, start(_mlp(jr.key(99))))
        _assert_bitwise_equal(resumed, state)
        for _ in range(3):
            resumed = step(*resumed)
    _assert_bitwise_equal(resumed, uninterrupted)


_SHARDED = """
import equinox as eqx, jax, jax.numpy as jnp, jax.random as jr, optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import eqx_amp
from tests.test_training_state import _recipes, _loss, _runnable, _mlp

mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
def shard(tree):
    def place(x):
        if not eqx.is_array(x):
            return x
        spec = P("data") if x.ndim and x.shape[0] % 8 == 0 else P()
        return jax.device_put(x, NamedSharding(mesh, spec))
    return jax.tree.map(place, tree)

x = jax.device_put(jr.normal(jr.key(1), (64, 8)), NamedSharding(mesh, P("data")))
y = jax.device_put(jr.normal(jr.key(2), (64, 8)), NamedSharding(mesh, P("data")))
report = {}
for name, (start, update) in _recipes().items():
    @eqx.filter_jit
    def step(held, opt_state):
        grads = eqx.filter_grad(_loss)(_runnable(held), x, y)
        return update(held, opt_state, grads)
    # Every weight split along its first axis (GSPMD may re-lay-out a replicated
    # one as it likes; what is checked is that eqx_amp's state follows its weight).
    held, opt_state = shard(start(_mlp(jr.key(0), out=8)))
    before = [l.sharding for l in jax.tree.leaves((held, opt_state)) if eqx.is_array(l)]
    for _ in range(2):
        held, opt_state = step(held, opt_state)
    after = [l.sharding for l in jax.tree.leaves((held, opt_state)) if eqx.is_array(l)]
    leaves = [l for l in jax.tree.leaves((held, opt_state)) if eqx.is_array(l)]
    report[name] = {
        "same": [a.is_equivalent_to(b, l.ndim) for a, b, l in zip(before, after, leaves)],
        "split": sum(not s.is_fully_replicated for s in after),
    }
"""


_LAST_AXIS = """
# A weight split along its last axis: 8-bit blocks run along that axis, so the
# moments are encoded where they live, with no gather.
w = jax.device_put(jnp.ones((16, 4096)), NamedSharding(mesh, P(None, "data")))
optimizer = eqx_amp.optim.low_precision_moments(optax.adam(1e-3), "8bit")
state = optimizer.init({"w": w})
update = jax.jit(optimizer.update)
hlo = update.lower({"w": w}, state).compile().as_text()
_, new = update({"w": w}, state)
mu = new.inner_state[0].mu["w"]
report["last axis"] = {
    "gathers": hlo.count("all-gather"),
    "values": list(mu.values.sharding.spec),
    "scales": list(mu.scales.sharding.spec),
}
"""


@pytest.mark.slow
def test_sharded_states_keep_their_shardings():
    report = run_script_on_eight_devices(_SHARDED + _LAST_AXIS, promotion="standard")
    last_axis = report.pop("last axis")
    assert last_axis == {
        "gathers": 0,
        "values": [None, "data"],
        "scales": [None, "data"],
    }
    for name, result in report.items():
        assert all(result["same"]), name
        assert result["split"] >= 4, name
