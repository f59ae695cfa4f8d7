"""fp8 matmuls with current scaling: no state, scales from each tensor's own amax.

The forward operands are quantised to `float8_e4m3fn` and the backward pass's output
gradient to `float8_e5m2` (more range, less precision: gradients need it), each
with a float32 scale computed from the tensor's absolute maximum right before use
("current" scaling; delayed scaling keeps a history of amaxes in state, which goes
stale). The matmul multiplies the fp8 values (converted up, which is the pattern
XLA rewrites into an fp8 GEMM on GPUs that have one), accumulates in float32 and
applies the scales to its output; so do the backward products, forward-scaled
rowwise ones included. Derivatives come from `jax.custom_vjp`, so the backward pass
is exactly the one written here, and differentiating it again is refused.
"""

import functools as ft
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array

from ._core._cast import floating_dtype
from ._jaxpr import _compat as compat
from ._jaxpr._evaluate import batched_like, evaluate_function
from ._jaxpr._hook import Hook, Origin


E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
# The named scope fp8 matmuls run under, and the one matmuls an fp8 rule left in the
# compute dtype run under (the reason follows, after a colon): `precision_report`
# reads both.
FP8_SCOPE = "eqx_amp.fp8"
FP8_SKIPPED_SCOPE = "eqx_amp.fp8_skipped"
# fp8 GEMMs (cuBLASLt on Hopper) need every dimension to be a multiple of 16.
FP8_MULTIPLE = 16
Scaling = Literal["tensorwise", "rowwise"]
_SCALINGS = ("tensorwise", "rowwise")


class Fp8Rule:
    """`eqx_amp.fp8.TENSORWISE` and `ROWWISE`: `dot_general` runs as an fp8 matmul with current
    scaling (`eqx_amp.fp8.dot_general`) from operands cast to the compute dtype,
    where its shapes allow an fp8 GEMM (every dimension a multiple of 16), and
    `conv_general_dilated` as an fp8 convolution (tensorwise, feature counts
    multiples of 16); the others stay in the compute dtype, and `precision_report`
    says why. Other ops under an fp8 scope rule follow their own primitive's rule."""

    def __init__(self, name: str, scaling: str):
        self.name = name
        self.scaling = scaling
        self.__doc__ = Fp8Rule.__doc__

    def __call__(self, *args, **kwargs):
        raise TypeError(
            f"eqx_amp.fp8.{self.name} is applied by `autocast` itself (it rebinds the "
            "matmul); it cannot be called as a rule function."
        )

    def run_in_fp8(
        self, fn: Callable, args: tuple, kwargs: dict, params: list[Any]
    ) -> Any:
        """`fn(*args, **kwargs)` with each matmul that reads one of `params` run as
        an fp8 matmul where its shapes allow one (`filter_amp(..., fp8=...)`, which
        reaches fp8 through this method rather than importing it)."""
        return evaluate_function(
            _call, (fn, args, kwargs), Fp8ParamsHook(self.scaling), param_arrays=params
        )

    def __repr__(self) -> str:
        return f"eqx_amp.fp8.{self.name}"

    def __reduce__(self):
        return self.name


TENSORWISE = Fp8Rule("TENSORWISE", "tensorwise")
ROWWISE = Fp8Rule("ROWWISE", "rowwise")


# The largest scale: its inverse, 2**-126, is float32's smallest normal, so unscaling
# never goes through float32 subnormals (which some backends flush), and a float32
# normal scaled by it (>= 1) is still a normal fp8 value (e4m3's smallest is 2**-6).
MAX_SCALE = 2.0**126


def _scale(x: Array, dtype: np.dtype, axes: tuple[int, ...]) -> Array:
    """float32 scale mapping the largest finite magnitude of `x` over `axes` (kept as
    size-1 axes) to the largest finite value of `dtype`, at most `MAX_SCALE` (an
    all-zero or tiny slice). inf and NaN elements do not set it: they stay
    non-finite through the product, as they would in float32."""
    magnitude = jnp.abs(x.astype(jnp.float32))
    finite = jnp.where(jnp.isfinite(magnitude), magnitude, 0.0)
    amax = jnp.max(finite, axis=axes, keepdims=True, initial=0.0)
    largest = float(jnp.finfo(dtype).max)
    # Dividing by at least `largest / MAX_SCALE` cannot overflow: no inf scale,
    # whose `0 * inf` would make the whole product NaN.
    return largest / jnp.maximum(amax, largest / MAX_SCALE)


