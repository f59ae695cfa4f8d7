"""Weights in fp8 before their products read them: quantised once per call
(`filter_amp`, `BiModel`, `autocast` with tensorwise rules), or shard by shard and
all-gathered in fp8 (`gather_params(..., fp8=...)`, through `GatheredInFp8`, the
methods the fp8 rules lend it)."""

import functools as ft
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array

from .._jaxpr import _compat as compat
from .._jaxpr._hook import Origin
from ._block_scaled import MXFP8_SCOPE, mx_dequantize, mx_quantize_weight
from ._delayed import current_supply
from ._products import FP8_SCOPE, WEIGHT_AMAX_SCOPE, known_fp8, remember_fp8
from ._scaling import E4M3, finite_amax, quantize_with, scale_from_amax
from ._shapes import BLOCK, FP8_MULTIPLE, FP8_PRIMITIVES, fp8_conv_eligible


def whole_amaxes(weights: list[Array]) -> Array:
    """The largest finite magnitude of each of `weights`, as one float32 vector
    (without a derivative: scales are constants of the products)."""
    with jax.named_scope(FP8_SCOPE), jax.named_scope(WEIGHT_AMAX_SCOPE):
        amaxes = [finite_amax(w, tuple(range(w.ndim))).reshape(()) for w in weights]
        return lax.stop_gradient(jnp.stack(amaxes))


def quantize_weight(weight: Array, scale: Array) -> Array:
    """`weight` (or a shard of it) in `float8_e4m3fn` with the float32 `scale`,
    made without a derivative (its products pass the gradient straight through
    the rounding)."""
    # A weight's inf is left to the conversion (a GPU saturates it): with the select
    # that makes it NaN, XLA's SPMD partitioner stopped all-gathering FSDP weights
    # in fp8 (`tests/test_sharding_fp8.py`). Activations and gradients, where an
    # overflow starts, do become NaN.
    with jax.named_scope(FP8_SCOPE):  # an fp8 cast, as `precision_report` reads them
        return quantize_with(lax.stop_gradient(weight), scale, E4M3, inf_to_nan=False)


