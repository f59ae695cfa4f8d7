"""Block-scaled products (`eqx_amp.fp8.MXFP8`, `NVFP4`), first-order only.

The OCP microscaling recipe that Blackwell's tensor cores run: every block of 32
consecutive values along a product's contracting dimension is stored as
`float8_e4m3fn` values with one power-of-two `float8_e8m0fnu` scale, rounded up
from the block's largest finite magnitude (RCEIL: the block's amax lands in
(224, 448], e4m3's top binade, and nothing saturates). The GEMM applies the scales
itself: JAX's `jax.nn.scaled_matmul` on CUDA (cuDNN's `__cudnn$blockScaledDot`
where XLA knows cuDNN 9.8 or later), JAX's `lax.scaled_dot` on other accelerators
(it dequantises to bfloat16, which is exact, and multiplies with float32
accumulation); on a CPU the operands are dequantised to float32 (exact too), since
XLA's CPU runtime cannot run every bfloat16 x bfloat16 -> float32 dot that
`scaled_dot`'s backward products become once XLA folds transposes into them. The
same numbers on every platform.

Each product quantises along its own contracting dimension, the backward ones too:
the forward pass quantises each operand twice, along the forward product's
contracting dimension and along the one its backward product contracts (the tokens
for the weight gradient, the output features for the input gradient), and saves
the second form, 1 byte a value plus a scale per 32, for the backward pass. The
output gradient is quantised to e4m3 along each backward product's contracting
dimension. A backward product whose contracting size is not a multiple of 32 has
it padded with zeros (zeros change no sum).

NVFP4 products run through the same GEMM (`block_product`) with 4-bit operands
quantised by `_nvfp4`: forward ones with MXFP8 backward products
(`block_scaled_matmul(..., nvfp4_forward=True)`), or all three by NVIDIA's recipe
(`nvfp4_matmul`).
"""

import functools as ft
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array

from .._core._platform import with_cpu_form
from .._jaxpr import _compat as compat
from ._nvfp4 import NVFP4_SCOPE, nv_quantize, nv_quantize_along, nv_quantize_tiles
from ._products import FP8_SCOPE, varying_over
from ._scaling import E4M3, unscale
from ._shapes import BLOCK, free_axes


E8M0 = jnp.dtype(jnp.float8_e8m0fnu)
# The named scope inside `FP8_SCOPE` that block-scaled products (MXFP8's and
# NVFP4's) run under: the compiled GPU program's op names show it beside each
# cuDNN call.
MXFP8_SCOPE = "mxfp8"
# The dtypes JAX's block-scaled products emit.
_PRODUCT_DTYPES = tuple(map(jnp.dtype, (jnp.float32, jnp.bfloat16, jnp.float16)))
_E4M3_MAX = float(jnp.finfo(E4M3).max)


def block_scales(amax: Array) -> tuple[Array, Array]:
    """The e8m0 scale of each block whose largest magnitude is `amax` (float32),
    rounded up to a power of two (RCEIL: `amax / 448` rounded up), and the float32
    factor that quantises the block (its inverse, exactly). An all-zero block gets
    e8m0's smallest scale, 2**-127; a block holding an inf or NaN its largest,
    2**127, with a factor of 0 (its finite values vanish beside it; it is not
    finite in any product that reads it)."""
    ratio = amax.astype(jnp.float32) / _E4M3_MAX
    bits = lax.bitcast_convert_type(ratio, jnp.uint32)
    exponent, mantissa = bits >> 23, bits & 0x7FFFFF
    # A normal ratio with mantissa bits rounds up one binade; a subnormal one is
    # 2**-127 (e8m0's smallest) or, above it, 2**-126. A finite amax reaches 248
    # at most; an inf or NaN one (255, 256) is held to 254: no e8m0 NaN (255).
    exponent = jnp.where(
        exponent == 0,
        (mantissa > 0x400000).astype(jnp.uint32),
        jnp.minimum(exponent + (mantissa > 0).astype(jnp.uint32), 254),
    )
    scale = lax.bitcast_convert_type(exponent.astype(jnp.uint8), E8M0)
    # 2**(127 - exponent): a normal float32 for every finite amax, 0 for the rest.
    factor = lax.bitcast_convert_type((254 - exponent) << 23, jnp.float32)
    return scale, factor