def _quantize(x: Array, dtype: np.dtype, axes: tuple[int, ...]) -> tuple[Array, Array]:
    scale = _scale(x, dtype, axes)
    largest = float(jnp.finfo(dtype).max)
    scaled = x.astype(jnp.float32) * scale
    # Rounding can step just past the largest finite value, which e4m3fn would make
    # NaN; inf and NaN pass on (inf becomes NaN in e4m3fn, which has no inf).
    clipped = jnp.clip(scaled, -largest, largest)
    scaled = jnp.where(jnp.isfinite(scaled), clipped, scaled)
    return scaled.astype(dtype), scale


def _unscale(product: Array, inverse_a: Array, inverse_b: Array) -> Array:
    """`product * inverse_a * inverse_b` (positive inverse scales, broadcast to the
    product) without leaving float32's range on the way: the two inverses as one
    factor where that is a normal float32, otherwise the larger one first, whose
    product can only overflow (or the smaller's underflow) where the result does."""
    f32 = jnp.finfo(jnp.float32)
    both = inverse_a * inverse_b
    in_range = (both >= f32.tiny) & (both <= f32.max)
    larger, smaller = (
        jnp.maximum(inverse_a, inverse_b),
        jnp.minimum(inverse_a, inverse_b),
    )
    return jnp.where(in_range, product * both, product * larger * smaller)


