"""`loss_scaling`, `scaled_value_and_grad` and `scaled_grad`: loss scaling kept in the
optimizer state (the short float16 form)."""

import difflib
import functools as ft
import pathlib
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqx_amp

from .helpers import float_dtypes


F32 = jnp.dtype(jnp.float32)
GUIDE = pathlib.Path(__file__).resolve().parent.parent / "docs/guides/loss-scaling.md"


def _guide_block(marker: str) -> str:
    text = GUIDE.read_text()
    match = re.search(rf"<!-- {marker} -->\n```python[^\n]*\n(.*?)```", text, re.DOTALL)
    assert match, f"{GUIDE.name} has no block marked {marker}"
    return match.group(1)


def test_float16_loop_is_three_lines_from_float32_and_trains():
    fp32, fp16 = _guide_block("fp32-loop"), _guide_block("fp16-loop")
    diff = difflib.unified_diff(fp32.splitlines(), fp16.splitlines(), lineterm="", n=0)
    changed = [
        line for line in diff if line.startswith("+") and not line.startswith("+++")
    ]
    assert len(changed) <= 3, changed
    results = {}
    for name, source in (("fp32", fp32), ("fp16", fp16)):
        namespace: dict = {}
        # As users run it: optax.adam's `decay**count` needs standard promotion.
        with jax.numpy_dtype_promotion("standard"):
            exec(compile(source, f"{GUIDE.name}:{name}", "exec"), namespace)
        results[name] = namespace
    loss16, loss32 = float(results["fp16"]["loss"]), float(results["fp32"]["loss"])
    assert np.isfinite(loss16) and abs(loss16 - loss32) < 0.05 + 0.2 * loss32
    opt_state = results["fp16"]["opt_state"]
    assert isinstance(opt_state, eqx_amp.optim.LossScalingState)
    assert float_dtypes(eqx.filter(results["fp16"]["model"], eqx.is_array)) == {F32}


def _problem(getkey):
    model = eqx.nn.MLP(4, "scalar", 16, 1, key=getkey())
    x = jr.normal(getkey(), (32, 4))
    y = jnp.sum(x, axis=1)
    return model, x, y


def _mse(model, x, y, poison=1.0):
    pred = jax.vmap(eqx_amp.filter_amp(model, policy="mixed_float16"))(x)
    return jnp.mean((pred - y) ** 2) * poison


def test_non_finite_steps_are_skipped_and_counted_like_apply_if_finite(getkey):
    """NaN gradients at chosen steps: the model and the wrapped optimizer's state
    (its count, so its schedule) do not move, the scale halves, counters count."""
    model, x, y = _problem(getkey)
    schedule = optax.linear_schedule(1e-2, 0.0, 10)
    optim = eqx_amp.loss_scaling(
        optax.adam(schedule), eqx_amp.DynamicLossScale(2.0**10)
    )
    opt_state = optim.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, opt_state, poison):
        (loss, grads), opt_state = eqx_amp.scaled_value_and_grad(_mse)(
            model, x, y, poison, opt_state=opt_state
        )
        with jax.numpy_dtype_promotion("standard"):  # optax.adam's decay**count
            updates, opt_state = optim.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    poisoned = {2, 3, 6}
    finite_steps = 0
    for i in range(8):
        before = model
        model, opt_state, _ = step(model, opt_state, jnp.nan if i in poisoned else 1.0)
        if i in poisoned:
            assert eqx.tree_equal(model, before)
        else:
            finite_steps += 1
        assert int(opt_state.inner_state[0].count) == finite_steps  # schedule step
        assert bool(opt_state.last_finite) == (i not in poisoned)
    assert int(opt_state.total_notfinite) == 3
    assert int(opt_state.notfinite_count) == 0
    assert float(opt_state.loss_scale.loss_scale) == 2.0**10 / 2**3


def test_matches_the_explicit_form(getkey):
    model, x, y = _problem(getkey)
    scale = eqx_amp.DynamicLossScale(2.0**12)
    opt_state = eqx_amp.loss_scaling(optax.sgd(0.1), scale).init(model)
    (loss, grads), new_state = eqx_amp.scaled_value_and_grad(_mse)(
        model, x, y, opt_state=opt_state
    )
    (ref_loss, ref_grads), _, _ = eqx_amp.filter_value_and_grad(_mse)(
        model, x, y, loss_scale=scale
    )
    assert loss == ref_loss and eqx.tree_equal(grads, ref_grads)
    assert float_dtypes(grads) == {F32}
    # The state comes back with the scale that produced the gradients.
    assert eqx.tree_equal(new_state, opt_state)
    grads_only, _ = eqx_amp.scaled_grad(_mse)(model, x, y, opt_state=opt_state)
    assert eqx.tree_equal(grads_only, ref_grads)


