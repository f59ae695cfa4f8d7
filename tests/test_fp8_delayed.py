"""The delayed-scaling mode of the tensorwise fp8 matmuls (`eqx_amp._fp8._delayed`, a
measurement prototype behind `benchmarks/_variants.py`'s `filter_amp_fp8_delayed`):
the scales used are the ones handed in, and each tensor's amax comes out as the
gradient of the scale that quantised it."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqx_amp
from eqx_amp._fp8._delayed import DelayedScales, delayed_scales
from eqx_amp._fp8._scaling import E4M3, quantize_with, scale_from_amax


class _Two(eqx.Module):
    """Two products reading the same input, summed."""

    a: eqx.nn.Linear
    b: eqx.nn.Linear

    def __call__(self, x):
        return self.a(x) + self.b(x)


def _model(key):
    return eqx.nn.Linear(64, 32, use_bias=False, key=key)


@eqx.filter_jit
def _run(model, x, supply):
    # Under `jit` (the model traced), weights are quantised once per call.
    amp = eqx_amp.filter_amp(
        eqx.filter_vmap(model), policy="mixed_bfloat16", fp8=eqx_amp.fp8.TENSORWISE
    )
    with delayed_scales(supply):
        return amp(x)


def _dequantized(x, scale, dtype):
    return quantize_with(x, scale, dtype).astype(jnp.float32) / scale


def test_the_forward_product_uses_the_given_activation_scale(getkey):
    model = _model(getkey())
    x = jr.normal(getkey(), (32, 64)).astype(jnp.bfloat16)
    # A stale scale, too large: x's amax (about 3.5) times 256 passes 448, so the
    # largest values saturate, as delayed scaling's do.
    scale = jnp.float32(2.0**8)
    out = _run(model, x, DelayedScales([scale], [jnp.float32(1.0)]))
    w = model.weight.astype(jnp.bfloat16)
    w_scale = scale_from_amax(jnp.max(jnp.abs(w.astype(jnp.float32))), E4M3)
    expected = _dequantized(x, scale, E4M3) @ _dequantized(w, w_scale, E4M3).T
    np.testing.assert_allclose(out, expected, rtol=1e-2, atol=1e-2)
    assert (
        float(jnp.max(jnp.abs(quantize_with(x, scale, E4M3).astype(jnp.float32))))
        == 448
    )


def test_the_amaxes_come_out_as_the_gradients_of_the_scales(getkey):
    model = _model(getkey())
    x = jr.normal(getkey(), (32, 64)).astype(jnp.bfloat16)
    cotangent = 3.0 * jr.normal(getkey(), (32, 32))

    def loss(scales, x, model=model):
        out = _run(model, x, DelayedScales(*scales))
        return jnp.sum(out * cotangent)

    scales = ([jnp.float32(8.0)], [jnp.float32(2.0)])
    (x_amax,), (g_amax,) = jax.grad(loss)(scales, x)
    assert x_amax == jnp.max(jnp.abs(x.astype(jnp.float32)))
    # The product's output (bfloat16) gets the cotangent in its own dtype.
    expected = jnp.max(jnp.abs(cotangent.astype(jnp.bfloat16).astype(jnp.float32)))
    assert g_amax == expected
    # The input's gradient is the fp8 product's: the cotangent quantised with the
    # given scale (here 2: no clipping, e5m2's rounding only).
    dx = jax.grad(lambda x: loss(scales, x).astype(jnp.float32))(x.astype(jnp.float32))
    w = model.weight
    reference = cotangent @ w
    np.testing.assert_allclose(dx, reference, rtol=0.2, atol=0.3)


def test_products_reading_one_array_share_its_scale_and_hand_out_once(getkey):
    k1, k2 = jr.split(getkey())
    model = _Two(
        eqx.nn.Linear(64, 32, use_bias=False, key=k1),
        eqx.nn.Linear(64, 32, use_bias=False, key=k2),
    )
    x = jr.normal(getkey(), (16, 64))
    counting = DelayedScales.counting(weights=True)
    eqx.filter_eval_shape(_run, model, x, counting)
    assert counting.taken == {"activations": 1, "gradients": 2, "weights": 2}

    def loss(scales):
        return jnp.sum(_run(model, x, DelayedScales(*scales)))

    scales = ([jnp.float32(8.0)], [jnp.float32(1.0)] * 2, [jnp.float32(64.0)] * 2)
    (x_amax,), _, w_amaxes = jax.grad(loss)(scales)
    assert x_amax == jnp.max(jnp.abs(x.astype(jnp.bfloat16).astype(jnp.float32)))
    for layer, amax in zip((model.a, model.b), w_amaxes):
        w = layer.weight.astype(jnp.bfloat16).astype(jnp.float32)
        assert amax == jnp.max(jnp.abs(w))


def test_a_program_with_more_products_than_scales_is_refused(getkey):
    model = _model(getkey())
    x = jnp.ones((16, 64))
    with pytest.raises(ValueError, match="hold 0 gradient scales"):
        _run(model, x, DelayedScales([jnp.float32(1.0)], []))


def test_a_vmap_outside_the_wrapper_is_refused(getkey):
    model = _model(getkey())
    amp = eqx_amp.filter_amp(model, policy="mixed_bfloat16", fp8=eqx_amp.fp8.TENSORWISE)
    with delayed_scales(DelayedScales.counting()):
        with pytest.raises(NotImplementedError, match="outside the vmap"):
            eqx.filter_eval_shape(jax.vmap(amp), jnp.ones((16, 64)))