def _free_axes(
    ndim: int, contracting: Sequence[int], batch: Sequence[int]
) -> list[int]:
    return [i for i in range(ndim) if i not in contracting and i not in batch]


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
    lf, rf = _free_axes(lhs_ndim, lc, lb), _free_axes(rhs_ndim, rc, rb)
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
def _fp8_forward(lhs, rhs, dims, scaling, out_dtype):
    (lc, rc), _ = dims
    if scaling == "tensorwise":
        l_axes, r_axes = tuple(range(lhs.ndim)), tuple(range(rhs.ndim))
    else:  # one scale per row: per output element of the other dims
        l_axes, r_axes = tuple(lc), tuple(rc)
    ql, sl = _quantize(lhs, E4M3, l_axes)
    qr, sr = _quantize(rhs, E4M3, r_axes)
    out = _dot32(ql, qr, dims)
    lhs_map, rhs_map = _output_axes(dims, lhs.ndim, rhs.ndim)
    out = _unscale(
        out,
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


def _dot32(lhs: Array, rhs: Array, dims) -> Array:
    """The product of fp8 values, read as float32 (exactly) and accumulated in it:
    converts from fp8 in front of a dot are what XLA rewrites into an fp8 GEMM."""
    return lax.dot_general(
        lhs.astype(jnp.float32),
        rhs.astype(jnp.float32),
        dims,
        preferred_element_type=jnp.float32,
    )


_HIGHER_ORDER = (
    "fp8 matmuls and convolutions (`eqx_amp.fp8.dot_general`, the fp8 rules, "
    "`fp8=`) have first-order derivatives only: differentiating their backward pass "
    "again (a Hessian, a Hessian-vector product, `jax.jvp` of a gradient) would round "
    "the second-order terms to fp8 without scales. Keep the products such a "
    "derivative goes through out of fp8 (an `fp8_filter`, or a scope rule "
    "`eqx_amp.LOW`), or differentiate once."
)


@jax.custom_jvp
def _first_order_only(values: Any) -> Any:
    """The identity, whose derivative is refused: around a backward pass's inputs,
    it makes differentiating that pass an error rather than a wrong number."""
    return values


@_first_order_only.defjvp
def _first_order_only_jvp(primals, tangents):
    del primals, tangents
    raise NotImplementedError(_HIGHER_ORDER)


def _transposed(linear: Any, like: Any, cotangent: Array) -> Array:
    """The transpose of the linear `linear` (a product with its other operand held)
    at `cotangent`, with no forward product (`jax.vjp` would add a dead one)."""
    aval = jax.ShapeDtypeStruct(like.shape, jnp.float32)
    return jax.linear_transpose(linear, aval)(cotangent)[0]


def _fp8_matmul(dims, scaling, out_dtype, lhs_dtype, rhs_dtype):
    """The fp8 matmul for one set of static arguments, with its derivative rule."""
    (lc, rc), (lb, rb) = dims

    @jax.custom_vjp
    def matmul(lhs, rhs):
        return _fp8_forward(lhs, rhs, dims, scaling, out_dtype)[0]

    def forward(lhs, rhs):
        return _fp8_forward(lhs, rhs, dims, scaling, out_dtype)

    @jax.named_scope(FP8_SCOPE)
    def backward(residuals, cotangent):
        residuals, cotangent = _first_order_only((residuals, cotangent))
        if scaling == "tensorwise":
            # Scalar scales come out of the products: fp8 x fp8 GEMMs.
            ql, sl, qr, sr = residuals
            qg, sg = _quantize(cotangent, E5M2, tuple(range(cotangent.ndim)))
            lhs32, rhs32 = ql.astype(jnp.float32), qr.astype(jnp.float32)
            g32 = qg.astype(jnp.float32)
            dlhs = _transposed(lambda x: _dot32(x, rhs32, dims), ql, g32)
            drhs = _transposed(lambda y: _dot32(lhs32, y, dims), qr, g32)
            inverse_g = 1.0 / sg.reshape(())
            dlhs = _unscale(dlhs, inverse_g, 1.0 / sr.reshape(()))
            drhs = _unscale(drhs, inverse_g, 1.0 / sl.reshape(()))
            return dlhs.astype(lhs_dtype), drhs.astype(rhs_dtype)
        # Rowwise: each product's operands are quantised per row of that product
        # (amax over the axes it contracts), so that both scales come out of it.
        lhs, rhs = residuals
        lhs_free, rhs_free = _free_axes(lhs.ndim, lc, lb), _free_axes(rhs.ndim, rc, rb)
        lhs_map, rhs_map = _output_axes(dims, lhs.ndim, rhs.ndim)
        # d lhs = g . rhs, contracting the rhs free axes.
        qg, sg = _quantize(cotangent, E5M2, tuple(rhs_map[a] for a in rhs_free))
        qr, sr = _quantize(rhs, E4M3, tuple(rhs_free))
        rhs32, g32 = qr.astype(jnp.float32), qg.astype(jnp.float32)
        dlhs = _transposed(lambda x: _dot32(x, rhs32, dims), lhs, g32)
        dlhs = _unscale(
            dlhs,
            _laid_out(1.0 / sg, {out: a for a, out in lhs_map.items()}, lhs.ndim),
            _laid_out(1.0 / sr, {**dict(zip(rb, lb)), **dict(zip(rc, lc))}, lhs.ndim),
        )
        # d rhs = lhs . g, contracting the lhs free axes.
        qg, sg = _quantize(cotangent, E5M2, tuple(lhs_map[a] for a in lhs_free))
        ql, sl = _quantize(lhs, E4M3, tuple(lhs_free))
        lhs32, g32 = ql.astype(jnp.float32), qg.astype(jnp.float32)
        drhs = _transposed(lambda y: _dot32(lhs32, y, dims), rhs, g32)
        drhs = _unscale(
            drhs,
            _laid_out(1.0 / sg, {out: a for a, out in rhs_map.items()}, rhs.ndim),
            _laid_out(1.0 / sl, {**dict(zip(lb, rb)), **dict(zip(lc, rc))}, rhs.ndim),
        )
        return dlhs.astype(lhs_dtype), drhs.astype(rhs_dtype)

    matmul.defvjp(forward, backward)
    return matmul


def _conv32(lhs: Array, rhs: Array, params: dict) -> Array:
    return lax.conv_general_dilated_p.bind(
        lhs.astype(jnp.float32),
        rhs.astype(jnp.float32),
        **dict(params, preferred_element_type=jnp.float32),
    )


def _fp8_conv(params: dict, out_dtype, lhs_dtype, rhs_dtype):
    """A convolution in fp8 (tensorwise scales, which come out of the sums), with
    the derivative rule of `_fp8_matmul`."""
    conv32 = ft.partial(_conv32, params=params)

    @jax.named_scope(FP8_SCOPE)
    def forward(lhs, rhs):
        ql, sl = _quantize(lhs, E4M3, tuple(range(lhs.ndim)))
        qr, sr = _quantize(rhs, E4M3, tuple(range(rhs.ndim)))
        out = _unscale(conv32(ql, qr), 1.0 / sl.reshape(()), 1.0 / sr.reshape(()))
        return out.astype(out_dtype), (ql, sl, qr, sr)

    @jax.custom_vjp
    def conv(lhs, rhs):
        return forward(lhs, rhs)[0]

    @jax.named_scope(FP8_SCOPE)
    def backward(residuals, cotangent):
        (ql, sl, qr, sr), cotangent = _first_order_only((residuals, cotangent))
        qg, sg = _quantize(cotangent, E5M2, tuple(range(cotangent.ndim)))
        lhs32, rhs32 = ql.astype(jnp.float32), qr.astype(jnp.float32)
        g32 = qg.astype(jnp.float32)
        dlhs = _transposed(lambda x: conv32(x, rhs32), ql, g32)
        drhs = _transposed(lambda y: conv32(lhs32, y), qr, g32)
        inverse_g = 1.0 / sg.reshape(())
        dlhs = _unscale(dlhs, inverse_g, 1.0 / sr.reshape(()))
        drhs = _unscale(drhs, inverse_g, 1.0 / sl.reshape(()))
        return dlhs.astype(lhs_dtype), drhs.astype(rhs_dtype)

    conv.defvjp(forward, backward)
    return conv


def conv_in_fp8(lhs, rhs, params: dict, out_dtype, only_eligible: bool) -> Array:
    """A convolution in fp8 (tensorwise); with `only_eligible`, one whose feature
    counts an fp8 kernel cannot take runs in `out_dtype`, under a named scope that
    gives the reason. Under `jax.vmap` the batched convolution decides."""
    params = {k: v for k, v in params.items() if k != "preferred_element_type"}
    if compat.is_batched(lhs) or compat.is_batched(rhs):
        return _batched_as_one(
            lax.conv_general_dilated_p, params, "tensorwise", out_dtype, only_eligible
        )(lhs, rhs)
    reason = fp8_conv_eligible(rhs.shape, params) if only_eligible else None
    if reason is not None:
        with jax.named_scope(f"{FP8_SKIPPED_SCOPE}: {reason}"):
            return lax.conv_general_dilated_p.bind(
                lhs.astype(out_dtype),
                rhs.astype(out_dtype),
                **params,
                preferred_element_type=None,
            )
    lhs_dtype, rhs_dtype = jnp.result_type(lhs), jnp.result_type(rhs)
    return _fp8_conv(params, out_dtype, lhs_dtype, rhs_dtype)(lhs, rhs)


def fp8_conv_eligible(rhs_shape, params: dict) -> str | None:
    """Why a convolution with this kernel cannot run in fp8, or `None`: its input
    and output feature counts must be multiples of 16."""
    rhs_spec = params["dimension_numbers"].rhs_spec
    sizes = {
        "output features": rhs_shape[rhs_spec[0]],
        "input features": rhs_shape[rhs_spec[1]],
    }
    bad = [f"{name} {n}" for name, n in sizes.items() if n % FP8_MULTIPLE]
    if bad:
        return f"{', '.join(bad)} not a multiple of {FP8_MULTIPLE}"
    return None


class _Fp8Dots(Hook):
    """Binds every `dot_general` and convolution of a program as an fp8 one (where
    its shapes allow, if `only_eligible`)."""

    def __init__(self, scaling, out_dtype, only_eligible):
        self.scaling, self.out_dtype = scaling, out_dtype
        self.only_eligible = only_eligible

    def equation(self, eqn, invals, origins, frame, evaluate):
        if eqn.primitive in FP8_PRIMITIVES:
            return [
                product_in_fp8(
                    eqn,
                    *invals,
                    scaling=self.scaling,
                    out_dtype=self.out_dtype,
                    only_eligible=self.only_eligible,
                )
            ]
        return evaluate(invals)


# The primitives fp8 rules and filters turn into fp8 products.
FP8_PRIMITIVES = frozenset({lax.dot_general_p, lax.conv_general_dilated_p})


def product_in_fp8(eqn, lhs, rhs, scaling, out_dtype, only_eligible) -> Array:
    """`eqn` (a `dot_general` or a convolution) on `lhs`, `rhs` in fp8; convolutions
    are scaled tensorwise."""
    if eqn.primitive is lax.conv_general_dilated_p:
        return conv_in_fp8(lhs, rhs, eqn.params, out_dtype, only_eligible)
    dims = eqn.params["dimension_numbers"]
    return matmul_in_fp8(lhs, rhs, dims, scaling, out_dtype, only_eligible)


def matmul_in_fp8(lhs, rhs, dims, scaling, out_dtype, only_eligible: bool) -> Array:
    """An fp8 matmul; with `only_eligible`, shapes an fp8 GEMM cannot take run in
    `out_dtype` instead, under a named scope that gives the reason. Under
    `jax.vmap` the shapes decided on are the batched ones."""
    (lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch) = dims
    dims = (
        (tuple(lhs_contracting), tuple(rhs_contracting)),
        (tuple(lhs_batch), tuple(rhs_batch)),
    )
    if compat.is_batched(lhs) or compat.is_batched(rhs):
        params = {"dimension_numbers": dims}
        return _batched_as_one(
            lax.dot_general_p, params, scaling, out_dtype, only_eligible
        )(lhs, rhs)
    reason = fp8_eligible(lhs.shape, rhs.shape, dims) if only_eligible else None
    if reason is not None:
        with jax.named_scope(f"{FP8_SKIPPED_SCOPE}: {reason}"):
            return lax.dot_general(lhs.astype(out_dtype), rhs.astype(out_dtype), dims)
    lhs_dtype, rhs_dtype = jnp.result_type(lhs), jnp.result_type(rhs)
    return _fp8_matmul(dims, scaling, out_dtype, lhs_dtype, rhs_dtype)(lhs, rhs)


def dot_general(
    lhs: Array,
    rhs: Array,
    dimension_numbers: Any,
    *,
    scaling: Scaling = "tensorwise",
    out_dtype: Any = None,
) -> Array:
    """`lax.dot_general` in fp8, with current scaling.

    The operands are quantised to `float8_e4m3fn` with float32 scales from their
    absolute maximum (over the whole tensor, or per row with `scaling="rowwise"`:
    one scale per index of the non-contracting axes), multiplied with float32
    accumulation, and the result is unscaled and returned in `out_dtype`. In the
    backward pass the output gradient is quantised to `float8_e5m2` and multiplied
    with the fp8 operands (tensorwise: the saved ones; rowwise: both quantised
    again per row of each backward product, so that every scale comes out of it).
    Scales are at most 2**126 (tiny and zero tensors stay finite) and come from the
    finite values: an inf or NaN element gives non-finite outputs where float32
    would. First-order derivatives only: differentiating the backward pass again
    raises `NotImplementedError`. Under `jax.vmap` the scales cover the whole
    batch, as for the batched matmul; under GSPMD their amax is reduced across
    devices.

    **Arguments:**

    - `lhs`, `rhs`, `dimension_numbers`: as for `jax.lax.dot_general`.
    - `scaling`: `"tensorwise"` (one scale per operand) or `"rowwise"`.
    - `out_dtype`: the output (and backward compute) dtype, a floating dtype of 16
        bits or more or one of the package's words (`"bf16"`); `None` means the
        wider of the operands' dtypes (bfloat16 for bfloat16 operands).

    **Returns:**

    The product, of `out_dtype`.

    **Example:**

    ```python
    y = eqx_amp.fp8.dot_general(x, w, (((1,), (0,)), ((), ())), out_dtype=jnp.bfloat16)
    ```
    """
    if scaling not in _SCALINGS:
        raise ValueError(
            f"`scaling` must be 'tensorwise' or 'rowwise', not {scaling!r}."
        )
    for name, operand in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(jnp.result_type(operand), jnp.floating):
            raise TypeError(
                f"`eqx_amp.fp8.dot_general` multiplies floating arrays, but `{name}` is "
                f"{jnp.result_type(operand)}."
            )
    if out_dtype is None:
        with jax.numpy_dtype_promotion("standard"):
            out_dtype = jnp.result_type(lhs, rhs)
    # Refuses integer and complex dtypes (a product would be truncated or get a
    # zero imaginary part), and takes the package's words ("bf16").
    out_dtype = floating_dtype(out_dtype, "out_dtype")
    if out_dtype.itemsize < 2:
        raise ValueError(
            f"`out_dtype` must be bfloat16, float16 or wider, not {out_dtype.name}: "
            "the product is accumulated in float32 and returned in it."
        )
    return matmul_in_fp8(lhs, rhs, dimension_numbers, scaling, out_dtype, False)


def _batched_as_one(primitive, params, scaling, out_dtype, only_eligible):
    """Under `jax.vmap`, the batched product is one fp8 product: its scales cover
    the whole batch."""

    def plain(lhs, rhs):
        if primitive is lax.conv_general_dilated_p:
            return primitive.bind(lhs, rhs, **params, preferred_element_type=None)
        return lax.dot_general(lhs, rhs, params["dimension_numbers"])

    def op(lhs, rhs):
        if primitive is lax.conv_general_dilated_p:
            return conv_in_fp8(lhs, rhs, params, out_dtype, only_eligible)
        dims = params["dimension_numbers"]
        return matmul_in_fp8(lhs, rhs, dims, scaling, out_dtype, only_eligible)

    return batched_like(plain, op, _Fp8Dots(scaling, out_dtype, only_eligible))


def fp8_eligible(lhs_shape, rhs_shape, dims) -> str | None:
    """Why a matmul of these shapes cannot run as an fp8 GEMM, or `None` if it can:
    every dimension must be a multiple of 16."""
    (lc, rc), (lb, rb) = dims
    sizes = {
        "contracting": int(np.prod([lhs_shape[i] for i in lc], dtype=np.int64)),
        "lhs free": int(
            np.prod(
                [lhs_shape[i] for i in _free_axes(len(lhs_shape), lc, lb)],
                dtype=np.int64,
            )
        ),
        "rhs free": int(
            np.prod(
                [rhs_shape[i] for i in _free_axes(len(rhs_shape), rc, rb)],
                dtype=np.int64,
            )
        ),
    }
    bad = [f"{name} size {n}" for name, n in sizes.items() if n % FP8_MULTIPLE]
    if bad:
        return f"{', '.join(bad)} not a multiple of {FP8_MULTIPLE}"
    return None


class Fp8ParamsHook(Hook):
    """Runs a program unchanged, except that each `dot_general` reading a parameter
    (an array of the modules the fp8 filter selected) runs as an fp8 matmul where
    its shapes allow one (`filter_amp(..., fp8=eqx_amp.fp8.TENSORWISE)`)."""

    def __init__(self, scaling: str):
        self.scaling = scaling

    def equation(self, eqn, invals, origins, frame, evaluate):
        reads_params = any(
            origin is Origin.PARAMS and jnp.issubdtype(jnp.result_type(v), jnp.floating)
            for v, origin in zip(invals, origins)
        )
        if eqn.primitive in FP8_PRIMITIVES and reads_params:
            out_dtype = eqn.outvars[0].aval.dtype
            return [
                product_in_fp8(
                    eqn,
                    *invals,
                    scaling=self.scaling,
                    out_dtype=out_dtype,
                    only_eligible=True,
                )
            ]
        return evaluate(invals)


def _call(fn: Callable, args: tuple, kwargs: dict) -> Any:
    return fn(*args, **kwargs)
