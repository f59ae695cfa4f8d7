"""fp8 convolutions: the forward one cuDNN's fp8 convolution, the backward ones in
bfloat16 (cuDNN has fp8 forward convolutions only)."""

import functools as ft

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array

from ._products import FP8_SCOPE, FP8_SKIPPED_SCOPE, first_order_only, transposed
from ._scaling import E4M3, E5M2, quantize, unscale


def _conv32(lhs: Array, rhs: Array, params: dict) -> Array:
    """A convolution of fp8 values read as float32 (exactly) and accumulated in it:
    what XLA makes an fp8 cuDNN convolution of."""
    return lax.conv_general_dilated_p.bind(
        lhs.astype(jnp.float32),
        rhs.astype(jnp.float32),
        **dict(params, preferred_element_type=jnp.float32),
    )


def _conv16(lhs: Array, rhs: Array, params: dict) -> Array:
    """A bfloat16 convolution (float32 accumulation, bfloat16 output)."""
    return lax.conv_general_dilated_p.bind(
        lhs, rhs, **dict(params, preferred_element_type=None)
    )


# Why the backward convolutions of an fp8 convolution are not fp8: the named scope
# they run under, which `precision_report` reads.
_CONV_BACKWARD_SCOPE = (
    f"{FP8_SKIPPED_SCOPE}: backward convolution (cuDNN has fp8 forward convolutions "
    "only; it reads bfloat16 copies of the fp8 values)"
)


def fp8_conv(params: dict, out_dtype, lhs_dtype, rhs_dtype):
    """A convolution in fp8 (tensorwise scales, which come out of the sums), with
    the derivative rule of `_fp8_matmul`, called as `conv(lhs, rhs, known)` (the
    operands' recorded fp8 values, as for `fp8_matmul`)."""
    conv32 = ft.partial(_conv32, params=params)
    conv16 = ft.partial(_conv16, params=params)

    @jax.named_scope(FP8_SCOPE)
    def forward(lhs, rhs, known):
        known_lhs, known_rhs = known
        if known_lhs is None:
            known_lhs = quantize(lhs, E4M3, tuple(range(lhs.ndim)))
        if known_rhs is None:
            known_rhs = quantize(rhs, E4M3, tuple(range(rhs.ndim)))
        (ql, sl), (qr, sr) = known_lhs, known_rhs
        out = unscale(conv32(ql, qr), 1.0 / sl.reshape(()), 1.0 / sr.reshape(()))
        return out.astype(out_dtype), ((ql, sl, qr, sr), known)

    @jax.custom_vjp
    def conv(lhs, rhs, known):
        return forward(lhs, rhs, known)[0]

    @jax.named_scope(FP8_SCOPE)
    def backward(residuals, cotangent):
        residuals, known = residuals
        grads = _conv_backward(residuals, cotangent)
        return (*grads, jax.tree.map(jnp.zeros_like, known))

    def _conv_backward(residuals, cotangent):
        (ql, sl, qr, sr), cotangent = first_order_only((residuals, cotangent))
        qg, sg = quantize(cotangent, E5M2, tuple(range(cotangent.ndim)))
        with jax.named_scope(_CONV_BACKWARD_SCOPE):
            lhs16, rhs16 = ql.astype(jnp.bfloat16), qr.astype(jnp.bfloat16)
            g16 = qg.astype(jnp.bfloat16)
            dlhs = transposed(lambda x: conv16(x, rhs16), ql, g16)
            drhs = transposed(lambda y: conv16(lhs16, y), qr, g16)
            dlhs, drhs = dlhs.astype(jnp.float32), drhs.astype(jnp.float32)
        inverse_g = 1.0 / sg.reshape(())
        dlhs = unscale(dlhs, inverse_g, 1.0 / sr.reshape(()))
        drhs = unscale(drhs, inverse_g, 1.0 / sl.reshape(()))
        return dlhs.astype(lhs_dtype), drhs.astype(rhs_dtype)

    conv.defvjp(forward, backward)
    return conv
