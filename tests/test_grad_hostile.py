"""Hostile inputs for the loss-scaled gradients (`filter_value_and_grad`,
`filter_grad`, `scaled_value_and_grad`, `scaled_grad`, a `BiModel` as the
differentiated argument), with and
without `redo_on_nan`.

The matrix: a differentiated argument with no array leaves (`{}`, `None`,
`eqx.nn.Identity()`, a `BiModel` of one), one whose arrays are all integer, boolean
or PRNG keys, empty and scalar leaves, and a loss that does not depend on the
argument at all (a constant, which JAX folds into a literal). Every case must give
the gradients' structure (`None` or empty where there is nothing to differentiate),
a finite flag that is a boolean array, and the loss, at once or after the
`lax.while_loop` of `redo_on_nan`; and `all_finite` must take empty trees.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
import pytest

import eqx_amp


def _loss(tree, x):
    del tree
    return jnp.sum(x**2)


def _constant_loss(tree, x):
    del tree, x
    return jnp.asarray(2.0)


_NO_ARRAYS = {
    "empty dict": {},
    "None": None,
    "Identity": eqx.nn.Identity(),
    "ints, bools and a key": {
        "i": jnp.arange(3),
        "b": jnp.ones(2, bool),
        "k": jr.key(0),
    },
    "empty array": {"w": jnp.zeros((0, 3))},
}


def _check(value, grads, finite, tree, expected_loss):
    assert isinstance(finite, jax.Array) and finite.dtype == jnp.bool_
    assert finite.shape == () and bool(finite)
    np.testing.assert_allclose(np.asarray(value), expected_loss)
    assert jtu.tree_structure(grads) == jtu.tree_structure(
        eqx.filter(tree, eqx.is_inexact_array)
    )


@pytest.mark.parametrize("redo", [0, 2])
@pytest.mark.parametrize("name", list(_NO_ARRAYS))
def test_filter_value_and_grad_of_no_arrays(name, redo):
    tree = _NO_ARRAYS[name]
    x = jnp.arange(3.0)
    for loss, expected in ((_loss, 5.0), (_constant_loss, 2.0)):
        fn = eqx_amp.filter_value_and_grad(loss, redo_on_nan=redo)
        (value, grads), scale, finite = fn(
            tree, x, loss_scale=eqx_amp.DynamicLossScale()
        )
        _check(value, grads, finite, tree, expected)
        assert float(scale.loss_scale) == 2.0**15
        grads, _, finite = eqx_amp.filter_grad(loss, redo_on_nan=redo)(
            tree, x, loss_scale=eqx_amp.DynamicLossScale()
        )
        _check(value, grads, finite, tree, expected)


def test_redo_on_nan_with_a_constant_loss_of_real_weights():
    # A loss that does not read the weights: zero gradients, traced as literals.
    weights = {"w": jnp.ones((2, 3)), "s": jnp.ones(())}
    fn = eqx_amp.filter_value_and_grad(_constant_loss, redo_on_nan=3)
    (value, grads), _, finite = jax.jit(
        lambda w: fn(w, jnp.ones(3), loss_scale=eqx_amp.DynamicLossScale())
    )(weights)
    _check(value, grads, finite, weights, 2.0)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jtu.tree_leaves(grads))


@pytest.mark.parametrize("redo", [0, 2])
def test_scaled_value_and_grad_of_no_arrays(redo):
    optimizer = eqx_amp.loss_scaling(optax.sgd(1e-2))
    state = optimizer.init({})
    fn = eqx_amp.scaled_value_and_grad(_loss, redo_on_nan=redo)
    (value, grads), new_state = fn({}, jnp.arange(3.0), opt_state=state)
    assert grads == {} and float(value) == 5.0
    grads_only, _ = eqx_amp.scaled_grad(_loss, redo_on_nan=redo)(
        {}, jnp.arange(3.0), opt_state=state
    )
    assert grads_only == {}
    updates, new_state = optimizer.update(grads, new_state, {})
    assert updates == {} and bool(new_state.last_finite)


@pytest.mark.parametrize("redo", [0, 2])
def test_bimodel_of_a_model_without_arrays(redo):
    bimodel = eqx_amp.BiModel(eqx.nn.Identity(), policy="mixed_bfloat16")

    def loss(model, x):
        return jnp.sum(model(x).astype(jnp.float32) ** 2)

    (value, grads), scale, finite = eqx_amp.filter_value_and_grad(
        loss, redo_on_nan=redo
    )(bimodel, jnp.arange(3.0), loss_scale=eqx_amp.DynamicLossScale())
    assert bool(finite) and finite.dtype == jnp.bool_
    assert float(value) == 5.0 and jtu.tree_leaves(grads) == []
    assert float(scale.loss_scale) == 2.0**15
    assert bimodel.apply_updates(grads).master == bimodel.master


def test_all_finite_and_select_tree_of_empty_trees():
    for tree in ({}, None, (), [None, {}], eqx.nn.Identity()):
        finite = eqx_amp.all_finite(tree)
        assert finite.dtype == jnp.bool_ and finite.shape == () and bool(finite)
        assert eqx_amp.select_tree(finite, tree, tree) == tree
