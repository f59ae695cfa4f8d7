"""`eqx_amp.fp8.dot_general`: one fp8 matmul, by hand."""

import functools as ft
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array

from .._core._cast import floating_dtype
from ._rules import SCALINGS, Fp8Product, Scaling, matmul_in_fp8


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
    finite values: an inf or NaN element becomes NaN in fp8 and gives non-finite
    outputs where float32 would. Any shape is taken; where no fp8 GEMM takes the
    product (a size not a multiple of 16), its fp8 values are multiplied in
    float32, exactly. First-order derivatives only: differentiating the backward
    pass again raises `NotImplementedError`. Under `jax.vmap` the scales cover the
    whole batch, as for the batched matmul; under GSPMD their amax is reduced
    across devices.

    With `scaling="mxfp8"` the product is block-scaled (MXFP8): each block of 32
    values along the contracting axes gets its own power-of-two (e8m0) scale, the
    block's amax rounded up (RCEIL), which the GEMM applies (`jax.nn.scaled_matmul`,
    cuDNN's block-scaled GEMM, on CUDA; `jax.lax.scaled_dot`, which dequantises,
    elsewhere). Gradients are e4m3 too, and each backward product quantises
    along its own contracting axes (the operands' forms for it are saved in the
    forward pass, 1 byte a value); a contracting size that is not a multiple of
    32 is padded with zeros. An inf or NaN makes only the outputs that read its
    block non-finite.

    With `scaling="nvfp4"` the forward product is NVFP4: each operand's values in
    `float4_e2m1fn` with an e4m3 scale per 16 along the contracting axes and a
    power-of-two float32 scale for the tensor (the contracting size must be a
    multiple of 16, or `ValueError`); its backward products are MXFP8's. A block whose scale falls
    below e4m3's range (2**-17 of the largest block's) is flushed to zero. With
    `scaling="nvfp4_training"` the backward products are NVFP4 too, by NVIDIA's
    recipe, `rhs` taken as the weight: `rhs` quantised in 16 x 16 tiles (the
    input gradient's product reads the forward's numbers), the output gradient
    rounded stochastically, and both inputs of `rhs`'s gradient rotated by a
    random 16 x 16 Hadamard matrix.

    **Arguments:**

    - `lhs`, `rhs`, `dimension_numbers`: as for `jax.lax.dot_general`.
    - `scaling`: `"tensorwise"` (one scale per operand), `"rowwise"`, `"mxfp8"`
        (one per 32 values along the contracting axes), `"nvfp4"` or
        `"nvfp4_training"`.
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
    if scaling not in SCALINGS:
        raise ValueError(
            "`scaling` must be 'tensorwise' or 'rowwise', or 'mxfp8' for block "
            "scales ('nvfp4' for a 4-bit forward product, 'nvfp4_training' for 4-bit "
            f"backward products too), not {scaling!r}."
        )
    for name, operand in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(jnp.result_type(operand), jnp.floating):
            raise TypeError(
                f"`eqx_amp.fp8.dot_general` multiplies floating arrays, but `{name}` is "
                f"{jnp.result_type(operand)}."
            )
    _check_shapes(lhs, rhs, dimension_numbers, scaling)
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
    # The backward products emit `out_dtype` too (float32 where its range is too
    # small for their still-scaled sums): with power-of-two scales, rounding them
    # before unscaling gives the numbers rounding after would.
    how = Fp8Product(
        scaling,
        out_dtype,
        only_eligible=False,
        grad_dtype=out_dtype,
        weight=1 if scaling == "nvfp4_training" else None,
    )
    return matmul_in_fp8(lhs, rhs, dimension_numbers, how)


def _check_shapes(lhs: Array, rhs: Array, dimension_numbers: Any, scaling: str) -> None:
    """Raises `lax.dot_general`'s own error for dimension numbers it refuses (the
    block-scaled products flatten the axes they are given, so they would pair the
    wrong values rather than fail), and `ValueError` for an NVFP4 product whose
    contracting size its 16-value blocks do not divide."""
    spec = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in (lhs, rhs)]
    jax.eval_shape(
        ft.partial(lax.dot_general, dimension_numbers=dimension_numbers), *spec
    )
    if scaling in ("nvfp4", "nvfp4_training"):
        (contracting, _), _ = dimension_numbers
        size = math.prod(jnp.shape(lhs)[a] for a in contracting)
        if size % 16:
            raise ValueError(
                f"`scaling={scaling!r}` quantises each 16 values along the "
                f"contracting axes with one scale: their size, {size}, must be a "
                "multiple of 16 (`'mxfp8'` pads to its blocks of 32)."
            )
