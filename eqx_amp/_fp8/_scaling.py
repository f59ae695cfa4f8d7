"""fp8 scales: powers of two from a tensor's finite absolute maximum, bounded so
that neither a scale nor its inverse leaves float32's normal range.

Powers of two, because then scaling is exact: an fp8 GEMM can write its still-scaled
sums in bfloat16 and have them unscaled after, with the numbers one rounding of the
float32 sums would give (half the bytes of a float32 output, for the GEMM and for the
kernel that reads it). It costs at most one binade of fp8's range at its low end (the
amax lands in (largest / 2, largest]), as in torchao's rowwise recipe and MXFP8.
"""

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array


E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)

# The largest scale: its inverse, 2**-126, is float32's smallest normal, so unscaling
# never goes through float32 subnormals (which some backends flush), and a float32
# normal scaled by it (>= 1) is still a normal fp8 value (e4m3's smallest is 2**-6).
MAX_SCALE = 2.0**126


def finite_amax(x: Array, axes: tuple[int, ...]) -> Array:
    """The largest finite magnitude of `x` over `axes` (kept as size-1 axes), in
    float32; 0 for a slice with none."""
    magnitude = jnp.abs(x.astype(jnp.float32))
    finite = jnp.where(jnp.isfinite(magnitude), magnitude, 0.0)
    return jnp.max(finite, axis=axes, keepdims=True, initial=0.0)


def scale_from_amax(amax: Array, dtype: np.dtype) -> Array:
    """float32 power-of-two scale mapping `amax` into `dtype`'s top binade (the
    largest power of two at most `largest / amax`), at most `MAX_SCALE` (an
    all-zero or tiny slice). inf and NaN elements do not set it: they stay
    non-finite through the product, as they would in float32."""
    largest = float(jnp.finfo(dtype).max)
    # Dividing by at least `largest / MAX_SCALE` cannot overflow: no inf scale,
    # whose `0 * inf` would make the whole product NaN. The quotient is a positive
    # normal float32, so clearing its mantissa bits rounds it down to a power of two
    # exactly (a logarithm could round up, past `largest`).
    ratio = largest / jnp.maximum(amax.astype(jnp.float32), largest / MAX_SCALE)
    return power_of_two_at_most(ratio)


def power_of_two_at_most(x: Array) -> Array:
    """The largest power of two at most the positive normal float32 `x`, exactly:
    its mantissa bits cleared."""
    bits = lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFF800000)
    return lax.bitcast_convert_type(bits, jnp.float32)


def quantize_with(
    x: Array, scale: Array, dtype: np.dtype, *, inf_to_nan: bool = True
) -> Array:
    """`x * scale` in `dtype`, clipped to its finite range; an inf or NaN element
    becomes NaN (with `inf_to_nan=False`, non-finite elements are left to the
    conversion)."""
    largest = float(jnp.finfo(dtype).max)
    scaled = x.astype(jnp.float32) * scale
    # Rounding can step just past the largest finite value, which e4m3fn would make
    # NaN: finite values are clipped. A non-finite one is made NaN here rather than
    # left to the conversion: a GPU converts with saturation (PTX's `satfinite`),
    # which turns inf into the largest finite fp8 value, so an overflow upstream
    # would vanish into a finite product on an H100 and stay visible on a CPU.
    # The NaN is made from the tensor itself (inf - inf, NaN - NaN), not a
    # constant: `telemetry` follows a weight through its quantisation along the
    # values computed from it alone.
    clipped = jnp.clip(scaled, -largest, largest)
    otherwise = scaled - scaled if inf_to_nan else scaled
    return jnp.where(jnp.isfinite(scaled), clipped, otherwise).astype(dtype)


def quantize(x: Array, dtype: np.dtype, axes: tuple[int, ...]) -> tuple[Array, Array]:
    """`x` in `dtype`, with its float32 scale from the amax over `axes`."""
    scale = scale_from_amax(finite_amax(x, axes), dtype)
    return quantize_with(x, scale, dtype), scale


def quantize_and_amax(x: Array, scale: Array, dtype) -> tuple[Array, Array]:
    """`x` in `dtype` with the given `scale` (saturating), and `x`'s finite amax
    (a float32 scalar), both without a derivative: one pass over `x` once fused."""
    x = lax.stop_gradient(x)
    quantized = quantize_with(x, lax.stop_gradient(scale), dtype)
    return quantized, finite_amax(x, tuple(range(x.ndim))).reshape(())


def unscale(product: Array, inverse_a: Array, inverse_b: Array) -> Array:
    """`product * inverse_a * inverse_b` (positive inverse scales, broadcast to the
    product) without leaving float32's range on the way: the two inverses as one
    factor where that is a normal float32, otherwise the larger one first, whose
    product can only overflow (or the smaller's underflow) where the result does."""
    f32 = jnp.finfo(jnp.float32)
    # Scales are powers of two made by masking bits (`scale_from_amax`), so XLA cannot
    # fold their inverses back into the amaxes (`amax_a * amax_b / 448**2`
    # overflowed under `jit` while the scales were quotients, and an optimisation
    # barrier kept the inverses apart). Without it they fuse into the kernels that
    # read the product: compiled for an H100, the GPT-2-small-sized fp8 step
    # launches 552 kernels, against 605 behind the barrier.
    both = inverse_a * inverse_b
    in_range = (both >= f32.tiny) & (both <= f32.max)
    larger, smaller = (
        jnp.maximum(inverse_a, inverse_b),
        jnp.minimum(inverse_a, inverse_b),
    )
    # The choice is made between the scalar factors, not between two products:
    # an elementwise select over the product kept XLA from recomputing the
    # unscaled values where they are read again (the backward pass), so it wrote
    # them out. `* 1.0` is exact.
    first = jnp.where(in_range, both, larger)
    second = jnp.where(in_range, 1.0, smaller)
    return product * first * second