class GatheredInFp8:
    """How `gather_params(..., fp8=rule)` quantises weight shards and gathers them
    for an fp8 rule (of `scaling` and `multiple`). Tensorwise: one scale per
    weight, from the amax of all its shards (one `pmax` for all the weights).
    MXFP8: blocks of 32 along each weight's last axis, each whole within a shard,
    gathered as e4m3 values and e8m0 scales."""

    scaling: str
    multiple: int
    pays_only: bool

    def check_gather(self, compute_dtype: np.dtype) -> None:
        if self.pays_only:
            raise TypeError(
                f"`gather_params(..., fp8={self!r})`: a gather decides per weight, "
                "before the shapes of the products that read it are known, so it "
                "cannot follow `where_it_pays()`, and the products that rule leaves "
                "in the compute dtype would read fp8-rounded weights. Pass the rule "
                "without `where_it_pays()`, with an `fp8_filter` selecting the layers "
                "whose products pay (`precision_report(...).fp8_skipped` names those "
                "that do not)."
            )
        why = {
            "rowwise": "rowwise products quantise each weight along the rows of "
            "each product",
            "nvfp4": "NVFP4's forward products quantise each weight with a scale "
            "for the whole tensor and its backward products in MXFP8",
            "nvfp4_training": "NVFP4's products quantise each weight with a scale "
            "for the whole tensor",
        }.get(self.scaling)
        if why is not None:
            raise TypeError(
                f"`gather_params(..., fp8={self!r})`: {why}, which one gathered form "
                "would not give; pass `eqx_amp.fp8.TENSORWISE` or "
                "`eqx_amp.fp8.MXFP8`, or leave `fp8` out to gather in the compute "
                "dtype."
            )
        if compute_dtype.itemsize < 2:
            raise ValueError(
                "fp8 gathers hand the weights on in the compute dtype, which must be "
                f"bfloat16, float16 or wider, not {compute_dtype.name}."
            )

    def gathers_by_default(self, module: Any) -> bool:
        """Whether `gather_params(..., fp8=rule)` gathers `module`'s weights in fp8
        without an `fp8_filter`: `eqx.nn.Linear` layers (stacked ones too) and, for
        tensorwise rules, `eqx.nn.Conv` ones (MXFP8 convolutions are tensorwise)."""
        kinds = (
            eqx.nn.Linear if self.scaling == "mxfp8" else eqx.nn.Linear | eqx.nn.Conv
        )
        return isinstance(module, kinds)

    def gather_problem(self, shard_shape, shape, dim: int) -> str | None:
        """Why a weight of gathered `shape`, sharded along `dim` into shards of
        `shard_shape`, cannot be gathered in this format; None if it can."""
        if self.scaling == "mxfp8":
            if shape[-1] % BLOCK:
                return (
                    f"its last dimension ({shape[-1]}) is not a multiple of "
                    f"{BLOCK}, MXFP8's block"
                )
            if dim == len(shape) - 1 and shard_shape[-1] % BLOCK:
                return (
                    f"its shards {tuple(shard_shape)} split blocks of {BLOCK} along "
                    "its last dimension"
                )
            return None
        if any(n % self.multiple for n in shape):
            return (
                f"its gathered shape {tuple(shape)} has a dimension that is not a "
                f"multiple of {self.multiple}, so its products cannot run in fp8"
            )
        return None

    def weight_amaxes(self, shards: list[Array], axis_name: Any) -> list:
        """What quantising each of `shards` needs from the whole weight it is a
        shard of over `axis_name`: tensorwise, its largest finite magnitude (one
        `pmax` for all); MXFP8, nothing (None: its blocks lie within the shard)."""
        if self.scaling == "mxfp8":
            return [None] * len(shards)
        return list(lax.pmax(whole_amaxes(shards), axis_name))

    def gather_shard(
        self, shard: Array, amax: Array | None, gather: Callable[[Array], Array]
    ) -> tuple[Array, Array]:
        """`shard` quantised (with its weight's `amax`, for tensorwise scales) and
        gathered by `gather`: the weight's fp8 values and their scale (tensorwise:
        float32) or block scales (MXFP8: e8m0, gathered too)."""
        if self.scaling == "mxfp8":
            # Made without a derivative, as tensorwise values are: the gradient
            # passes straight through the gather (`gather_params`).
            # The scopes `precision_report` and `telemetry` read casts by.
            with jax.named_scope(FP8_SCOPE), jax.named_scope(MXFP8_SCOPE):
                values, scales = mx_quantize_weight(lax.stop_gradient(shard))
            return gather(values), gather(scales)
        assert amax is not None, "tensorwise gathers take the weight's amax"
        scale = scale_from_amax(amax, E4M3)
        return gather(quantize_weight(shard, scale)), scale

    def dequantize(self, quantized: Array, scale: Array, dtype: Any) -> Array:
        """A gathered fp8 weight in `dtype`, for the ops that read it as it is,
        saturated at `dtype`'s largest finite value: with a power-of-two scale an
        fp8 value can round above the weight's amax, which near the largest
        value of `dtype` would make it inf."""
        if self.scaling == "mxfp8":
            return mx_dequantize(quantized, scale, dtype)
        fp8 = quantized.astype(jnp.float32)
        # A finite fp8 value times its inverse scale can pass float32's largest
        # value too (a weight's amax within 1/8 of it): saturate that, not NaN/inf.
        values = fp8 * (1.0 / scale)
        largest = float(jnp.finfo(dtype).max)
        clipped = jnp.clip(values, -largest, largest)
        return jnp.where(jnp.isfinite(fp8), clipped, values).astype(dtype)

    def remember(self, weight: Array, quantized: Array, scale: Array) -> Array:
        """Marks `weight` as held in fp8 as `quantized` with `scale`: the fp8
        matmuls that read it read those values, rather than quantise it again."""
        return remember_fp8(weight, quantized, scale)


