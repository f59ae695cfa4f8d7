"""The fp8 products and their derivative rules: matmuls (tensorwise or rowwise
scales) and convolutions (tensorwise, fp8 forward only), first-order only."""

import contextlib
import contextvars
import functools as ft
import weakref
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array

from .._core._platform import CPU_SUMS_HALF_PRODUCTS_IN_HALF, with_cpu_form
from .._jaxpr import _compat as compat
from ._scaling import (
    E4M3,
    E5M2,
    finite_amax,
    quantize,
    quantize_and_amax,
    scale_from_amax,
    unscale,
)
from ._shapes import BLOCK, fp8_eligible, free_axes


# The named scope fp8 products run under, and the one products an fp8 rule left in
# the compute dtype run under (the reason follows, after a colon): `precision_report`
# reads both.
FP8_SCOPE = "eqx_amp.fp8"
# Inside it, the amaxes of weights taken before any product (once per call, or per
# shard for an fp8 all-gather): the benchmarks find their all-reduces by it.
WEIGHT_AMAX_SCOPE = "weight_amaxes"
FP8_SKIPPED_SCOPE = "eqx_amp.fp8_skipped"


# Arrays whose tensorwise fp8 values are already known: a weight all-gathered in
# fp8 (`gather_params(..., fp8=...)`) or quantised once for all of a call's
# products (`quantize_weights_once`), keyed by `id` (tracers are unhashable). A
# tensorwise fp8 product reading one of them reads those fp8 values and that
# scale, so nothing quantises the weight again.
#
# The table holds weak references only. Holding the fp8 tracers would keep their
# trace, and every tracer of it, alive past the trace (and the weight too, so the
# entry would never go). A gathered weight is computed from its fp8 values, so they
# live as long as it does; the weights quantised once per call have their fp8 values
# held by `holding_fp8_values()` around the call, which lets them go when it ends.
_known: dict[int, tuple[weakref.ref, weakref.ref, weakref.ref]] = {}
_held: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "eqx_amp_fp8_held", default=None
)


@contextlib.contextmanager
def holding_fp8_values() -> Iterator[None]:
    """Within it, the fp8 values `remember_fp8` records are held (an fp8 road's
    evaluation, whose products read weights quantised before them); after it, only
    what still uses them does."""
    token = _held.set([])
    try:
        yield
    finally:
        _held.reset(token)


def remember_fp8(array: Array, quantized: Array, scale: Array) -> Array:
    """Records that `array`'s fp8 form is `quantized` with `scale` (tensorwise: a
    float32 scalar; MXFP8: e8m0 block scales along its last axis); returns `array`.
    Only for a traced `array`: a concrete one outlives the trace whose values would
    be recorded for it (a closed-over weight is quantised where it is read). The
    record lasts while `array`, `quantized` and `scale` all live: `array` computed
    from the other two, or within `holding_fp8_values()`."""
    if not compat.is_traced(array):
        return array
    key = id(array)
    # The callbacks hold the dict itself, not the module global, which is gone at
    # interpreter exit.
    drop = lambda _, known=_known: known.pop(key, None)  # noqa: E731
    _known[key] = (
        weakref.ref(array, drop),
        weakref.ref(quantized),
        weakref.ref(scale),
    )
    held = _held.get()
    if held is not None:
        held.append((quantized, scale))
    return array


def _recorded(array: Any) -> tuple[Array, Array] | None:
    entry = _known.get(id(array))
    if entry is None or entry[0]() is not array:
        return None
    quantized, scale = entry[1](), entry[2]()
    if quantized is None or scale is None or quantized.shape != array.shape:
        return None
    return quantized, scale


def known_fp8(array: Any) -> tuple[Array, Array] | None:
    """`array`'s tensorwise fp8 values and scale (shaped to broadcast against it),
    if recorded and alive."""
    found = _recorded(array)
    if found is None or found[1].size != 1:
        return None
    quantized, scale = found
    return quantized, jnp.reshape(scale, (1,) * array.ndim)