def test_redo_on_nan_returns_the_state_with_the_scale_that_worked(getkey):
    model, x, y = _problem(getkey)
    too_large = eqx_amp.DynamicLossScale(2.0**60)  # float16 gradients overflow
    optim = eqx_amp.loss_scaling(optax.adam(1e-3), too_large)
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    grad_fn = eqx_amp.scaled_value_and_grad(_mse, redo_on_nan=60)
    (loss, grads), opt_state = eqx.filter_jit(grad_fn)(model, x, y, opt_state=opt_state)
    assert eqx_amp.all_finite(grads)
    worked = float(opt_state.loss_scale.loss_scale)
    assert worked < 2.0**60
    with jax.numpy_dtype_promotion("standard"):  # optax.adam's decay**count
        _, opt_state = optim.update(grads, opt_state, model)
    assert float(opt_state.loss_scale.loss_scale) == worked  # finite: kept
    # Compiled once: one while loop, the model's matmuls not repeated per try.
    lowered = eqx.filter_jit(lambda m, s: grad_fn(m, x, y, opt_state=s))
    text = lowered.lower(model, opt_state).as_text()
    assert text.count("stablehlo.while") == 1


def test_composes_with_multisteps_and_chain_and_checkpoints(getkey, tmp_path):
    model, x, y = _problem(getkey)
    inner = optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), 2
    )
    optim = eqx_amp.loss_scaling(inner)
    params = eqx.filter(model, eqx.is_array)
    opt_state = optim.init(params)

    @eqx.filter_jit
    def step(model, opt_state):
        (loss, grads), opt_state = eqx_amp.scaled_value_and_grad(_mse)(
            model, x, y, opt_state=opt_state
        )
        with jax.numpy_dtype_promotion("standard"):  # optax.adam's decay**count
            params = eqx.filter(model, eqx.is_array)
            updates, opt_state = optim.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    first_loss = None
    for _ in range(6):
        model, opt_state, loss = step(model, opt_state)
        first_loss = loss if first_loss is None else first_loss
    assert float(loss) < float(first_loss)
    path = tmp_path / "state.eqx"
    eqx.tree_serialise_leaves(path, (model, opt_state))
    like = (model, optim.init(eqx.filter(model, eqx.is_array)))
    restored_model, restored_state = eqx.tree_deserialise_leaves(path, like)
    assert eqx.tree_equal(restored_state, opt_state)
    # Resuming gives the same next step, bit for bit.
    a = step(model, opt_state)
    b = step(restored_model, restored_state)
    assert eqx.tree_equal(a, b)


def test_bad_inputs(getkey):
    model, x, y = _problem(getkey)
    with pytest.raises(
        TypeError, match=r"`loss_scaling` wraps an optax optimizer.*got int"
    ):
        eqx_amp.loss_scaling(3)
    with pytest.raises(
        TypeError, match=r"`loss_scale` must be an `eqx_amp.AbstractLossScale`"
    ):
        eqx_amp.loss_scaling(optax.adam(1e-3), 2.0**15)
    with pytest.raises(TypeError, match=r"`axis_name` must be the \(hashable\) name"):
        eqx_amp.loss_scaling(optax.adam(1e-3), axis_name=["data"])
    plain_state = optax.adam(1e-3).init(eqx.filter(model, eqx.is_array))
    grad_fn = eqx_amp.scaled_value_and_grad(_mse)
    with pytest.raises(ValueError, match=r"holds no `eqx_amp.optim.LossScalingState`"):
        grad_fn(model, x, y, opt_state=plain_state)
    optim = eqx_amp.loss_scaling(optax.adam(1e-3))
    params = eqx.filter(model, eqx.is_array)
    two = (optim.init(params), optim.init(params))
    with pytest.raises(ValueError, match=r"holds 2 `eqx_amp.optim.LossScalingState`s"):
        grad_fn(model, x, y, opt_state=two)
    with pytest.raises(TypeError, match=r"must be called with an `opt_state` keyword"):
        grad_fn(model, x, y)
    with pytest.raises(TypeError, match=r"must be called with an `opt_state` keyword"):
        eqx_amp.scaled_grad(_mse)(model, x, y)
    for transform in (eqx_amp.scaled_value_and_grad, eqx_amp.scaled_grad):
        name = transform.__name__
        with pytest.raises(TypeError, match=rf"`fun` must be callable.*`{name}"):
            transform(3)
        with pytest.raises(ValueError, match=r"`redo_on_nan` must be 0 or more"):
            transform(_mse, redo_on_nan=-1)
        with pytest.raises(ValueError, match=r"`redo_on_nan` must be 0 or more"):
            transform(redo_on_nan=-1)
        with pytest.raises(TypeError, match=r"`has_aux` must be a bool"):
            transform(has_aux="yes")
    with pytest.raises(
        TypeError, match=r"must be the `LossScalingState` its `init` made"
    ):
        optim.update(params, plain_state, params)