def mx_quantize(x: Array, axis: int = 2) -> tuple[Array, Array]:
    """`x` of shape `(B, R, C)` in MXFP8 along `axis` (1 or 2), with that axis last:
    e4m3 values of shape `(B, R, C')` and e8m0 scales `(B, R, C' / 32)` for axis 2,
    `(B, C, R')` and `(B, C, R' / 32)` for axis 1, the quantised axis padded with
    zeros to a multiple of 32. The blocks are taken where they lie, so only the
    fp8 values are transposed. A block holding an inf or NaN becomes NaN there and
    zero elsewhere (`block_scales`): only the outputs that read it see it, and
    they are not finite, as in float32."""
    padded = -x.shape[axis] % BLOCK
    if padded:
        x = jnp.pad(x, [(0, padded) if a == axis else (0, 0) for a in range(x.ndim)])
    shape = list(x.shape)
    shape[axis : axis + 1] = [-1, BLOCK]
    blocks = x.reshape(shape)
    # No select of the finite values: it would make XLA materialise a float32
    # copy of a tensor whose blocks run across its rows.
    amax = jnp.max(jnp.abs(blocks.astype(jnp.float32)), axis=axis + 1, keepdims=True)
    scale, factor = block_scales(lax.stop_gradient(amax))
    # Rounding up keeps every finite value within e4m3's range: no clip is needed.
    values = (blocks.astype(jnp.float32) * factor).astype(E4M3).reshape(x.shape)
    scale = jnp.squeeze(scale, axis + 1)
    if axis == 1:
        values, scale = _transposed(values), _transposed(scale)
    return values, scale


def mx_quantize_weight(weight: Array) -> tuple[Array, Array]:
    """`weight` in MXFP8 along its last axis (a multiple of 32): e4m3 values of its
    shape and e8m0 scales of shape `(*weight.shape[:-1], n / 32)`. The form an
    `eqx.nn.Linear` weight's forward product reads (it contracts the input
    features), and the one `gather_params(..., fp8=MXFP8)` gathers."""
    values, scales = mx_quantize(weight.reshape(1, -1, weight.shape[-1]))
    return values.reshape(weight.shape), scales.reshape(*weight.shape[:-1], -1)


def mx_dequantize(values: Array, scales: Array, dtype: Any) -> Array:
    """MXFP8 values with their scales along the last axis, in `dtype`: exact in
    bfloat16, float16 (where in range) and float32. A finite block whose values
    round up past `dtype`'s largest (an amax within one e4m3 step of it) saturates
    there; a block holding an inf or NaN stays NaN."""
    largest = float(jnp.finfo(dtype).max)
    return jnp.clip(_in_float32(values, scales), -largest, largest).astype(dtype)


def _in_float32(values: Array, scales: Array) -> Array:
    """Block-scaled values times their scales (one per block along the last axis:
    32 values for MXFP8, 16 for NVFP4), in float32: exact, but that a finite MXFP8
    block whose values round up to 2**128 (an amax within one e4m3 step of
    float32's largest) is held at float32's largest, as the GEMM, which applies
    both operands' scales to the product, would give a finite product of it."""
    block = values.shape[-1] // scales.shape[-1]
    blocks = values.astype(jnp.float32).reshape(*values.shape[:-1], -1, block)
    if scales.dtype != E8M0:
        return (blocks * scales.astype(jnp.float32)[..., None]).reshape(values.shape)
    # e8m0 scales reach 2**-127, a float32 subnormal, which a CPU reads as zero:
    # applied as normal factors instead.
    scaled = _times_power_of_two(blocks, _exponents(scales)[..., None])
    largest = np.float32(jnp.finfo(jnp.float32).max)
    return lax.clamp(-largest, scaled, largest).reshape(values.shape)


