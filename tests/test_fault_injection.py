"""Fault injection in a real training loop: an MLP trained with optax's adam in float16
compute (`filter_amp`) and dynamic loss scaling. Infs and NaNs are injected into the
gradients at chosen steps (the forward value stays finite), and every counter is
checked after every step, the way optax tests `apply_if_finite`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqx_amp


F32 = jnp.dtype(jnp.float32)
STEPS = 14
# step -> the factor the gradients are multiplied by.
INJECTED = {2: jnp.inf, 3: jnp.nan, 7: jnp.nan, 11: -jnp.inf}
PERIOD = 3
INITIAL_SCALE = 2.0**10


@jax.custom_vjp
def poison_grad(x, poison):
    """The identity, whose backward pass multiplies the cotangent by `poison`."""
    return x


def _poison_fwd(x, poison):
    return x, poison


def _poison_bwd(poison, cotangent):
    return cotangent * poison.astype(cotangent.dtype), jnp.zeros_like(poison)


poison_grad.defvjp(_poison_fwd, _poison_bwd)


def loss_fn(model, x, y, poison):
    pred = jax.vmap(eqx_amp.filter_amp(model, policy="mixed_float16"))(x)
    return jnp.mean((poison_grad(pred, poison) - y) ** 2)


grad_fn = eqx_amp.filter_value_and_grad(loss_fn)


def standard_promotion(optim):
    """optax's adam computes `b1 ** count` (Python float, int32), which strict
    promotion (our test setting) rejects; optax is not under test here."""

    def update(updates, state, params=None):
        with jax.numpy_dtype_promotion("standard"):
            return optim.update(updates, state, params)

    return optax.GradientTransformation(optim.init, update)


ADAM = standard_promotion(optax.adam(1e-2))
GUARDED = standard_promotion(optax.apply_if_finite(optax.adam(1e-2), 5))


@eqx.filter_jit
def step_select_tree(model, opt_state, loss_scale, x, y, poison):
    (loss, grads), loss_scale, finite = grad_fn(
        model, x, y, poison, loss_scale=loss_scale
    )
    updates, new_opt_state = ADAM.update(grads, opt_state, model)
    new_model = eqx.apply_updates(model, updates)
    model, opt_state = eqx_amp.select_tree(
        finite, (new_model, new_opt_state), (model, opt_state)
    )
    return model, opt_state, loss_scale, loss, finite


@eqx.filter_jit
def step_apply_if_finite(model, opt_state, loss_scale, x, y, poison):
    (loss, grads), loss_scale, finite = grad_fn(
        model, x, y, poison, loss_scale=loss_scale
    )
    updates, opt_state = GUARDED.update(grads, opt_state, model)
    return eqx.apply_updates(model, updates), opt_state, loss_scale, loss, finite


def _data():
    kx, km = jr.split(jr.key(0))
    x = jr.normal(kx, (32, 4))
    y = jnp.sum(jnp.sin(x), axis=1)
    model = eqx.nn.MLP(4, "scalar", 32, 2, key=km)
    return model, x, y


def _reference_scales(injected, steps, scale, period):
    """(loss_scale, counter) after every step, in plain Python."""
    counter = 0
    out = []
    for step in range(steps):
        if step in injected:
            scale, counter = max(1.0, scale / 2), 0
        else:
            counter += 1
            if counter == period:
                scale, counter = scale * 2, 0
        out.append((scale, counter))
    return out


def _identical(a, b):
    a_leaves, a_def = jax.tree_util.tree_flatten(eqx.filter(a, eqx.is_array))
    b_leaves, b_def = jax.tree_util.tree_flatten(eqx.filter(b, eqx.is_array))
    return a_def == b_def and all(
        np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(a_leaves, b_leaves)
    )


def _adam_count(opt_state):
    counts = [
        s.count
        for s in jax.tree_util.tree_leaves(
            opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState)
        )
        if isinstance(s, optax.ScaleByAdamState)
    ]
    assert len(counts) == 1
    return int(counts[0])


@pytest.mark.parametrize("skip", ["select_tree", "apply_if_finite"])
def test_injected_faults_are_skipped(skip):
    model, x, y = _data()
    params = eqx.filter(model, eqx.is_array)
    if skip == "select_tree":
        step, opt_state = step_select_tree, ADAM.init(params)
    else:
        step, opt_state = step_apply_if_finite, GUARDED.init(params)
    loss_scale = eqx_amp.DynamicLossScale(INITIAL_SCALE, period=PERIOD)
    expected_scales = _reference_scales(INJECTED, STEPS, INITIAL_SCALE, PERIOD)
    losses = []
    applied = 0
    consecutive = 0
    total = 0
    for i in range(STEPS):
        poison = jnp.asarray(INJECTED.get(i, 1.0), F32)
        new = step(model, opt_state, loss_scale, x, y, poison)
        new_model, new_opt_state, loss_scale, loss, finite = new
        losses.append(float(loss))
        injected = i in INJECTED

        # The forward value is finite; the gradients were not.
        assert np.isfinite(float(loss))
        assert bool(finite) is not injected
        assert (
            float(loss_scale.loss_scale),
            int(loss_scale.counter),
        ) == expected_scales[i]
        # No non-finite value ever reaches the parameters or the optimizer state.
        assert bool(eqx_amp.all_finite(new_model))
        assert bool(eqx_amp.all_finite(new_opt_state))
        if injected:
            assert _identical(new_model, model), f"step {i} was not skipped"
            consecutive += 1
            total += 1
        else:
            assert not _identical(new_model, model)
            applied += 1
            consecutive = 0
        assert _adam_count(new_opt_state) == applied
        if skip == "apply_if_finite":
            assert int(new_opt_state.notfinite_count) == consecutive
            assert bool(new_opt_state.last_finite) is not injected
            assert int(new_opt_state.total_notfinite) == total
        else:
            # The optimizer state is exactly the old one on a skipped step.
            assert _identical(new_opt_state, opt_state) is injected
        model, opt_state = new_model, new_opt_state

    # Training recovered: the loss went down despite the faults.
    assert losses[-1] < 0.7 * losses[0]


def test_overflowing_scale_backs_off_until_finite():
    """No injection: a scale far too large for float16 makes the backward pass
    overflow. Steps are skipped and the scale halves until the gradients fit."""
    model, x, y = _data()
    opt_state = ADAM.init(eqx.filter(model, eqx.is_array))
    loss_scale = eqx_amp.DynamicLossScale(2.0**30, period=1000)
    one = jnp.asarray(1.0, F32)
    history = []
    for _ in range(20):
        new_model, opt_state, loss_scale, _, finite = step_select_tree(
            model, opt_state, loss_scale, x, y, one
        )
        history.append((bool(finite), float(loss_scale.loss_scale)))
        assert bool(eqx_amp.all_finite(new_model))
        assert _identical(new_model, model) is not bool(finite)
        model = new_model
    first_finite = next(i for i, (finite, _) in enumerate(history) if finite)
    assert first_finite >= 8
    # Until then, every step is skipped and halves the scale.
    assert history[:first_finite] == [
        (False, 2.0 ** (29 - i)) for i in range(first_finite)
    ]
    assert history[first_finite] == (True, 2.0 ** (30 - first_finite))
    assert sum(finite for finite, _ in history) >= 20 - first_finite - 1


def test_redo_on_nan_finds_the_scale_in_one_call():
    model, x, y = _data()
    redo_fn = eqx.filter_jit(eqx_amp.filter_value_and_grad(loss_fn, redo_on_nan=20))
    one = jnp.asarray(1.0, F32)
    (_, grads), loss_scale, finite = redo_fn(
        model, x, y, one, loss_scale=eqx_amp.DynamicLossScale(2.0**30)
    )
    assert bool(finite)
    assert float(loss_scale.loss_scale) < 2.0**30 and int(loss_scale.counter) == 1
    # It stopped at the first scale that works: twice that one overflows.
    single = eqx_amp.filter_value_and_grad(loss_fn)
    for scale, works in [
        (loss_scale.loss_scale, True),
        (2 * loss_scale.loss_scale, False),
    ]:
        _, _, single_finite = single(
            model, x, y, one, loss_scale=eqx_amp.DynamicLossScale(scale)
        )
        assert bool(single_finite) is works
    ref = eqx.filter_grad(loss_fn)(model, x, y, one)
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref)):
        assert g.dtype == F32
        assert float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) < 1e-2


def test_training_loop_in_lax_scan():
    """The loss scale and the skip decision live in a `lax.scan` carry."""
    model, x, y = _data()
    params, static = eqx.partition(model, eqx.is_array)
    poisons = jnp.asarray([INJECTED.get(i, 1.0) for i in range(STEPS)], F32)

    @jax.jit
    def train(params, opt_state, loss_scale, poisons):
        def body(carry, poison):
            params, opt_state, loss_scale = carry
            model = eqx.combine(params, static)
            model, opt_state, loss_scale, _, finite = step_select_tree(
                model, opt_state, loss_scale, x, y, poison
            )
            params = eqx.filter(model, eqx.is_array)
            out = (
                loss_scale.loss_scale,
                loss_scale.counter,
                finite,
                eqx_amp.all_finite(params),
            )
            return (params, opt_state, loss_scale), out

        return jax.lax.scan(body, (params, opt_state, loss_scale), poisons)

    loss_scale = eqx_amp.DynamicLossScale(INITIAL_SCALE, period=PERIOD)
    (params, opt_state, final), (scales, counters, finite, params_finite) = train(
        params, ADAM.init(params), loss_scale, poisons
    )
    expected = _reference_scales(INJECTED, STEPS, INITIAL_SCALE, PERIOD)
    assert scales.tolist() == [s for s, _ in expected]
    assert counters.tolist() == [c for _, c in expected]
    assert finite.tolist() == [i not in INJECTED for i in range(STEPS)]
    assert params_finite.tolist() == [True] * STEPS
    assert _adam_count(opt_state) == STEPS - len(INJECTED)
    assert float(final.min_loss_scale) == 1.0 and final.period == PERIOD