def quantize_weights_once(
    in_fp8: Callable[[Any], bool],
    compute_dtype: np.dtype | None,
    jaxpr: Any,
    values: list,
    origins: list,
) -> None:
    """Quantises each parameter that an fp8 product of the program (an equation
    for which `in_fp8(eqn)` holds) reads as it is (not through a reshape, a slice
    or a body of its own) and can take in fp8 (a matrix of a matmul, both
    dimensions multiples of 16; a convolution's kernel with feature counts that
    are), once for all of the products that read it (`remember_fp8`; cast to
    `compute_dtype` first, if given, as those products would), with the amaxes of
    all of them taken together before any product. On a sharded weight that
    quantises each shard, so the weight is all-gathered in fp8; and the amaxes'
    all-reduces do not wait on the step's data, so XLA combines them into one.
    (`evaluate_function`'s `prepare`, given the program's values and origins.)"""
    atoms = [*jaxpr.constvars, *jaxpr.invars]
    param_of = {
        atom: value
        for atom, value, origin in zip(atoms, values, origins)
        if origin is Origin.PARAMS
    }
    read: dict[Any, None] = {}  # in the program's order: the amaxes' order is fixed
    convolved = set()  # kernels of convolutions: no delayed scales reach those
    for eqn in jaxpr.eqns:
        if eqn.primitive not in FP8_PRIMITIVES or not in_fp8(eqn):
            continue
        for position, atom in enumerate(eqn.invars):
            w = None if isinstance(atom, compat.Literal) else param_of.get(atom)
            if w is not None and _takes_fp8(eqn, position, w):
                read[atom] = None
                if eqn.primitive is lax.conv_general_dilated_p:
                    convolved.add(atom)
    weights = [param_of[atom] for atom in read]
    if not weights:
        return
    cast = [w if compute_dtype is None else w.astype(compute_dtype) for w in weights]
    supply = current_supply()
    if supply is not None and supply.delays_weights:
        # Delayed: the scales are given; the amaxes are handed out by the first
        # product reading each weight.
        amaxes = whole_amaxes(cast)
        for atom, weight, w, amax in zip(read, weights, cast, amaxes):
            if atom in convolved:
                scale = scale_from_amax(amax, E4M3)
                quantized = quantize_weight(w, scale)
            else:
                quantized, scale = supply.weight(
                    weight, amax, ft.partial(quantize_weight, w)
                )
            remember_fp8(weight, quantized, scale)
        return
    # All the scales as one op: each weight's amax is needed at the same point, so
    # XLA combines their all-reduces into one (scales computed apart let it pair
    # each with a product's amax instead).
    scales = scale_from_amax(whole_amaxes(cast), E4M3)
    for weight, w, scale in zip(weights, cast, scales):
        remember_fp8(weight, quantize_weight(w, scale), scale)


def _takes_fp8(eqn: Any, position: int, w: Any) -> bool:
    """Whether the parameter `w`, operand `position` of the fp8 product `eqn`, is
    one to quantise before the products: a traced floating array that an fp8
    kernel takes in that place, not quantised yet."""
    if not (
        compat.is_traced(w)  # see `remember_fp8`
        and jnp.issubdtype(w.dtype, jnp.floating)
        and w.dtype.itemsize >= 2
        and not compat.is_batched(w)
        and known_fp8(w) is None  # gathered in fp8 already
    ):
        return False
    if eqn.primitive is lax.conv_general_dilated_p:
        return position == 1 and fp8_conv_eligible(w.shape, eqn.params) is None
    return w.ndim == 2 and all(n % FP8_MULTIPLE == 0 for n in w.shape)
