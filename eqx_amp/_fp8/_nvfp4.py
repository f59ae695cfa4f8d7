"""NVFP4 forward products (`eqx_amp.fp8.NVFP4`): Blackwell's 4-bit format.

Every block of 16 consecutive values along a product's contracting dimension is
stored as `float4_e2m1fn` values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives)
with one `float8_e4m3fn` block scale, and the whole tensor has one float32 scale
on top: the two-level scaling of NVIDIA's NVFP4 recipe. The GEMM applies the block
scales itself (`_block_scaled.block_product`: cuDNN's block-scaled GEMM on CUDA) and
the tensor scales are applied to its output after (`_block_scaled.nv_product`).

The tensor scale here is a power of two (`scale_from_amax`), so it is exact, and
its inverse never leaves float32's normal range: the largest block of a tensor gets
a block scale in (149, 299], within e4m3's range with half a binade to spare. A
block scale is its amax over 6 rounded up to an e4m3 value, so no value of the
block lands past 6 (none saturates, as with MXFP8's RCEIL scales). A block whose
scale falls below e4m3's smallest, 2**-9 (against at most 299 for the tensor's
largest block: 17 binades), is flushed to zero. A block holding an inf or NaN
gets a NaN scale (fp4 has no NaN), so the outputs that read it are NaN and no
others.

Only the forward product is NVFP4: the backward products are MXFP8
(`_block_scaled`), from operands saved in MXFP8 along what those products
contract, as NVIDIA's recipe keeps gradients out of 4 bits where it cannot round
them stochastically.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array

from ._scaling import E4M3, MAX_SCALE, finite_amax, scale_from_amax
from ._shapes import NV_BLOCK


FP4 = jnp.dtype(jnp.float4_e2m1fn)
# The named scope inside `FP8_SCOPE` that NVFP4 quantisation runs under, and the
# one inside it where the e4m3 block scales are made (casts of scales, not of a
# tensor: `telemetry` leaves them out).
NVFP4_SCOPE = "nvfp4"
NVFP4_SCALES_SCOPE = "nvfp4 block scales"
_FP4_MAX = float(jnp.finfo(FP4).max)
_F32_MAX = float(jnp.finfo(jnp.float32).max)
# The tensor scale maps the amax to (896, 1792]: its block scale, amax / 6, then
# lies in (149, 299], below e4m3's 448. Capped at `MAX_SCALE`, as fp8 scales are.
_TENSOR_HEADROOM = 4.0


def nv_quantize(x3: Array) -> tuple[Array, Array, Array]:
    """`x3` of shape `(B, R, C)`, `C` a multiple of 16, in NVFP4 along its last
    axis: e2m1 values `(B, R, C)`, e4m3 block scales `(B, R, C / 16)` and the
    float32 tensor scale (a power of two) that the values times their block scales
    are to be divided by."""
    b, r, c = x3.shape
    x = x3.astype(jnp.float32).reshape(b, r, c // NV_BLOCK, NV_BLOCK)
    block_amax = lax.stop_gradient(jnp.max(jnp.abs(x), axis=-1, keepdims=True))
    # The tensor's amax from its blocks' (one pass over the tensor, not two): the
    # largest of the finite ones. A block holding an inf or NaN has a NaN scale
    # whatever the tensor's is.
    amax = finite_amax(block_amax, (0, 1, 2, 3)).reshape(())
    headroom = MAX_SCALE / _TENSOR_HEADROOM
    tensor_scale = jnp.minimum(scale_from_amax(amax, E4M3), headroom) * _TENSOR_HEADROOM
    tensor_scale = lax.stop_gradient(tensor_scale)
    with jax.named_scope(NVFP4_SCALES_SCOPE):
        scaled_amax = block_amax * tensor_scale / _FP4_MAX
        # A block with an inf or NaN: a NaN scale, which fp4 values cannot carry.
        nearest = jnp.where(
            jnp.isfinite(scaled_amax), scaled_amax, scaled_amax - scaled_amax
        ).astype(E4M3)
        # Rounded up (to the next e4m3 value where rounding went down), so that no
        # value of the block lands past 6: its amax is held, not saturated.
        bits = lax.bitcast_convert_type(nearest, jnp.uint8)
        below = nearest.astype(jnp.float32) < scaled_amax
        block_scale = lax.bitcast_convert_type(bits + below.astype(jnp.uint8), E4M3)
    decoded = block_scale.astype(jnp.float32)
    # `tensor_scale / decoded`, bounded: only a block of float32 subnormals (in a
    # tensor of them) would take a larger factor, and it is flushed instead. A
    # block whose scale is 0 (its amax times the tensor scale below 6 * 2**-10) is
    # multiplied by the tensor scale alone, which rounds it to zero as well and
    # leaves `telemetry` the values it flushes.
    factor = jnp.where(
        decoded > 0, jnp.minimum(tensor_scale / decoded, _F32_MAX), tensor_scale
    )
    values = _to_e2m1_grid(jnp.clip(x * factor, -_FP4_MAX, _FP4_MAX)).astype(FP4)
    return values.reshape(b, r, c), block_scale[..., 0], tensor_scale


def _to_e2m1_grid(x: Array) -> Array:
    """`x` (within +-6) rounded to the nearest e2m1 value, ties to even, in float32:
    the conversion that follows is then exact. XLA's CPU loop emitter converts
    float32 to e2m1 through bfloat16, rounding twice (1.2505 became 1, not 1.5);
    the grid's spacing is 0.5 below 2, 1 below 4, then 2, and `round` rounds
    halves to even, as the format does."""
    magnitude = jnp.abs(x)
    step = jnp.where(magnitude < 2, 0.5, jnp.where(magnitude < 4, 1.0, 2.0))
    return jnp.round(x / step) * step