def known_block_scaled(array: Any) -> tuple[Array, Array] | None:
    """`array`'s MXFP8 values and block scales (one per `BLOCK` values along its last
    axis), if recorded and alive."""
    found = _recorded(array)
    if found is None or found[1].shape != (
        *array.shape[:-1],
        -(-array.shape[-1] // BLOCK),
    ):
        return None
    return found


def _laid_out(scale: Array, axis_map: dict[int, int], ndim: int) -> Array:
    """A scale (its axes outside `axis_map` of size 1) laid out for an array of `ndim`
    axes: its axis `a` becomes axis `axis_map[a]`, the others size 1."""
    src = sorted(axis_map)
    values = scale.reshape([scale.shape[a] for a in src])
    values = jnp.transpose(
        values, sorted(range(len(src)), key=lambda i: axis_map[src[i]])
    )
    shape = [1] * ndim
    for a in src:
        shape[axis_map[a]] = scale.shape[a]
    return values.reshape(shape)


def _output_axes(dims, lhs_ndim: int, rhs_ndim: int):
    """The output axes of `dot_general` (batch, lhs free, rhs free) that each
    operand's batch and free axes become."""
    (lc, rc), (lb, rb) = dims
    lf, rf = free_axes(lhs_ndim, lc, lb), free_axes(rhs_ndim, rc, rb)
    nb, nlf = len(lb), len(lf)
    lhs_map = {
        **{a: i for i, a in enumerate(lb)},
        **{a: nb + j for j, a in enumerate(lf)},
    }
    rhs_map = {
        **{a: i for i, a in enumerate(rb)},
        **{a: nb + nlf + j for j, a in enumerate(rf)},
    }
    return lhs_map, rhs_map


@jax.named_scope(FP8_SCOPE)
def _fp8_forward(
    lhs, rhs, dims, scaling, out_dtype, known=(None, None), scales_in_gemm=False
):
    (lc, rc), _ = dims
    if scaling == "tensorwise":
        l_axes, r_axes = tuple(range(lhs.ndim)), tuple(range(rhs.ndim))
    else:  # one scale per row: per output element of the other dims
        l_axes, r_axes = tuple(lc), tuple(rc)
    known_lhs, known_rhs = known
    ql, sl = quantize(lhs, E4M3, l_axes) if known_lhs is None else known_lhs
    qr, sr = quantize(rhs, E4M3, r_axes) if known_rhs is None else known_rhs
    if scales_in_gemm and fp8_eligible(ql.shape, qr.shape, dims) is None:
        out = _product_applying_scales(ql, sl, qr, sr, dims, product_dtype(out_dtype))
        return out.astype(out_dtype), (ql, sl, qr, sr)
    # The GEMM writes the compute dtype where it has the range of the still-scaled
    # sums (bfloat16: half the bytes of float32 for the GEMM and the kernel that
    # reads its output). The scales are powers of two, so unscaling after rounding
    # gives the numbers unscaling before it would.
    out = _fp8_product(ql, qr, dims, product_dtype(out_dtype))
    lhs_map, rhs_map = _output_axes(dims, lhs.ndim, rhs.ndim)
    out = unscale(
        out.astype(jnp.float32),
        _laid_out(1.0 / sl, lhs_map, out.ndim),
        _laid_out(1.0 / sr, rhs_map, out.ndim),
    )
    if scaling == "tensorwise":
        residuals = (ql, sl, qr, sr)  # fp8 operands and float32 scales: 1 byte a value
    else:
        # The backward products contract other axes, so they need other rows'
        # scales: the operands are quantised again there (torchao's rowwise recipe).
        residuals = (lhs, rhs)
    return out.astype(out_dtype), residuals


def _product_applying_scales(
    ql: Array, sl: Array, qr: Array, sr: Array, dims, dtype: Any
) -> Array:
    """The product of two tensorwise-scaled fp8 operands, unscaled, in `dtype`.
    Compiled for a GPU it is the dot of their dequantised values
    (`dequantized_product`), which a CPU would run as a bfloat16 dot: a CPU runs
    it as the other fp8 products do (`_fp8_product`, then `unscale`)."""

    def unscaled_after(ql, qr, sl, sr):
        out = _fp8_product(ql, qr, dims, dtype).astype(jnp.float32)
        return unscale(out, 1.0 / sl, 1.0 / sr).astype(dtype)

    sl, sr = sl.reshape(()), sr.reshape(())  # tensorwise: one scale each
    default = ft.partial(dequantized_product, dims=dims, dtype=dtype)
    return with_cpu_form(ql, qr, sl, sr, cpu=unscaled_after, default=default)


def dequantized_product(
    ql: Array,
    qr: Array,
    sl: Array,
    sr: Array,
    *,
    dims,
    dtype: Any,
) -> Array:
    """`dot_general` of `ql / sl` and `qr / sr` (fp8 values and their scalar
    scales) in `dtype`: the pattern XLA's GPU GEMM rewriter turns into cuBLASLt's
    fp8 GEMM with the inverse scales as operands. The GEMM then writes the unscaled
    product, and a residual added to it becomes its C operand, as in a bfloat16
    GEMM: no kernel reads the product to unscale it or to add the residual.

    The GEMM multiplies the two inverses together in float32: each scale must be
    within 2**±63 (`DelayedScaling`'s operand scales are), so that the factor is a
    normal float32 and every dequantised value a normal `dtype`, exactly (a power
    of two times an fp8 value)."""
    # Each product's two operands behind a barrier of their own: otherwise XLA
    # merges products that share an operand (q, k and v read one activation) into
    # one over a concatenation of differently scaled operands, which no fp8 GEMM
    # takes (compiled for an H100: a bfloat16 GEMM). A barrier around the shared
    # operand alone is the same in every product, and XLA merges those first.
    # Under FSDP the forward GEMM then gathers its weight apart from the backward
    # products (in fp8: 0.82x hand-cast's gathered bytes at the GPT size, against
    # 0.52x).
    ql, qr = lax.optimization_barrier((ql, qr))
    lhs = ql.astype(dtype) * (1.0 / sl).astype(dtype)
    rhs = qr.astype(dtype) * (1.0 / sr).astype(dtype)
    return lax.dot_general(lhs, rhs, dims, preferred_element_type=dtype)


def _fp8_product(
    lhs: Array, rhs: Array, dims, dtype: Any = jnp.float32, *, backward: bool = False
) -> Array:
    """The product of two fp8 arrays, accumulated in float32. The dot reads the fp8
    arrays themselves: with conversions up in front of it, XLA may merge dots that
    share an operand (a layer's q, k, v projections) into one that reads a
    concatenation of the conversions, and drop the fp8 round trip as excess
    precision: a float32 GEMM on an H100 (`--preset h100-aot` shows both). The
    backward products emit `dtype`, the gradient-reduction dtype: under GSPMD a
    weight's gradient is summed across devices right on their output.

    The backward products ask for `Precision.HIGHEST`: at the default precision XLA
    gives cuBLASLt's fp8 GEMM its fast accumulation, whose partial sums lose bits on
    Hopper. A weight's gradient sums over every token of the batch (thousands), and
    on an H100 a GPT trained with fast-accumulated backward products ended 12.7%
    above bfloat16's loss after 14 steps, and 0.06% with HIGHEST, at the same step
    time (`benchmarks/RESULTS.md`, the GPU section). The forward products keep fast accumulation
    (short sums), as Transformer Engine's recipe does."""
    if fp8_eligible(lhs.shape, rhs.shape, dims) is not None:
        # No fp8 GEMM takes this shape. Handed to XLA as it is, an H100 turns
        # the product into one of float16 operands, whose products overflow at
        # these scales (448 * 57344 > 65504): inf and NaN where float32 is finite
        # (measured: `benchmarks/gpu_fp8_fallback.py`). The fp8 values are
        # multiplied in float32 instead, exactly, as a CPU does.
        lhs, rhs = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
        exact = lax.dot_general(
            lhs, rhs, dims, precision=lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )  # fmt: skip
        return exact.astype(dtype)
    precision = lax.Precision.HIGHEST if backward else None

    def product(lhs, rhs, emit=dtype):
        return lax.dot_general(
            lhs, rhs, dims, precision=precision, preferred_element_type=emit
        ).astype(dtype)

    if not (backward and CPU_SUMS_HALF_PRODUCTS_IN_HALF):
        return product(lhs, rhs)
    # Long sums (a weight gradient's over the batch), which such a CPU may take in
    # bfloat16: there it emits float32 and rounds once.
    cpu = ft.partial(product, emit=jnp.float32)
    return with_cpu_form(lhs, rhs, cpu=cpu, default=product)


def _operand_cotangent(
    cotangent: Array, other: Array, dims, ndim: int, of_lhs: bool, dtype: Any
) -> Array:
    """The cotangent of one operand of `dot_general(lhs, rhs, dims)` (of `ndim`
    axes) from the output's: the output cotangent contracted with `other` over
    other's free axes, as one fp8 product, then laid out as the operand."""
    (lc, rc), (lb, rb) = dims
    own, others = ((lc, lb), (rc, rb)) if of_lhs else ((rc, rb), (lc, lb))
    (contracting, batch), (other_contracting, other_batch) = own, others
    own_free = free_axes(ndim, contracting, batch)
    other_free = free_axes(other.ndim, other_contracting, other_batch)
    # The output's axes: batch, then lhs free, then rhs free.
    first = len(batch) + (len(own_free) if of_lhs else 0)
    product = _fp8_product(
        cotangent,
        other,
        (
            (tuple(range(first, first + len(other_free))), tuple(other_free)),
            (tuple(range(len(batch))), tuple(other_batch)),
        ),
        dtype,
        backward=True,
    )
    # The product's axes: batch, the operand's free axes, then other's contracting
    # axes in increasing order, each standing for the operand axis it contracted.
    ranks = sorted(other_contracting)
    after = len(batch) + len(own_free)
    source = {
        **{a: i for i, a in enumerate(batch)},
        **{a: len(batch) + j for j, a in enumerate(own_free)},
        **{a: after + ranks.index(o) for a, o in zip(contracting, other_contracting)},
    }
    return jnp.transpose(product, [source[a] for a in range(ndim)])


_HIGHER_ORDER = (
    "fp8 matmuls and convolutions (`eqx_amp.fp8.dot_general`, the fp8 rules, "
    "`fp8=`) have first-order derivatives only: differentiating their backward pass "
    "again (a Hessian, a Hessian-vector product, `jax.jvp` of a gradient) would round "
    "the second-order terms to fp8 without scales. Keep the products such a "
    "derivative goes through out of fp8 (an `fp8_filter`, or a scope rule "
    "`eqx_amp.LOW`), or differentiate once."
)


@jax.custom_jvp
def first_order_only(values: Any) -> Any:
    """The identity, whose derivative is refused: around a backward pass's inputs,
    it makes differentiating that pass an error rather than a wrong number."""
    return values


@first_order_only.defjvp
def _first_order_only_jvp(primals, tangents):
    del primals, tangents
    raise NotImplementedError(_HIGHER_ORDER)


def transposed(linear: Any, like: Any, cotangent: Array) -> Array:
    """The transpose of the linear `linear` (a product with its other operand held)
    at `cotangent`, in the cotangent's dtype, with no forward product (`jax.vjp`
    would add a dead one)."""
    aval = jax.ShapeDtypeStruct(like.shape, cotangent.dtype)
    return jax.linear_transpose(linear, aval)(cotangent)[0]


def product_dtype(dtype: Any) -> np.dtype:
    """The dtype a backward fp8 product emits, before its scales are applied:
    `dtype` if it has bfloat16's range, else float32. The sums of scaled values
    reach 448 * 57344 * the contracted size, past float16's 65504: a float16
    product would be inf where the gradient is finite."""
    dtype = jnp.dtype(dtype)
    if jnp.finfo(dtype).max >= jnp.finfo(jnp.bfloat16).max:
        return dtype
    return jnp.dtype(jnp.float32)


def _rowwise_cotangent(cotangent, lhs, rhs, dims, of_lhs: bool, dtype) -> Array:
    """The cotangent of one operand of a rowwise fp8 matmul: the output cotangent
    and the other operand quantised per row of this backward product (amax over the
    other operand's free axes, which it contracts), scales applied outside it."""
    (lc, rc), (lb, rb) = dims
    lhs_map, rhs_map = _output_axes(dims, lhs.ndim, rhs.ndim)
    if of_lhs:
        own, other, own_map, other_map = lhs, rhs, lhs_map, rhs_map
        # Each axis of `other` stands for the operand axis it is paired with.
        paired = {**dict(zip(rb, lb)), **dict(zip(rc, lc))}
        other_free = free_axes(rhs.ndim, rc, rb)
    else:
        own, other, own_map, other_map = rhs, lhs, rhs_map, lhs_map
        paired = {**dict(zip(lb, rb)), **dict(zip(lc, rc))}
        other_free = free_axes(lhs.ndim, lc, lb)
    qg, sg = quantize(cotangent, E5M2, tuple(other_map[a] for a in other_free))
    qo, so = quantize(other, E4M3, tuple(other_free))
    product = _operand_cotangent(qg, qo, dims, own.ndim, of_lhs, dtype)
    return unscale(
        product.astype(jnp.float32),
        _laid_out(1.0 / sg, {out: a for a, out in own_map.items()}, own.ndim),
        _laid_out(1.0 / so, paired, own.ndim),
    )


def fp8_matmul(dims, scaling, out_dtype, lhs_dtype, rhs_dtype, grad_dtype):
    """The fp8 matmul for one set of static arguments, with its derivative rule,
    whose products emit `grad_dtype` (the dtype GSPMD reduces gradients in) where
    it has the range of their still-scaled sums, else float32. It is called as
    `matmul(lhs, rhs, known)`, `known` a pair of `(fp8 values, scale)` or None per
    operand (`known_fp8`; tensorwise only): those operands are read in that form,
    and their gradients pass straight through it."""
    grad_dtype = product_dtype(grad_dtype)

    @jax.custom_vjp
    def matmul(lhs, rhs, known):
        return _fp8_forward(lhs, rhs, dims, scaling, out_dtype, known)[0]

    def forward(lhs, rhs, known):
        out, residuals = _fp8_forward(lhs, rhs, dims, scaling, out_dtype, known)
        return out, (residuals, known)

    @jax.named_scope(FP8_SCOPE)
    def backward(residuals, cotangent):
        residuals, known = residuals
        grads = _backward(residuals, cotangent)
        return (*grads, jax.tree.map(jnp.zeros_like, known))

    def _backward(residuals, cotangent):
        residuals, cotangent = first_order_only((residuals, cotangent))
        if scaling == "tensorwise":
            # Scalar scales come out of the products: fp8 x fp8 GEMMs.
            ql, sl, qr, sr = residuals
            qg, sg = quantize(cotangent, E5M2, tuple(range(cotangent.ndim)))
            dlhs = _operand_cotangent(qg, qr, dims, ql.ndim, True, grad_dtype)
            drhs = _operand_cotangent(qg, ql, dims, qr.ndim, False, grad_dtype)
            inverse_g = 1.0 / sg.reshape(())
            dlhs, drhs = dlhs.astype(jnp.float32), drhs.astype(jnp.float32)
            dlhs = unscale(dlhs, inverse_g, 1.0 / sr.reshape(()))
            drhs = unscale(drhs, inverse_g, 1.0 / sl.reshape(()))
            return dlhs.astype(lhs_dtype), drhs.astype(rhs_dtype)
        # Rowwise: each product's operands are quantised per row of that product
        # (amax over the axes it contracts), so that both scales come out of it.
        lhs, rhs = residuals
        dlhs = _rowwise_cotangent(cotangent, lhs, rhs, dims, True, grad_dtype)
        drhs = _rowwise_cotangent(cotangent, lhs, rhs, dims, False, grad_dtype)
        return dlhs.astype(lhs_dtype), drhs.astype(rhs_dtype)

    matmul.defvjp(forward, backward)
    return matmul


def fp8_matmul_delayed(
    dims, out_dtype, lhs_dtype, rhs_dtype, grad_dtype, observe, scales_in_gemm
):
    """A tensorwise fp8 matmul with delayed scales (`_delayed`), called as
    `matmul(lhs, rhs, known, g_scale, handed_out)`: both operands' fp8 forms
    `known`, the output gradient's scale `g_scale` (None: its own amax's), and
    `handed_out = (g_receiver, g_unit, receivers, amaxes)`: arrays whose
    cotangents are to be `observe(amax, dtype)` of the output gradient (its amax
    times `g_unit`) and of each of `amaxes`. The backward pass takes the output
    gradient's amax in the pass that quantises it. With `scales_in_gemm` (both
    operands' scales within 2**±63) the forward GEMM applies the scales itself
    (`_product_applying_scales`)."""
    grad_dtype = product_dtype(grad_dtype)
    forward_product = ft.partial(
        _fp8_forward,
        dims=dims,
        scaling="tensorwise",
        out_dtype=out_dtype,
        scales_in_gemm=scales_in_gemm,
    )

    @jax.custom_vjp
    def matmul(lhs, rhs, known, g_scale, handed_out):
        return forward_product(lhs, rhs, known=known)[0]

    def forward(lhs, rhs, known, g_scale, handed_out):
        # The fp8 forms were made without a derivative, so a derivative of this
        # pass (a Hessian's forward-over-reverse) would see none: refuse it here.
        first_order_only((lhs, rhs))
        out, residuals = forward_product(lhs, rhs, known=known)
        return out, (residuals, known, g_scale, handed_out)

    @jax.named_scope(FP8_SCOPE)
    def backward(residuals, cotangent):
        residuals, known, g_scale, handed_out = residuals
        g_receiver, g_unit, receivers, amaxes = handed_out
        (ql, sl, qr, sr), cotangent = first_order_only((residuals, cotangent))
        given = g_scale
        if g_scale is None:  # current scaling, observed (`DelayedScaling.init`)
            every = tuple(range(cotangent.ndim))
            g_scale = scale_from_amax(finite_amax(cotangent, every).reshape(()), E5M2)
        qg, g_amax = quantize_and_amax(cotangent, g_scale, E5M2)
        if given is not None:
            # A scale known before the gradient is made lets its quantisation fuse
            # into the kernel that makes it, beside its amax. XLA fuses a transpose
            # with elementwise work but not with a reduction: left alone, it wrote
            # the gradient in bfloat16 and quantised it again in a second pass that
            # also made the transposed fp8 copy the weight's GEMM reads. Behind a
            # barrier that copy is a pass of its own over the fp8 values (1 byte a
            # value, not 2 + 2). On the H100 roofline (RESULTS.md) the delayed
            # GPT-2-small-sized step went from 0.933x to 0.898x hand-cast bfloat16's.
            qg = lax.optimization_barrier(qg)
        dlhs = _operand_cotangent(qg, qr, dims, ql.ndim, True, grad_dtype)
        drhs = _operand_cotangent(qg, ql, dims, qr.ndim, False, grad_dtype)
        inverse_g = 1.0 / g_scale
        dlhs, drhs = dlhs.astype(jnp.float32), drhs.astype(jnp.float32)
        dlhs = unscale(dlhs, inverse_g, 1.0 / sr.reshape(()))
        drhs = unscale(drhs, inverse_g, 1.0 / sl.reshape(()))
        # Each hit counts the loss scale, which unscaling the gradients divides
        # out: a count of 2**-127 would be flushed to zero on the way.
        count = 1.0 / g_unit
        observed = (
            observe(g_amax * g_unit, E5M2) * count,
            jnp.zeros_like(g_unit),
            tuple(observe(amax, E4M3) * count for amax in amaxes),
            jax.tree.map(jnp.zeros_like, amaxes),
        )
        return (
            dlhs.astype(lhs_dtype),
            drhs.astype(rhs_dtype),
            jax.tree.map(jnp.zeros_like, known),
            None if given is None else jnp.zeros_like(given),
            observed,
        )

    matmul.defvjp(forward, backward)
    return matmul


def varying_alike(*operands: Array) -> tuple[Array, ...]:
    """`operands` each typed as varying over every `jax.shard_map` axis one of them
    varies over. `lax.dot_general` makes that cast itself (its transpose sums the
    gradient of a replicated operand over those axes); an fp8 product's derivative
    rule must be given operands cast alike, or its gradient for a replicated
    operand would be typed as varying."""
    axes = frozenset().union(*map(compat.varying_axes, operands))
    return tuple(varying_over(x, axes) for x in operands)


def varying_over(x: Array, axes: frozenset) -> Array:
    """`x` typed as varying over `axes` (the `shard_map` axes among them it is not
    typed as varying over yet are cast)."""
    missing = tuple(sorted(axes - compat.varying_axes(x), key=str))
    return lax.pcast(x, missing, to="varying") if missing else x
