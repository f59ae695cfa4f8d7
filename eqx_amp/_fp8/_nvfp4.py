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

With `eqx_amp.fp8.NVFP4` only the forward product is NVFP4: the backward products
are MXFP8 (`_block_scaled`), from operands saved in MXFP8 along what those products
contract. `NVFP4.with_nvfp4_backward()` runs them in NVFP4 too, with the rest of
NVIDIA's recipe (arXiv 2509.25149): a weight quantised in 16 x 16 tiles
(`nv_quantize_tiles`: the input gradient's product reads the forward's numbers),
output gradients rounded stochastically (`_to_e2m1_stochastically`), and both
inputs of a weight gradient rotated by a random 16 x 16 Hadamard matrix
(`hadamard_16`).
"""

import jax
import jax.numpy as jnp
import numpy as np
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


def nv_quantize(x3: Array, *, stochastic: bool = False) -> tuple[Array, Array, Array]:
    """`x3` of shape `(B, R, C)`, `C` a multiple of 16, in NVFP4 along its last
    axis: e2m1 values `(B, R, C)`, e4m3 block scales `(B, R, C / 16)` and the
    float32 tensor scale (a power of two) that the values times their block scales
    are to be divided by. With `stochastic`, values are rounded to one of their two
    neighbours on the e2m1 grid with the probability that makes the rounding
    unbiased (`_to_e2m1_stochastically`), as NVIDIA's recipe rounds gradients."""
    b, r, c = x3.shape
    x = x3.astype(jnp.float32).reshape(b, r, c // NV_BLOCK, NV_BLOCK)
    block_amax = lax.stop_gradient(jnp.max(jnp.abs(x), axis=-1, keepdims=True))
    grid, block_scale, tensor_scale = _encode(x, block_amax, stochastic)
    return grid.astype(FP4).reshape(b, r, c), block_scale[..., 0], tensor_scale


def nv_quantize_tiles(
    w3: Array,
) -> tuple[tuple[Array, Array, Array], tuple[Array, Array, Array]]:
    """`w3` of shape `(B, R, C)`, `C` a multiple of 16, in NVFP4 with one e4m3 scale
    per 16 x 16 tile (NVIDIA's recipe for weights), in both orientations: along `C`
    (values `(B, R, C)`, block scales `(B, R, C / 16)`, the tensor scale) for the
    product that contracts `C`, and along `R` padded with zeros to a multiple of 16
    (`(B, C, R')`, `(B, C, R' / 16)`, the same tensor scale) for the one that
    contracts `R`. A tile's scale serves each row of 16 in it either way, so the two
    forms hold the same numbers: the backward product multiplies by exactly the
    weight the forward one did."""
    b, r, c = w3.shape
    w = _padded(w3.astype(jnp.float32), 1)
    rp = w.shape[1]
    tiles = w.reshape(b, rp // NV_BLOCK, NV_BLOCK, c // NV_BLOCK, NV_BLOCK)
    tile_amax = lax.stop_gradient(jnp.max(jnp.abs(tiles), axis=(2, 4), keepdims=True))
    grid, tile_scale, tensor_scale = _encode(tiles, tile_amax, stochastic=False)
    values = grid.astype(FP4).reshape(b, rp, c)
    tile_scale = tile_scale[:, :, 0, :, 0]  # (B, R' / 16, C / 16)

    def per_row(scales: Array) -> Array:
        """A tile's scale for each of its 16 rows: `(B, n, m)` -> `(B, 16 n, m)`."""
        n, m = scales.shape[1:]
        rows = jnp.broadcast_to(scales[:, :, None], (b, n, NV_BLOCK, m))
        return rows.reshape(b, n * NV_BLOCK, m)

    along_c = (values[:, :r], per_row(tile_scale)[:, :r], tensor_scale)
    along_r = (
        jnp.swapaxes(values, 1, 2),
        per_row(jnp.swapaxes(tile_scale, 1, 2)),
        tensor_scale,
    )
    return along_c, along_r


def nv_quantize_along(
    x3: Array,
    axis: int,
    *,
    rotated: bool = False,
    stochastic: bool = False,
    tensor_scale: Array | None = None,
) -> tuple[Array, Array, Array]:
    """`x3` of shape `(B, R, C)` in NVFP4 along `axis` (1 or 2), with that axis last
    and padded with zeros to a multiple of 16 (`nv_quantize` of `(B, R, C')`, or of
    the transpose `(B, C, R')`): the form a product contracting that axis reads.
    With `rotated`, each block of 16 along it is multiplied by `hadamard_16` first,
    as NVIDIA's recipe does to both inputs of a weight gradient: the rotation
    spreads a block's outlier over the block, and since it is orthogonal, the
    product of two operands rotated alike is unchanged. `tensor_scale`, the tensor
    scale of `x3`'s unrotated form: a tensor near float32's largest is rotated
    scaled down by a power of two (exactly; its tensor scale carries it), since a
    block's rotated values reach 4 times its largest."""
    x = _padded(x3.astype(jnp.float32), axis)
    shrink = None
    if rotated:
        if tensor_scale is not None:
            # The tensor scale maps the amax to at most 1792 (2**11): below 2**120
            # after the shrink, which is 1 unless the amax passes about 2**109.
            shrink = lax.stop_gradient(jnp.minimum(tensor_scale * 2.0**109, 1.0))
            x = x * shrink
        # Rotated where it lies, before any transpose, and rounded to bfloat16:
        # XLA writes the rotated copy to memory, and this halves it (compiled for
        # a B200, 0.55 GB against 0.90 for a 4096 x 14336 operand; 2.3 GB as
        # butterflies). bfloat16's rounding, 2**-9, is far below e2m1's.
        x = hadamard_16(x, axis).astype(jnp.bfloat16).astype(jnp.float32)
    x = jnp.swapaxes(x, 1, 2) if axis == 1 else x
    values, block_scales, scale = nv_quantize(x, stochastic=stochastic)
    # The values are of `x * shrink`: dividing by `scale * shrink` gives `x`'s.
    return values, block_scales, scale if shrink is None else scale * shrink


# The random signs of the Hadamard rotation: one vector for every product and step,
# as NVIDIA's recipe uses one; fixed, so that a step is a function of its inputs.
_SIGNS = np.where(np.random.default_rng(2509_25149).random(NV_BLOCK) < 0.5, -1.0, 1.0)


def _sylvester(n: int) -> np.ndarray:
    """The `n x n` Hadamard matrix of Sylvester's construction (`n` a power of 2)."""
    h = np.ones((1, 1))
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    return h


# `diag(signs) @ H`, its entries +-1: `/ 4` makes it orthogonal (`H @ H.T == 16 I`).
_SIGNED_HADAMARD = (np.diag(_SIGNS) @ _sylvester(NV_BLOCK)).astype(np.float32)
_ROTATION = _SIGNED_HADAMARD / 4


def hadamard_16(x: Array, axis: int = -1) -> Array:
    """`x` (float32, `axis` of a size that is a multiple of 16) with each block of
    16 along `axis` multiplied by `diag(signs) @ H / 4`, `H` the 16 x 16 Hadamard
    matrix: an orthogonal matrix, so `hadamard_16(a) @ hadamard_16(b).T == a @ b.T`
    up to rounding. Written as a broadcast product summed over the block, which
    XLA makes one kernel reading `x` once (four butterfly stages of sums and
    differences were four kernels, each writing the whole tensor). The quarter is
    taken after the sum (the same numbers: a power of two): quarters of values near
    float32's smallest normal would be subnormal, which a CPU reads as zero."""
    axis = axis % x.ndim
    shape = x.shape
    blocks = x.reshape(*shape[:axis], -1, NV_BLOCK, 1, *shape[axis + 1 :])
    signs = jnp.asarray(_SIGNED_HADAMARD).reshape(
        (1,) * (axis + 1) + (NV_BLOCK, NV_BLOCK) + (1,) * (x.ndim - axis - 1)
    )
    return (jnp.sum(blocks * signs, axis=axis + 1) * 0.25).reshape(shape)


def _padded(x: Array, axis: int) -> Array:
    """`x` with `axis` padded with zeros to a multiple of 16 (zeros change no sum)."""
    missing = -x.shape[axis] % NV_BLOCK
    if not missing:
        return x
    return jnp.pad(x, [(0, missing if a == axis else 0) for a in range(x.ndim)])


def _encode(
    x: Array, block_amax: Array, stochastic: bool
) -> tuple[Array, Array, Array]:
    """`x` (float32) in NVFP4 with one block scale per entry of `block_amax` (its
    blocks' amaxes, broadcast against it): the values on the e2m1 grid (in float32:
    their conversion is exact), the e4m3 block scales (of `block_amax`'s shape) and
    the tensor scale."""
    # The tensor's amax from its blocks' (one pass over the tensor, not two): the
    # largest of the finite ones. A block holding an inf or NaN has a NaN scale
    # whatever the tensor's is.
    amax = finite_amax(block_amax, tuple(range(block_amax.ndim))).reshape(())
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
    scaled = jnp.clip(x * factor, -_FP4_MAX, _FP4_MAX)
    if stochastic:
        seed = lax.bitcast_convert_type(amax, jnp.uint32)
        grid = _to_e2m1_stochastically(scaled, _uniform(scaled.shape, seed))
    else:
        grid = _to_e2m1_grid(scaled)
    return grid, block_scale, tensor_scale


def _grid_step(magnitude: Array) -> Array:
    """The spacing of the e2m1 grid at `magnitude` (within 6): 0.5 below 2, 1 below
    4, then 2. From the exponent bits (half the power of two at or below it,
    clipped), not from comparisons, whose masks XLA writes to memory beside a
    transpose."""
    exponent = lax.bitcast_convert_type(magnitude, jnp.uint32) & jnp.uint32(0x7F800000)
    power = lax.bitcast_convert_type(exponent, jnp.float32)
    # Divided, not multiplied: `telemetry` reads a product with a smaller operand
    # before a cast as the quantisation's scale.
    return jnp.clip(power, 1.0, 4.0) / 2


def _to_e2m1_grid(x: Array) -> Array:
    """`x` (within +-6) rounded to the nearest e2m1 value, ties to even, in float32:
    the conversion that follows is then exact. XLA's CPU loop emitter converts
    float32 to e2m1 through bfloat16, rounding twice (1.2505 became 1, not 1.5);
    `round` rounds halves to even, as the format does."""
    step = _grid_step(jnp.abs(x))
    return jnp.round(x / step) * step


def _to_e2m1_stochastically(x: Array, uniform: Array) -> Array:
    """`x` (within +-6) rounded to the e2m1 value below its magnitude or the one
    above, the one above when `uniform` (in [0, 1)) is below the distance to the
    one below in grid steps: unbiased for a uniform `uniform`. Values on the grid
    stay; none goes past 6 (its distance to 6 is 0)."""
    magnitude = jnp.abs(x)
    step = _grid_step(magnitude)
    below = jnp.floor(magnitude / step) * step
    up = magnitude - below > uniform * step
    return jnp.sign(x) * (below + step * up.astype(jnp.float32))


def _uniform(shape: tuple[int, ...], seed: Array) -> Array:
    """A number in [0, 1) per position of an array of `shape`, from a hash of the
    position and `seed` (a uint32 scalar): stochastic rounding without a random key
    to thread through the step. The seed is the bits of the tensor's amax, which
    changes from step to step, so a value that stays the same across steps is
    rounded up as often as its distance to the grid says, on average; the hash
    does not read the values, so XLA computes it in the kernel that rounds them."""
    index = jnp.zeros(shape, jnp.uint32)
    for axis in range(len(shape)):
        index = index * jnp.uint32(shape[axis]) + lax.broadcasted_iota(
            jnp.uint32, shape, axis
        )
    h = index * jnp.uint32(0x9E3779B9) + seed
    # A 32-bit integer finaliser (xor-shifts and odd multipliers) that sends each
    # input bit to every output bit.
    h = (h ^ (h >> 16)) * jnp.uint32(0x7FEB352D)
    h = (h ^ (h >> 15)) * jnp.uint32(0x846CA68B)
    h = h ^ (h >> 16)
    return (h >> 8).astype(jnp.float32) / np.float32(2.0**24)