def _exponents(scales: Array) -> Array:
    """The power of two of each e8m0 scale, as int32 (-127 to 127)."""
    return lax.bitcast_convert_type(scales, jnp.uint8).astype(jnp.int32) - 127


def _times_power_of_two(x: Array, exponent: Array) -> Array:
    """`x * 2**exponent` (float32 `x`, int32 `exponent` in [-127, 127]) in two
    factors, each a normal float32 (at most 2**64 either way): a CPU reads a
    subnormal factor, such as e8m0's 2**-127, as zero. The partial product lies
    between `x` and the result, so it is normal where both are."""
    half = lax.shift_right_arithmetic(exponent, 1)  # rounded down
    for piece in (half, exponent - half):
        x = x * lax.bitcast_convert_type((piece + 127) << 23, jnp.float32)
    return x


def _known_3d(known: tuple[Array, Array]) -> tuple[Array, Array]:
    """Recorded MXFP8 values and scales along an operand's last axis, which its
    product contracts, as `mx_quantize` lays out a `(1, free, contracting)` one."""
    values, scales = known
    return (
        values.reshape(1, -1, values.shape[-1]),
        scales.reshape(1, -1, scales.shape[-1]),
    )


def _cuda_product(lhs, rhs, lhs_scales, rhs_scales, dtype):
    return jax.nn.scaled_matmul(
        lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=dtype
    )


def _portable_product(lhs, rhs, lhs_scales, rhs_scales, dtype):
    return lax.scaled_dot(
        lhs,
        rhs,
        lhs_scale=lhs_scales,
        rhs_scale=rhs_scales,
        dimension_numbers=(((2,), (2,)), ((0,), (0,))),
        preferred_element_type=dtype,
    )


def _cpu_product(lhs, rhs, lhs_scales, rhs_scales, dtype):
    return lax.dot_general(
        _in_float32(lhs, lhs_scales),
        _in_float32(rhs, rhs_scales),
        (((2,), (2,)), ((0,), (0,))),
        preferred_element_type=jnp.float32,
    ).astype(dtype)


def block_product(lhs, rhs, lhs_scales, rhs_scales, dtype) -> Array:
    """`(B, M, K) x (B, N, K) -> (B, M, N)` of block-scaled operands (MXFP8, or
    NVFP4's values and block scales), the scales applied in
    the GEMM, accumulated in float32 and returned in `dtype`: cuDNN's block-scaled
    GEMM through `jax.nn.scaled_matmul` when compiled for CUDA, a dequantising dot
    for any other platform (`lax.scaled_dot`; on a CPU, float32 operands), chosen
    as the program is lowered, so a CPU can compile for a GPU."""
    dtype = jnp.dtype(dtype)
    emit = dtype if dtype in _PRODUCT_DTYPES else jnp.dtype(jnp.float32)
    out = with_cpu_form(
        lhs,
        rhs,
        lhs_scales,
        rhs_scales,
        cuda=_varying_as_operands(ft.partial(_cuda_product, dtype=emit)),
        cpu=_varying_as_operands(ft.partial(_cpu_product, dtype=emit)),
        default=_varying_as_operands(ft.partial(_portable_product, dtype=emit)),
    )
    return out.astype(dtype)


def _varying_as_operands(product):
    """`product`, its output typed as varying over every `jax.shard_map` axis an
    operand varies over: `jax.nn.scaled_matmul` drops that type (jax 0.10-0.12),
    and the platforms' branches must agree on it."""

    def typed(*operands):
        axes = frozenset().union(*map(compat.varying_axes, operands))
        return varying_over(product(*operands), axes)

    return typed