def test_states_own_their_buffers_so_steps_can_donate_them(getkey):
    """Two leaves of one state sharing a buffer (or a state sharing one with the
    loss scale it was given) break a step that donates the optimizer state."""
    model = eqx.nn.Linear(3, 2, key=getkey())
    optimizer = eqx_amp.loss_scaling(optax.sgd(0.1))
    first, second = optimizer.init(model), optimizer.init(model)
    leaves = [x for x in jax.tree_util.tree_leaves((first, second)) if eqx.is_array(x)]
    pointers = [x.unsafe_buffer_pointer() for x in leaves]
    assert len(set(pointers)) == len(pointers)

    @ft.partial(eqx.filter_jit, donate="all")
    def step(model, opt_state, x):
        (loss, grads), opt_state = eqx_amp.scaled_value_and_grad(
            lambda m, x: jnp.sum(m(x) ** 2)
        )(model, x, opt_state=opt_state)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state

    x = jnp.ones(3)
    for _ in range(2):
        model, first = step(model, first, x)
    # The other state was not touched by the donations.
    assert int(second.notfinite_count) == 0


def test_update_takes_optax_keyword_names():
    # optax's protocol: `update(updates, state, params)`; callers may use keywords.
    params = {"w": jnp.ones(3)}
    optim = eqx_amp.loss_scaling(optax.sgd(0.1))
    state = optim.init(params)
    with jax.numpy_dtype_promotion("standard"):
        updates, _ = optim.update(
            updates={"w": jnp.ones(3)}, state=state, params=params
        )
    np.testing.assert_allclose(updates["w"], -0.1 * np.ones(3))


def test_short_form_as_decorators_with_aux_and_a_bimodel(getkey):
    """`@scaled_value_and_grad` and `@scaled_grad(has_aux=True)` on a plain model and
    on a `BiModel` (differentiated through its compute copy), against the explicit
    form; one return shape whatever the options."""
    model, x, y = _problem(getkey)
    optim = eqx_amp.loss_scaling(optax.sgd(0.1), eqx_amp.DynamicLossScale(2.0**8))

    @eqx_amp.scaled_value_and_grad
    def loss_fn(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    @eqx_amp.scaled_grad(has_aux=True, redo_on_nan=2)
    def grad_fn(model, x, y):
        pred = jax.vmap(model)(x)
        return jnp.mean((pred - y) ** 2), pred.dtype

    bimodel = eqx_amp.BiModel(model, policy="mixed_float16")
    for target in (eqx_amp.filter_amp(model, policy="mixed_float16"), bimodel):
        params = target.master if target is bimodel else model
        opt_state = optim.init(eqx.filter(params, eqx.is_inexact_array))
        (loss, grads), new_state = eqx.filter_jit(loss_fn)(
            target, x, y, opt_state=opt_state
        )
        (grads2, aux), _ = grad_fn(target, x, y, opt_state=opt_state)
        assert isinstance(new_state, eqx_amp.optim.LossScalingState)
        assert aux == F32 and loss.dtype == F32  # the output dtype of the policy
        assert float_dtypes(grads) == {F32}
        assert eqx.tree_equal(
            jax.tree_util.tree_structure(grads2), jax.tree_util.tree_structure(grads)
        )
        (ref_loss, ref_grads), _, _ = eqx_amp.filter_value_and_grad(
            lambda m, x, y: jnp.mean((jax.vmap(m)(x) - y) ** 2)
        )(target, x, y, loss_scale=eqx_amp.DynamicLossScale(2.0**8))
        assert loss == ref_loss and eqx.tree_equal(grads, ref_grads)
    # The BiModel's gradients have the master's structure, in float32.
    assert jax.tree_util.tree_structure(
        eqx.filter(grads, eqx.is_array)
    ) == jax.tree_util.tree_structure(eqx.filter(bimodel.master, eqx.is_inexact_array))


def test_skipping_selects_per_leaf_off_a_cpu():
    """On GPUs and TPUs the skip is a select per leaf, not a `lax.cond`, whose
    outputs XLA's GPU partitioner replicates (an FSDP state gathered every step);
    on a CPU it is one cond, and both skip alike."""
    params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
    optim = eqx_amp.loss_scaling(optax.sgd(0.1), eqx_amp.DynamicLossScale(2.0**10))
    state = optim.init(params)

    def update(grads, state):
        return optim.update(grads, state, params)

    def selects(platform):
        exported = jax.export.export(jax.jit(update), platforms=[platform])
        return exported(params, state).mlir_module().count("stablehlo.select ")

    # The loss scale's own adjustment selects on every platform; off a CPU, each
    # update and each optimizer-state leaf is one more.
    on_cpu = selects("cpu")
    leaves = len(jax.tree_util.tree_leaves((params, state.inner_state)))
    assert selects("cuda") == selects("tpu") == on_cpu + leaves
    nan = jax.tree_util.tree_map(lambda x: x * jnp.nan, params)
    updates, new_state = jax.jit(update)(nan, state)
    assert all(
        float(jnp.abs(u).max()) == 0.0 for u in jax.tree_util.tree_leaves(updates)
    )
    assert not bool(new_state.last_finite)
