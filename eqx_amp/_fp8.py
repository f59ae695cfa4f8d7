"""fp8 matmuls with current scaling: no state, scales from each tensor's own amax.

The forward operands are quantised to `float8_e4m3fn` and the backward pass's output
gradient to `float8_e5m2` (more range, less precision: gradients need it), each
with a float32 scale computed from the tensor's absolute maximum right before use
("current" scaling; delayed scaling keeps a history of amaxes in state, which goes
stale). The matmul multiplies the fp8 values (converted up, which is the pattern
XLA rewrites into an fp8 GEMM on GPUs that have one), accumulates in float32 and
applies the scales to its output. Derivatives come from `jax.custom_vjp`, so the
backward pass is exactly the one written here.
"""

import functools as ft
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array

from ._jaxpr import _compat as compat
from ._jaxpr._evaluate import Hook, Origin, batched_like


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
    """`FP8` and `FP8_ROWWISE`: `dot_general` runs as an fp8 matmul with current
    scaling (`eqx_amp.fp8_dot_general`) from operands cast to the compute dtype,
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
            f"eqx_amp.{self.name} is applied by `autocast` itself (it rebinds the "
            "matmul); it cannot be called as a rule function."
        )

    def __repr__(self) -> str:
        return f"eqx_amp.{self.name}"

    def __reduce__(self):
        return self.name


FP8 = Fp8Rule("FP8", "tensorwise")
FP8_ROWWISE = Fp8Rule("FP8_ROWWISE", "rowwise")


def _scale(x: Array, dtype: np.dtype, axes: tuple[int, ...]) -> Array:
    """float32 scale mapping the absolute maximum of `x` over `axes` (kept as size-1
    axes) to the largest finite value of `dtype`. An all-zero slice gets scale 1."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axes, keepdims=True)
    largest = jnp.float32(jnp.finfo(dtype).max)
    return jnp.where(
        amax > 0, largest / jnp.maximum(amax, jnp.finfo(jnp.float32).tiny), 1.0
    )


def _quantize(x: Array, dtype: np.dtype, axes: tuple[int, ...]) -> tuple[Array, Array]:
    scale = _scale(x, dtype, axes)
    largest = float(jnp.finfo(dtype).max)
    scaled = jnp.clip(x.astype(jnp.float32) * scale, -largest, largest)
    return scaled.astype(dtype), scale


def _free_axes(
    ndim: int, contracting: Sequence[int], batch: Sequence[int]
) -> list[int]:
    return [i for i in range(ndim) if i not in contracting and i not in batch]


def _inverse_scale_of_output(
    scale: Array, dims, which: int, out_ndim: int, n_other_free: int
) -> Array:
    """An operand's scale (size 1 on its contracting axes) laid out as the output
    (batch, lhs free, rhs free) of the matmul, for the output to be divided by."""
    (contracting, batch) = dims[0][which], dims[1][which]
    free = _free_axes(scale.ndim, contracting, batch)
    inverse = jnp.transpose(1.0 / scale, (*batch, *free, *contracting))
    inverse = inverse.reshape(inverse.shape[: len(batch) + len(free)])
    if which == 0:  # lhs: (batch, lhs free) then the rhs free axes
        return inverse.reshape(inverse.shape + (1,) * n_other_free)
    n_batch = len(batch)
    shape = inverse.shape[:n_batch] + (1,) * n_other_free + inverse.shape[n_batch:]
    return inverse.reshape(shape)


@jax.named_scope(FP8_SCOPE)
def _fp8_forward(lhs, rhs, dims, scaling, out_dtype):
    (lc, rc), (lb, rb) = dims
    if scaling == "tensorwise":
        l_axes, r_axes = tuple(range(lhs.ndim)), tuple(range(rhs.ndim))
    else:  # one scale per row: per output element of the other dims
        l_axes, r_axes = tuple(lc), tuple(rc)
    ql, sl = _quantize(lhs, E4M3, l_axes)
    qr, sr = _quantize(rhs, E4M3, r_axes)
    out = _dot32(ql, qr, dims)
    n_l_free = len(_free_axes(lhs.ndim, lc, lb))
    n_r_free = len(_free_axes(rhs.ndim, rc, rb))
    if scaling == "tensorwise":
        out = out / (sl.reshape(()) * sr.reshape(()))
    else:
        out = out * _inverse_scale_of_output(sl, dims, 0, out.ndim, n_r_free)
        out = out * _inverse_scale_of_output(sr, dims, 1, out.ndim, n_l_free)
    return out.astype(out_dtype), (ql, sl, qr, sr)


