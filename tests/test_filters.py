import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqx_amp

from .helpers import float_dtypes


class _Block(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    rms: eqx.nn.RMSNorm
    group: eqx.nn.GroupNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.linear = eqx.nn.Linear(4, 4, key=k1)
        self.norm = eqx.nn.LayerNorm(4)
        self.rms = eqx.nn.RMSNorm(4)
        self.group = eqx.nn.GroupNorm(2, 4)
        self.head = eqx.nn.Linear(4, 2, key=k2)


def test_default_filter_spec_keeps_norm_layers(getkey):
    block = _Block(getkey())
    spec = eqx_amp.default_filter_spec(block)
    assert spec.norm is False and spec.rms is False and spec.group is False
    assert spec.linear.weight is True and spec.head.bias is True
    cast = eqx_amp.cast_tree(block, jnp.bfloat16, spec)
    assert cast.linear.weight.dtype == jnp.bfloat16
    assert cast.norm.weight.dtype == jnp.float32
    assert cast.rms.weight.dtype == jnp.float32
    assert cast.group.weight.dtype == jnp.float32


def test_default_filter_spec_keeps_batchnorm_and_state(getkey):
    model, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(
        4, axis_name="batch", mode="batch"
    )
    assert eqx_amp.default_filter_spec(model) is False
    assert eqx_amp.default_filter_spec(state) is False
    tree = {"state": state, "x": jnp.ones(2)}
    cast = eqx_amp.cast_tree(tree, jnp.float16, eqx_amp.default_filter_spec(tree))
    assert cast["x"].dtype == jnp.float16
    assert float_dtypes(cast["state"]) == {jnp.dtype(jnp.float32)}


def test_keep_types_and_predicates(getkey):
    block = _Block(getkey())
    spec = eqx_amp.keep(block, eqx.nn.Linear)
    assert spec.linear is False and spec.head is False and spec.norm is False

    spec = eqx_amp.keep(block, lambda m: m is block.head)
    assert spec.head is False
    assert spec.linear.weight is True
    assert spec.norm is False  # the default still applies

    assert eqx_amp.keep(block) == eqx_amp.default_filter_spec(block)


def test_keep_bad_inputs(getkey):
    block = _Block(getkey())
    with pytest.raises(
        TypeError, match=r"`keep` takes module types or predicates.*got 3"
    ):
        eqx_amp.keep(block, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got 'LayerNorm'"):
        eqx_amp.keep(block, "LayerNorm")  # type: ignore[arg-type]


def test_keep_a_submodule_instance(getkey):
    block = _Block(getkey())
    spec = eqx_amp.keep(block, block.head)
    assert spec.head is False
    assert spec.linear.weight is True and spec.linear.bias is True
    assert (
        eqx_amp.filter_amp(block.head, filter_spec=False)(jnp.ones(4)).dtype
        == jnp.float32
    )
