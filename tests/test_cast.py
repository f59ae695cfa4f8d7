import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqx_amp
from eqx_amp._core._cast import is_floating_array, widest_floating_dtype


def _mixed_tree():
    return {
        "f32": jnp.ones(3),
        "f64_np": np.ones(2, np.float64),
        "np_scalar": np.float32(2.0),
        "i32": jnp.arange(3),
        "bool": jnp.array([True, False]),
        "key": jr.key(0),
        "raw_key": jr.PRNGKey(0),
        "complex": jnp.ones(2, jnp.complex64),
        "py_float": 1.5,
        "py_int": 3,
        "string": "hello",
        "fn": jax.nn.relu,
        "none": None,
    }


def test_cast_tree_touches_only_real_floating_arrays():
    tree = _mixed_tree()
    out = eqx_amp.cast_tree(tree, jnp.bfloat16)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    assert out["f32"].dtype == jnp.bfloat16
    assert out["f64_np"].dtype == jnp.bfloat16
    assert out["np_scalar"].dtype == jnp.bfloat16
    for name in (
        "i32",
        "bool",
        "key",
        "raw_key",
        "complex",
        "py_float",
        "py_int",
        "string",
        "fn",
    ):
        assert out[name] is tree[name], name


def test_cast_tree_same_dtype_is_identity_and_adds_no_converts():
    x = jnp.ones(3, jnp.bfloat16)
    assert eqx_amp.cast_tree(x, jnp.bfloat16) is x
    jaxpr = jax.make_jaxpr(lambda x: eqx_amp.cast_tree(x, jnp.bfloat16))(x)
    assert not jaxpr.eqns


def test_cast_tree_filter_spec_forms(getkey):
    model = eqx.nn.Sequential([eqx.nn.Linear(3, 4, key=getkey()), eqx.nn.LayerNorm(4)])
    # Pytree prefix.
    out = eqx_amp.cast_tree(model, jnp.float16, eqx_amp.default_filter_spec(model))
    assert out.layers[0].weight.dtype == jnp.float16
    assert out.layers[1].weight.dtype == jnp.float32
    # Bool.
    assert (
        eqx_amp.cast_tree(model, jnp.float16, False).layers[0].weight.dtype
        == jnp.float32
    )
    # Callable on leaves.
    matrices = eqx_amp.cast_tree(model, jnp.float16, lambda x: x.ndim == 2)
    assert matrices.layers[0].weight.dtype == jnp.float16
    assert matrices.layers[0].bias.dtype == jnp.float32
    # Prefix with a callable inside.
    spec = (lambda x: x.ndim == 1, False)
    out = eqx_amp.cast_tree(
        ((jnp.ones(2), jnp.ones((2, 2))), jnp.ones(2)), jnp.float16, spec
    )
    assert [x.dtype for x in jax.tree_util.tree_leaves(out)] == [
        jnp.float16,
        jnp.float32,
        jnp.float32,
    ]


def test_cast_tree_under_jit_and_grad():
    def f(x):
        return eqx_amp.cast_tree(x, jnp.bfloat16).astype(jnp.float32).sum()

    g = jax.jit(jax.grad(f))(jnp.ones(3))
    assert g.dtype == jnp.float32
    np.testing.assert_array_equal(g, np.ones(3))


def test_cast_tree_bad_inputs(getkey):
    model = eqx.nn.Linear(2, 2, key=getkey())
    with pytest.raises(
        ValueError, match=r"`dtype` must be a real floating dtype.*int32"
    ):
        eqx_amp.cast_tree(model, jnp.int32)
    with pytest.raises(ValueError, match=r"`dtype` must be a floating dtype"):
        eqx_amp.cast_tree(model, "not-a-dtype")
    with pytest.raises(ValueError, match=r"`filter_spec` does not match the structure"):
        eqx_amp.cast_tree(model, jnp.bfloat16, (True, False))
    with pytest.raises(ValueError, match=r"leaf that is neither"):
        eqx_amp.cast_tree(model, jnp.bfloat16, "yes")
    assert model.weight.dtype == jnp.float32


def test_is_floating_array():
    assert is_floating_array(jnp.ones(1, jnp.float16))
    assert is_floating_array(np.ones(1))
    assert not is_floating_array(1.0)
    assert not is_floating_array(jr.key(0))
    assert not is_floating_array(jnp.ones(1, jnp.complex64))
    assert not is_floating_array(jax.ShapeDtypeStruct((1,), jnp.float32))


def test_widest_floating_dtype():
    assert (
        widest_floating_dtype([jnp.ones(1, jnp.bfloat16), jnp.arange(2)])
        == jnp.bfloat16
    )
    assert widest_floating_dtype(
        [jnp.ones(1, jnp.bfloat16), jnp.ones(1, jnp.float16)]
    ) == (jnp.float32)
    assert widest_floating_dtype([jnp.arange(2), 1.0]) is None


def test_cast_tree_reads_dtype_words_as_policies_do():
    x = jnp.ones(2)
    for word, dtype in (
        ("f16", jnp.float16),
        ("bf16", jnp.bfloat16),
        ("f32", jnp.float32),
        ("float16", jnp.float16),
    ):
        assert eqx_amp.cast_tree(x, word).dtype == dtype
    # "half" is the platform's half dtype, as in a policy.
    assert eqx_amp.cast_tree(x, "half").dtype == eqx_amp.default_policy().compute_dtype
    with pytest.raises(
        ValueError, match=r"`dtype` must be a floating dtype.*but got None"
    ):
        eqx_amp.cast_tree(x, None)
    with pytest.raises(ValueError, match=r"`dtype` is float8_e8m0fnu: it has no sign"):
        eqx_amp.cast_tree(x, jnp.float8_e8m0fnu)