def _to_3d(x: Array, contracting, batch) -> Array:
    """`x` as `(batch, free, contracting)`, each group of axes flattened into one, in
    the order the dimension numbers give them (so that two operands' batch and
    contracting axes stay paired)."""
    free = free_axes(x.ndim, contracting, batch)
    order = [*batch, *free, *contracting]
    size = lambda axes: int(np.prod([x.shape[a] for a in axes], dtype=np.int64))  # noqa: E731
    return jnp.transpose(x, order).reshape(size(batch), size(free), size(contracting))


def _from_3d(x3: Array, shape, contracting, batch) -> Array:
    """The inverse of `_to_3d` for an array of `shape`: `x3` (batch, free,
    contracting) laid out as the operand again."""
    free = free_axes(len(shape), contracting, batch)
    order = [*batch, *free, *contracting]
    x = x3.reshape([shape[a] for a in order])
    return jnp.transpose(x, [int(a) for a in np.argsort(order)])


def _transposed(x3: Array) -> Array:
    return jnp.swapaxes(x3, 1, 2)


def _higher_order_refused(values: Any) -> Any:
    return values


# The identity around a backward pass's inputs, whose derivative is refused: the
# MXFP8 products have first-order derivatives only, like the other fp8 products
# (`_products`), whose message this repeats.
_first_order_only = jax.custom_jvp(_higher_order_refused)

_HIGHER_ORDER = (
    "MXFP8 matmuls (`eqx_amp.fp8.MXFP8`, `eqx_amp.fp8.dot_general(..., "
    "scaling='mxfp8')`) have first-order derivatives only: differentiating their "
    "backward pass again (a Hessian, a Hessian-vector product, `jax.jvp` of a "
    "gradient) would round the second-order terms to fp8 without scales. Keep the "
    "products such a derivative goes through out of fp8 (an `fp8_filter`, or a scope "
    "rule `eqx_amp.LOW`), or differentiate once."
)


@_first_order_only.defjvp
def _first_order_only_jvp(primals, tangents):
    del primals, tangents
    raise NotImplementedError(_HIGHER_ORDER)


def block_scaled_matmul(
    dims, shapes, out_dtype, lhs_dtype, rhs_dtype, grad_dtype, nvfp4_forward=False
):
    """The MXFP8 matmul `dot_general(lhs, rhs, dims)` of operands of `shapes` for
    one set of static arguments, with its derivative rule (with `nvfp4_forward`,
    the forward product is NVFP4's and the backward ones MXFP8): returned in
    `out_dtype`; the backward products emit `grad_dtype` (their scales are applied
    inside them, so any floating dtype of 16 bits or more has their range) and the
    gradients come back in the operands' dtypes. Called as `matmul(lhs, rhs,
    known)`, `known` a pair of `(values, scales)` or None per operand: the MXFP8
    form of an operand whose product contracts its last axis alone
    (`known_block_scaled`: a weight gathered in MXFP8), read by the forward
    product as it is; its gradient passes straight through it."""
    (lc, rc), (lb, rb) = dims
    lhs_shape, rhs_shape = shapes

    def product(lhs3, rhs3, known):
        known_lhs, known_rhs = known
        if nvfp4_forward:
            out3 = nv_product(lhs3, rhs3, out_dtype)
            return out3.reshape(_output_shape(lhs_shape, rhs_shape, dims))
        out3 = block_product(
            *_operands(
                mx_quantize(lhs3) if known_lhs is None else _known_3d(known_lhs),
                mx_quantize(rhs3) if known_rhs is None else _known_3d(known_rhs),
            ),
            out_dtype,
        )
        return out3.reshape(_output_shape(lhs_shape, rhs_shape, dims))

    @jax.custom_vjp
    @jax.named_scope(FP8_SCOPE)
    @jax.named_scope(MXFP8_SCOPE)
    def matmul(lhs, rhs, known):
        return product(_to_3d(lhs, lc, lb), _to_3d(rhs, rc, rb), known)

    @jax.named_scope(FP8_SCOPE)
    @jax.named_scope(MXFP8_SCOPE)
    def forward(lhs, rhs, known):
        # Differentiated only as part of a higher-order derivative.
        lhs, rhs = _first_order_only((lhs, rhs))
        lhs3, rhs3 = _to_3d(lhs, lc, lb), _to_3d(rhs, rc, rb)
        out = product(lhs3, rhs3, known)
        # Saved for the backward products, quantised along what they contract:
        # the lhs along its free axes (the weight gradient's tokens), the rhs
        # along its own (the input gradient's output features). Made after the
        # product, which tells `telemetry` whose input they are.
        residuals = (mx_quantize(lhs3, axis=1), mx_quantize(rhs3, axis=1))
        return out, (residuals, known)

    @jax.named_scope(FP8_SCOPE)
    @jax.named_scope(MXFP8_SCOPE)
    def backward(residuals, cotangent):
        (lhs_t, rhs_t), known, g3 = _backward_inputs(residuals, cotangent, shapes, dims)
        # d lhs (B, M, K) = g (B, M, N) . rhs^T (B, K, N): contracts N.
        dlhs3 = block_product(*_operands(mx_quantize(g3), rhs_t), grad_dtype)
        # d rhs^T (B, K, N) = lhs^T (B, K, M) . g^T (B, N, M): contracts M, and
        # comes out laid out as a (K, N) weight is.
        g3_t = mx_quantize(g3, axis=1)
        drhs3 = _transposed(block_product(*_operands(lhs_t, g3_t), grad_dtype))
        return _gradients(dlhs3, drhs3, shapes, dims, (lhs_dtype, rhs_dtype), known)

    matmul.defvjp(forward, backward)
    return matmul


