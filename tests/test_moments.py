"""`eqx_amp.optim.low_precision_moments`: bfloat16 and 8-bit blockwise moments,
their encodings' error bounds, what is compressed, training like float32."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
import pytest

import eqx_amp
from eqx_amp._optim._codec import block_statistics, encode, encode_zeros
from eqx_amp._optim._moments import _all_zero, _encode_all

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
# Low-precision moments.
#


@functools.partial(jax.jit, static_argnums=(1, 2))
def _encode_decode(x, storage, square_root, key=jr.key(0)):
    # One compile per storage form and shape, instead of every primitive of the
    # encoding dispatched (and compiled) on its own.
    return encode(x, storage, square_root, 256, key).decode()


# The encoding of one moment, jitted: `storage`, `square_root` and `block_size`
# are static.
_encode = jax.jit(encode, static_argnums=(1, 2, 3))


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
    decoded = jax.jit(jax.vmap(lambda k: _encode_decode(x, "bfloat16", False, k)))(
        jr.split(jr.key(1), 64)
    )
    assert abs(float(jnp.mean(decoded)) - 0.3337) < 1e-5
    x = jnp.concatenate([jnp.ones(1), jnp.full((255,), 0.0537)])
    decoded = jax.jit(jax.vmap(lambda k: _encode_decode(x, "8bit", False, k)))(
        jr.split(jr.key(2), 256)
    )
    assert abs(float(jnp.mean(decoded[:, 1:])) - 0.0537) < 2e-4


@eqx.filter_jit
def _train_step(optimizer, model, state, x, y):
    loss, grads = eqx.filter_value_and_grad(mse_loss)(model, x, y)
    updates, state = optimizer.update(grads, state, model)
    return eqx.apply_updates(model, updates), state, loss


def _train(optimizer, model, state, x, y, steps=100):
    # One compile per optimizer: the step is jitted once, outside the loop.
    for _ in range(steps):
        model, state, loss = _train_step(optimizer, model, state, x, y)
    return model, state, float(loss)


@functools.cache
def _adam_reference_run():
    """100 steps of float32 Adam on the small MLP: the model and its last loss
    (run once for both storages)."""
    model = small_mlp(jr.key(0))
    x, y = regression_data(jr.key(1))
    reference = optax.adam(3e-3)
    with jax.numpy_dtype_promotion("standard"):
        ref_model, _, ref_loss = _train(
            reference, model, reference.init(float_params(model)), x, y
        )
    return ref_model, ref_loss


@pytest.mark.parametrize(
    "storage", [pytest.param("bfloat16", marks=pytest.mark.slow), "8bit"]
)
def test_low_precision_moments_train_like_float32_moments(storage):
    model = small_mlp(jr.key(0))
    x, y = regression_data(jr.key(1))
    compressed = eqx_amp.optim.low_precision_moments(optax.adam(3e-3), storage)
    states = [o.init(float_params(model)) for o in (optax.adam(3e-3), compressed)]
    moments = [
        leaf
        for leaf in jtu.tree_leaves(
            states[1], is_leaf=lambda n: isinstance(n, eqx_amp.optim.QuantizedMoment)
        )
        if isinstance(leaf, eqx_amp.optim.QuantizedMoment)
    ]
    assert len(moments) == 2 * len(jtu.tree_leaves(float_params(model)))
    expected = BF16 if storage == "bfloat16" else jnp.uint8
    assert all(m.values.dtype == expected for m in moments)
    assert sum(m.square_root for m in moments) == len(moments) // 2

    ref_model, ref_loss = _adam_reference_run()
    with jax.numpy_dtype_promotion("standard"):
        low_model, low_state, low_loss = _train(compressed, model, states[1], x, y)
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

    def nbytes(optimizer):
        # The state's shapes and dtypes, traced without compiling or running the
        # encoding of a quarter of a million zeros.
        state = jax.eval_shape(optimizer.init, params)
        return sum(x.size * x.dtype.itemsize for x in jtu.tree_leaves(state))

    plain = nbytes(optax.adamw(1e-3))
    bf16 = nbytes(eqx_amp.optim.low_precision_moments(optax.adamw(1e-3)))
    int8 = nbytes(eqx_amp.optim.low_precision_moments(optax.adamw(1e-3), "8bit"))
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
    update = jax.jit(optimizer.update)
    with jax.numpy_dtype_promotion("standard"):
        for _ in range(3):
            updates, state = update(grads, state)
    np.testing.assert_allclose(np.asarray(updates.nu), 0.1, rtol=0.05)

    # Accumulated gradients, slow weights: per-weight state that is not a moment.
    accumulating = eqx_amp.optim.low_precision_moments(
        optax.MultiSteps(optax.adam(1e-3), 4), "8bit"
    )
    # (Abstractly: the state's structure and dtypes, without running the encodings.)
    state = jax.eval_shape(accumulating.init, {"w": jnp.ones((4, 8))})
    assert state.inner_state.acc_grads["w"].dtype == jnp.float32
    assert isinstance(
        state.inner_state.inner_opt_state[0].mu["w"], eqx_amp.optim.QuantizedMoment
    )
    schedule_free = eqx_amp.optim.low_precision_moments(
        optax.contrib.schedule_free_adamw(1e-3), "8bit"
    )
    state = jax.eval_shape(schedule_free.init, {"w": jnp.ones((4, 8))})
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


class _Counted(eqx.Module):
    """A model as users pass it: floating weights, an integer array and the MLP's
    activation functions."""

    mlp: eqx.nn.MLP
    seen: jax.Array

    def __call__(self, x):
        return self.mlp(x)


def _moments(state):
    is_moment = lambda n: isinstance(n, eqx_amp.optim.QuantizedMoment)
    return [m for m in jtu.tree_leaves(state, is_leaf=is_moment) if is_moment(m)]


@pytest.mark.parametrize("storage", ["bfloat16", "8bit"])
def test_low_precision_moments_and_master_weights_wrap_each_other(storage):
    # The whole model goes to `init`: outside `master_weights`, the moments are
    # shaped like its floating leaves, with `None` at the integer array and the
    # activation functions, and must still be found and compressed.
    # One hidden layer: each weight's moments are one 8-bit block, and each leaf
    # adds its own encodings to the compiles of the two steps.
    mlp = eqx_amp.cast_tree(eqx.nn.MLP(8, 4, 32, 1, key=jr.key(0)), BF16)
    model = _Counted(mlp, jnp.zeros((), jnp.int32))
    x, y = regression_data(jr.key(1))
    lpm, master = eqx_amp.optim.low_precision_moments, eqx_amp.optim.master_weights
    outside = lpm(master(optax.adam(3e-3)), storage)
    inside = master(lpm(optax.adam(3e-3), storage))
    forms = [
        (outside, outside.init(model)),
        (inside, inside.init(model)),
        (outside, outside.init(float_params(model))),
    ]
    weights = sum(w.size for w in jtu.tree_leaves(float_params(model)))
    expected = BF16 if storage == "bfloat16" else jnp.uint8
    for _, state in forms:
        moments = _moments(state)
        assert len(moments) == 2 * len(jtu.tree_leaves(float_params(model)))
        assert all(m.values.dtype == expected for m in moments)
        moment_bytes = sum(x.nbytes for x in jtu.tree_leaves(moments))
        if storage == "bfloat16":
            assert moment_bytes / weights == 4
        else:  # 1 byte per value, plus 8 bytes per (padded) block of each moment
            assert 2 < moment_bytes / weights < 2.5

    @eqx.filter_jit
    def step(optimizer, model, state):
        grads = eqx.filter_grad(mse_loss)(model, x, y)
        updates, state = optimizer.update(grads, state, model)
        return eqx_amp.optim.apply_updates(model, updates), state

    trained = []
    for optimizer, state in forms:
        m = model
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction
            for _ in range(20):
                m, state = step(optimizer, m, state)
        trained.append(m)
    # The same moments, rounded with the same keys in the same order: bit for bit.
    assert_bitwise_equal(trained[0], trained[1])
    assert_bitwise_equal(trained[0], trained[2])
    assert float(mse_loss(trained[0], x, y)) < float(mse_loss(model, x, y))


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
    decoded = jax.jit(jax.vmap(lambda k: _encode_decode(second, "8bit", True, k)))(
        jr.split(jr.key(0), 16)
    )
    assert float(jnp.min(decoded)) > 0


def test_eight_bit_blocks_follow_the_last_axis():
    moment = jr.normal(jr.key(0), (4, 512))
    stored = _encode(moment, "8bit", False, 256, jr.key(1))
    assert stored.values.shape == (4, 512) and stored.scales.shape == (4, 2)
    kernel = jr.normal(jr.key(0), (8, 4, 3, 3))  # 288 values: one padded run
    stored = _encode(kernel, "8bit", False, 256, jr.key(1))
    assert stored.values.shape == (8, 4, 3, 3) and stored.scales.shape == (2,)
    decoded = eqx.filter_jit(lambda stored: stored.decode())(stored)
    error = jnp.max(jnp.abs(decoded - kernel)) / jnp.max(jnp.abs(kernel))
    assert float(error) < 0.02


@functools.partial(jax.jit, static_argnums=1)
def _block_statistics(moments, square_roots):
    return block_statistics(list(zip(moments, square_roots)), 256)


def test_eight_bit_block_statistics_in_one_pass():
    # One reduction finds each block's largest element (a NaN above every number,
    # the first of equals), its signed value and the largest finite magnitude of
    # the rest (a second inf or NaN is stored as the largest is), for several
    # moments at once: as an argmax and a max of the rest would.
    rng = np.random.default_rng(0)
    mu = rng.integers(-3, 4, (6, 512)).astype(np.float32)  # many ties
    mu[0, 5], mu[0, 9], mu[1, 300] = np.nan, np.nan, np.inf
    mu[2, :256] = -0.0
    mu[3, 17] = -7.0
    nu = (mu * mu)[::-1].copy()
    together = _block_statistics((mu, nu), (False, True))
    alone = [_block_statistics((x,), (r,))[0] for x, r in ((mu, False), (nu, True))]
    for a, b in zip(together, alone):
        assert_bitwise_equal(a, b)
    for stats, x in zip(together, (mu, np.sqrt(nu))):
        blocks = x.reshape(6, 2, 256)
        ranking = np.where(np.isnan(blocks), np.inf, np.abs(blocks))
        index = np.argmax(ranking, axis=-1)
        outlier = np.take_along_axis(blocks, index[..., None], -1)[..., 0]
        rest = np.abs(blocks)
        np.put_along_axis(rest, index[..., None], 0.0, -1)
        rest = np.where(np.isfinite(rest), rest, 0.0)
        np.testing.assert_array_equal(stats.index, index)
        np.testing.assert_array_equal(stats.outlier, outlier + 0.0)  # -0.0 -> 0.0
        np.testing.assert_array_equal(stats.second, np.max(rest, axis=-1))
    assert int(together[0].index[3, 0]) == 17 and float(together[0].outlier[3, 0]) == -7
    # A block of -0.0 keeps a +0.0 outlier, as a sum of it with zeros would.
    assert not np.signbit(np.asarray(together[0].outlier[2, 0]))


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
    for not_a_size in (True, np.True_, 64.0):
        with pytest.raises(ValueError, match=r"`block_size` must be a positive"):
            eqx_amp.optim.low_precision_moments(
                optax.adam(1e-3), "8bit", block_size=not_a_size
            )
    # A NumPy integer is an integer.
    state = eqx_amp.optim.low_precision_moments(
        optax.adam(1e-3), "8bit", block_size=np.int64(64)
    ).init({"w": jnp.zeros((2, 128))})
    assert state.inner_state[0].mu["w"].block_size == 64
    with pytest.raises(TypeError, match=r"needs a PRNG key"):
        eqx_amp.optim.low_precision_moments(optax.adam(1e-3), key=0)  # type: ignore[arg-type]
    optimizer = eqx_amp.optim.low_precision_moments(optax.adam(1e-3))
    with pytest.raises(TypeError, match=r"must be the `LowPrecisionMomentsState`"):
        optimizer.update({"w": jnp.ones(3)}, optax.adam(1e-3).init({"w": jnp.ones(3)}))


@pytest.mark.parametrize("storage", ["bfloat16", "8bit"])
def test_zero_moments_encode_as_encode_would_with_any_key(storage):
    """An optimizer's initial moments are zeros: `init` encodes them from their
    shape (`encode_zeros`, which compiles at once) and gets `encode`'s arrays bit for
    bit, whatever the key: blocks along the last axis, through the flattened moment
    with a partial last block, one block, 3-d."""
    shapes = [(1,), (5,), (256,), (513,), (3, 512), (7, 300), (2, 3, 64)]
    for shape in shapes:
        for square_root in (False, True):
            for block_size in (64, 256):
                zeros = jnp.zeros(shape)
                made = jax.jit(encode_zeros, static_argnums=(1, 2, 3))(
                    zeros, storage, square_root, block_size
                )
                for seed in range(3):
                    encoded = eqx.filter_jit(encode)(
                        zeros, storage, square_root, block_size, jr.key(seed)
                    )
                    assert_bitwise_equal(made, encoded)


def test_only_concrete_positive_zero_moments_take_the_shortcut():
    moments = [jnp.zeros((4, 16)), jnp.ones((4, 16)), jnp.zeros((3,)).at[1].set(-0.0)]
    moments.append(jnp.zeros((2, 2)).at[0, 0].set(jnp.nan))
    assert _all_zero(moments) == (True, False, False, False)
    assert _all_zero([]) == ()
    # Under a trace the values are unknown: every moment is encoded.
    traced = jax.jit(lambda m: jnp.asarray(_all_zero([m, m])))(jnp.zeros((4,)))
    assert not bool(traced.any())


def test_init_keeps_what_is_not_zero():
    # An optimizer whose second moment starts at 0.1 (Adagrad's accumulator): its
    # moments are encoded, not taken for zeros.
    params = {"w": jnp.ones((8, 256))}
    for storage in ("bfloat16", "8bit"):
        optimizer = eqx_amp.optim.low_precision_moments(
            optax.adagrad(0.1, initial_accumulator_value=0.1), storage
        )
        state = optimizer.init(params)
        (stored,) = [
            leaf
            for leaf in jax.tree.leaves(
                state, is_leaf=lambda x: isinstance(x, eqx_amp.optim.QuantizedMoment)
            )
            if isinstance(leaf, eqx_amp.optim.QuantizedMoment)
        ]
        assert jnp.allclose(stored.decode(), 0.1, rtol=0.02)


@pytest.mark.parametrize("storage", ["8bit", "bfloat16"])
def test_moments_of_one_shape_are_encoded_together_bit_for_bit(storage):
    """`init` encodes the moments of one shape and kind with one batched encode (its
    program grows with the distinct shapes, not the layers): the codes are each
    moment's own encode's, an inf and an all-zero moment included."""
    moments = [jr.normal(jr.key(i), (24, 40)) * 10.0 ** (i - 2) for i in range(4)]
    moments[1] = moments[1].at[3, 4].set(jnp.inf)
    moments += [jnp.abs(jr.normal(jr.key(9), (37,)))] * 3 + [jnp.zeros((7, 5))]
    moments += [jnp.zeros((7, 5)).at[2, 3].set(-0.0)]
    square_roots = (False, True, False, True, True, True, True, False, False)
    moments = [jnp.abs(m) if r else m for m, r in zip(moments, square_roots)]
    keys = list(jr.split(jr.key(5), len(moments)))
    all_zero = _all_zero(moments)
    # A -0.0 is not +0: `encode` keeps its sign.
    assert all_zero == (False,) * 7 + (True, False)
    together = _encode_all(moments, square_roots, keys, storage, 256, all_zero)
    for moment, root, key, got in zip(moments, square_roots, keys, together):
        alone = eqx.filter_jit(encode)(moment, storage, root, 256, key)
        assert jtu.tree_structure(got) == jtu.tree_structure(alone)
        for a, b in zip(jtu.tree_leaves(got), jtu.tree_leaves(alone)):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert bool(jnp.array_equal(a, b, equal_nan=True))