def _dot32(lhs: Array, rhs: Array, dims) -> Array:
    """The product of fp8 values, read as float32 (exactly) and accumulated in it:
    converts from fp8 in front of a dot are what XLA rewrites into an fp8 GEMM."""
    return lax.dot_general(
        lhs.astype(jnp.float32),
        rhs.astype(jnp.float32),
        dims,
        preferred_element_type=jnp.float32,
    )


def _fp8_matmul(dims, scaling, out_dtype, lhs_dtype, rhs_dtype):
    """The fp8 matmul for one set of static arguments, with its derivative rule."""

    @jax.custom_vjp
    def matmul(lhs, rhs):
        return _fp8_forward(lhs, rhs, dims, scaling, out_dtype)[0]

    def forward(lhs, rhs):
        out, residuals = _fp8_forward(lhs, rhs, dims, scaling, out_dtype)
        return out, residuals  # fp8 operands and float32 scales: 1 byte per value

    @jax.named_scope(FP8_SCOPE)
    def backward(residuals, cotangent):
        ql, sl, qr, sr = residuals
        qg, sg = _quantize(cotangent, E5M2, tuple(range(cotangent.ndim)))
        if scaling == "tensorwise":
            # Scalar scales come out of the products: fp8 x fp8 GEMMs.
            # Differentiated at float32 copies: a cotangent must not be fp8.
            lhs, rhs = ql.astype(jnp.float32), qr.astype(jnp.float32)
            _, pullback = jax.vjp(ft.partial(_dot32, dims=dims), lhs, rhs)
            dlhs, drhs = pullback(qg.astype(jnp.float32))
            sg, sl, sr = sg.reshape(()), sl.reshape(()), sr.reshape(())
            dlhs, drhs = dlhs / (sg * sr), drhs / (sg * sl)
        else:
            # A row's scale varies along the other product's contraction.
            lhs = ql.astype(jnp.float32) / sl
            rhs = qr.astype(jnp.float32) / sr
            _, pullback = jax.vjp(ft.partial(_dot32, dims=dims), lhs, rhs)
            dlhs, drhs = pullback(qg.astype(jnp.float32) / sg)
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
        out = conv32(ql, qr) / (sl.reshape(()) * sr.reshape(()))
        return out.astype(out_dtype), (ql, sl, qr, sr)

    @jax.custom_vjp
    def conv(lhs, rhs):
        return forward(lhs, rhs)[0]

    @jax.named_scope(FP8_SCOPE)
    def backward(residuals, cotangent):
        ql, sl, qr, sr = residuals
        qg, sg = _quantize(cotangent, E5M2, tuple(range(cotangent.ndim)))
        lhs, rhs = ql.astype(jnp.float32), qr.astype(jnp.float32)
        _, pullback = jax.vjp(conv32, lhs, rhs)
        dlhs, drhs = pullback(qg.astype(jnp.float32))
        sg, sl, sr = sg.reshape(()), sl.reshape(()), sr.reshape(())
        return (dlhs / (sg * sr)).astype(lhs_dtype), (drhs / (sg * sl)).astype(
            rhs_dtype
        )

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


def fp8_dot_general(
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
    backward pass the output gradient is quantised to `float8_e5m2` (tensorwise)
    and multiplied with the saved fp8 operands. Under `jax.vmap` the scales cover
    the whole batch, as for the batched matmul; under GSPMD their amax is reduced
    across devices.

    **Arguments:**

    - `lhs`, `rhs`, `dimension_numbers`: as for `jax.lax.dot_general`.
    - `scaling`: `"tensorwise"` (one scale per operand) or `"rowwise"`.
    - `out_dtype`: the output (and backward compute) dtype; `None` means the wider
        of the operands' dtypes (bfloat16 for bfloat16 operands).

    **Returns:**

    The product, of `out_dtype`.

    **Example:**

    ```python
    y = eqx_amp.fp8_dot_general(x, w, (((1,), (0,)), ((), ())), out_dtype=jnp.bfloat16)
    ```
    """
    if scaling not in _SCALINGS:
        raise ValueError(
            f"`scaling` must be 'tensorwise' or 'rowwise', not {scaling!r}."
        )
    for name, operand in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(jnp.result_type(operand), jnp.floating):
            raise TypeError(
                f"`fp8_dot_general` multiplies floating arrays, but `{name}` is "
                f"{jnp.result_type(operand)}."
            )
    if out_dtype is None:
        with jax.numpy_dtype_promotion("standard"):
            out_dtype = jnp.result_type(lhs, rhs)
    out_dtype = jnp.dtype(out_dtype)
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
    its shapes allow one (`filter_amp(..., fp8=eqx_amp.FP8)`)."""

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