def nv_product(lhs3: Array, rhs3: Array, out_dtype) -> Array:
    """`(B, M, K) x (B, N, K) -> (B, M, N)` with both operands in NVFP4 along `K`
    (`nv_quantize`), returned in `out_dtype` (`nv_block_product`)."""
    with jax.named_scope(NVFP4_SCOPE):
        lhs, rhs = nv_quantize(lhs3), nv_quantize(rhs3)
    return nv_block_product(lhs, rhs, out_dtype)


def nv_block_product(lhs, rhs, out_dtype) -> Array:
    """`(B, M, K) x (B, N, K) -> (B, M, N)` of two NVFP4 operands, each its values,
    block scales and tensor scale along `K`: the block scales applied in the GEMM
    (`block_product`), the two tensor scales to its output after, returned in
    `out_dtype`. The tensor scales are powers of two, so a bfloat16 product's GEMM
    writes its still-scaled sums in bfloat16 (half a float32 output's bytes; the
    numbers rounding after unscaling gives); a float16 one writes float32, whose
    range they need."""
    (lhs, lhs_scales, lhs_tensor_scale), (rhs, rhs_scales, rhs_tensor_scale) = lhs, rhs
    bfloat16 = jnp.dtype(out_dtype) == jnp.bfloat16
    emit = jnp.bfloat16 if bfloat16 else jnp.float32
    out = block_product(lhs, rhs, lhs_scales, rhs_scales, emit).astype(jnp.float32)
    inverses = (1.0 / lhs_tensor_scale, 1.0 / rhs_tensor_scale)
    return unscale(out, *inverses).astype(out_dtype)


def nvfp4_matmul(
    dims, shapes, out_dtype, lhs_dtype, rhs_dtype, grad_dtype, weight: int | None
):
    """The NVFP4 matmul `dot_general(lhs, rhs, dims)` of operands of `shapes`, its
    backward products in NVFP4 too, by NVIDIA's recipe: operand `weight` (0 for
    `lhs`, 1 for `rhs`, None for neither) quantised in 16 x 16 tiles, which the
    forward product and the other operand's gradient read alike; the output
    gradient rounded stochastically in both backward products; both inputs of the
    weight's gradient (the product contracting the other operand's free axes)
    rotated by `hadamard_16`. The other operand's form for the backward pass, NVFP4
    along its free axes, is saved in the forward pass (half a byte a value);
    contracting sizes of the backward products that are not multiples of 16 are
    padded with zeros. Called as `block_scaled_matmul`'s matmul is (`known` is
    not read: no weight is gathered in NVFP4)."""
    (lc, rc), (lb, rb) = dims
    lhs_shape, rhs_shape = shapes
    out_shape = _output_shape(lhs_shape, rhs_shape, dims)
    # The product contracting operand i's free axes makes operand 1 - i's gradient:
    # the weight's when 1 - i is the weight, whose inputs are rotated.
    rotated = (weight == 1, weight == 0)

    def forward_forms(lhs3, rhs3):
        """Each operand's form for the forward product, and a weight's for the
        backward product reading it (others' are made after the product)."""
        forms = []
        with jax.named_scope(NVFP4_SCOPE):
            for i, x3 in enumerate((lhs3, rhs3)):
                forms.append(
                    nv_quantize_tiles(x3) if i == weight else (nv_quantize(x3), None)
                )
        return forms

    @jax.custom_vjp
    @jax.named_scope(FP8_SCOPE)
    @jax.named_scope(MXFP8_SCOPE)
    def matmul(lhs, rhs, known):
        del known
        lhs3, rhs3 = _to_3d(lhs, lc, lb), _to_3d(rhs, rc, rb)
        (lhs_q, _), (rhs_q, _) = forward_forms(lhs3, rhs3)
        return nv_block_product(lhs_q, rhs_q, out_dtype).reshape(out_shape)

    @jax.named_scope(FP8_SCOPE)
    @jax.named_scope(MXFP8_SCOPE)
    def forward(lhs, rhs, known):
        lhs, rhs = _first_order_only((lhs, rhs))
        lhs3, rhs3 = _to_3d(lhs, lc, lb), _to_3d(rhs, rc, rb)
        (lhs_q, lhs_t), (rhs_q, rhs_t) = forward_forms(lhs3, rhs3)
        out = nv_block_product(lhs_q, rhs_q, out_dtype).reshape(out_shape)
        # Made after the product, which tells `telemetry` whose input they are.
        with jax.named_scope(NVFP4_SCOPE):
            if lhs_t is None:
                lhs_t = nv_quantize_along(
                    lhs3, 1, rotated=rotated[0], tensor_scale=lhs_q[2]
                )
            if rhs_t is None:
                rhs_t = nv_quantize_along(
                    rhs3, 1, rotated=rotated[1], tensor_scale=rhs_q[2]
                )
        return out, ((lhs_t, rhs_t), known)

    @jax.named_scope(FP8_SCOPE)
    @jax.named_scope(MXFP8_SCOPE)
    def backward(residuals, cotangent):
        (lhs_t, rhs_t), known, g3 = _backward_inputs(residuals, cotangent, shapes, dims)
        with jax.named_scope(NVFP4_SCOPE):
            # Not bounded by the other form's tensor scale, as the forward's
            # operand is: that would order the two passes over `g3`, which XLA
            # otherwise reads once for both (19 kernels more in a B200 compile
            # of a Llama-style block). A gradient near float32's largest makes
            # a weight gradient past it whatever its rotation.
            g_n = nv_quantize_along(g3, 2, rotated=rotated[1], stochastic=True)
            g_m = nv_quantize_along(g3, 1, rotated=rotated[0], stochastic=True)
        # d lhs (B, M, K) = g (B, M, N) . rhs^T (B, K, N): contracts N.
        dlhs3 = nv_block_product(g_n, rhs_t, grad_dtype)
        # d rhs^T (B, K, N) = lhs^T (B, K, M) . g^T (B, N, M): contracts M.
        drhs3 = _transposed(nv_block_product(lhs_t, g_m, grad_dtype))
        return _gradients(dlhs3, drhs3, shapes, dims, (lhs_dtype, rhs_dtype), known)

    matmul.defvjp(forward, backward)
    return matmul


def _backward_inputs(residuals, cotangent, shapes, dims) -> tuple:
    """What a block-scaled matmul's backward pass starts from: its saved operand
    forms, the recorded forms `known`, and the output gradient as `(batch, free,
    free)`; a second derivative refused."""
    residuals, known = residuals
    operands, cotangent = _first_order_only((residuals, cotangent))
    lhs_shape, rhs_shape = shapes
    return operands, known, cotangent.reshape(_output_3d(lhs_shape, rhs_shape, dims))


def _gradients(dlhs3, drhs3, shapes, dims, dtypes, known) -> tuple:
    """A block-scaled matmul's cotangents from its backward products' `(batch,
    free, contracting)` outputs: each laid out as its operand and in its dtype,
    and zeros for the recorded forms `known` (not differentiated)."""
    (lc, rc), (lb, rb) = dims
    (lhs_shape, rhs_shape), (lhs_dtype, rhs_dtype) = shapes, dtypes
    dlhs = _from_3d(dlhs3, lhs_shape, lc, lb).astype(lhs_dtype)
    drhs = _from_3d(drhs3, rhs_shape, rc, rb).astype(rhs_dtype)
    return dlhs, drhs, jax.tree.map(jnp.zeros_like, known)


def _operands(lhs: tuple[Array, Array], rhs: tuple[Array, Array]):
    """`block_product`'s arguments from two (values, scales) pairs."""
    (ql, sl), (qr, sr) = lhs, rhs
    return ql, qr, sl, sr


def _output_shape(lhs_shape, rhs_shape, dims) -> tuple[int, ...]:
    (lc, rc), (lb, rb) = dims
    return (
        *(lhs_shape[a] for a in lb),
        *(lhs_shape[a] for a in free_axes(len(lhs_shape), lc, lb)),
        *(rhs_shape[a] for a in free_axes(len(rhs_shape), rc, rb)),
    )


def _output_3d(lhs_shape, rhs_shape, dims) -> tuple[int, int, int]:
    """The output as `(batch, lhs free, rhs free)`, each group flattened."""
    (lc, rc), (lb, rb) = dims
    size = lambda shape, axes: int(np.prod([shape[a] for a in axes], dtype=np.int64))  # noqa: E731
    return (
        size(lhs_shape, lb),
        size(lhs_shape, free_axes(len(lhs_shape), lc, lb)),
        size(rhs_shape, free_axes(len(rhs_shape), rc, rb)),
    )


# The primitive under `jax.nn.scaled_matmul` (the CUDA branch of `block_product`),
# known by name: JAX exports no handle on it (jax 0.10). The other branch's
# `scaled_dot` is the same product, for other platforms: reports count this one.
_BLOCK_SCALED_PRIMITIVE = "scaled_matmul_wrapper"


def is_block_product(eqn: Any) -> bool:
    """Whether `eqn` is one MXFP8 product as `block_product` makes it: a `cond` over
    the platforms' forms (one is lowered), reading `(index, lhs, rhs, lhs_scales,
    rhs_scales)` and making the product."""
    if eqn.primitive is not compat.cond_p or not compat.branch_platforms(eqn.params):
        return False

    def holds(jaxpr: Any) -> bool:
        return any(
            block_scaled_flops(e) is not None
            or any(map(holds, compat.sub_jaxprs(e.params)))
            for e in compat.open_jaxpr(jaxpr)[0].eqns
        )

    return any(map(holds, eqn.params["branches"]))


def block_scaled_flops(eqn: Any) -> int | None:
    """The FLOPs of `eqn` if it is a block-scaled product (`(B, M, K) x (B, N, K)`),
    else None."""
    if eqn.primitive.name != _BLOCK_SCALED_PRIMITIVE:
        return None
    (b, m, k), n = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape[1]
    return 2 * b * m * n * k
