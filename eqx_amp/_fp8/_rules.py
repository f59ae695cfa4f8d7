"""Where fp8 products run: the fp8 rules (`eqx_amp.fp8.TENSORWISE`, `ROWWISE`,
`MXFP8`, `NVFP4`) and the hooks that rebind a program's matmuls and convolutions as
fp8 ones (their shapes permitting: `_shapes`)."""

import contextlib
import contextvars
import dataclasses
import functools as ft
from collections.abc import Callable, Iterator
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array

from .._core._wrapper import warn_once
from .._jaxpr import _compat as compat
from .._jaxpr._evaluate import batched_like, evaluate_function
from .._jaxpr._hook import Hook, Origin
from .._jaxpr._outer_vmap import batched_after_tracing
from ._block_scaled import block_scaled_matmul, nvfp4_matmul
from ._conv import fp8_conv
from ._delayed import current_supply, delayed_matmul
from ._products import (
    FP8_SKIPPED_SCOPE,
    fp8_matmul,
    holding_fp8_values,
    known_block_scaled,
    known_fp8,
    varying_alike,
)
from ._shapes import (
    BLOCK,
    FP8_MULTIPLE,
    FP8_PRIMITIVES,
    NV_BLOCK,
    fp8_conv_eligible,
    fp8_cost_reason,
    ineligible,
)
from ._weights import GatheredInFp8, quantize_weights_once


Scaling = Literal["tensorwise", "rowwise", "mxfp8", "nvfp4", "nvfp4_training"]
SCALINGS = ("tensorwise", "rowwise", "mxfp8", "nvfp4", "nvfp4_training")
# The scalings whose scales are per block, applied inside the GEMM.
BLOCK_SCALINGS = frozenset({"mxfp8", "nvfp4", "nvfp4_training"})
# NVFP4 forward products: backward ones in MXFP8, or (`"nvfp4_training"`) in
# NVFP4 by NVIDIA's recipe.
NVFP4_SCALINGS = frozenset({"nvfp4", "nvfp4_training"})


@dataclasses.dataclass(frozen=True)
class Fp8Product:
    """How a product runs in fp8: the rule's choices and the call's dtypes.

    ```python
    how = Fp8Product("tensorwise", out_dtype=jnp.bfloat16, grad_dtype=jnp.bfloat16)
    y = product_in_fp8(eqn, x, w, how=how)
    ```
    """

    scaling: str
    # The dtype of the product (and of a product that stays out of fp8).
    out_dtype: Any
    # Shapes an fp8 GEMM cannot take run in `out_dtype` (otherwise every product
    # runs in fp8, as `eqx_amp.fp8.dot_general` asks by hand).
    only_eligible: bool = True
    # What the backward products emit.
    grad_dtype: Any = jnp.float32
    # A matmul whose fp8 GEMMs save less than its quantisation costs stays out.
    pays_only: bool = False
    # Which operand (0 or 1) is a parameter, if one is: NVIDIA's NVFP4 recipe
    # quantises weights apart.
    weight: int | None = None


class Fp8Rule(GatheredInFp8):
    """`eqx_amp.fp8.TENSORWISE` and `ROWWISE`: `dot_general` runs as an fp8 matmul with current
    scaling (`eqx_amp.fp8.dot_general`) from operands cast to the compute dtype,
    where its shapes allow an fp8 GEMM (every dimension a multiple of 16), and
    `conv_general_dilated` as an fp8 convolution (tensorwise, feature counts
    multiples of 16); the others stay in the compute dtype, and `precision_report`
    says why. Under `autocast`, matmuls that read no parameter (attention's scores
    and probabilities times values) stay in the compute dtype too, unless the rule
    is `.with_activation_products()`. Other ops under an fp8 scope rule follow their
    own primitive's rule.

    `eqx_amp.fp8.MXFP8` runs matmuls block-scaled (MXFP8: e4m3 values with a
    power-of-two scale per 32 along each product's contracting dimension, applied
    inside the GEMM: cuDNN's on Blackwell), those whose contracting size is a
    multiple of 32; its convolutions are tensorwise fp8 ones. `eqx_amp.fp8.NVFP4`
    runs the forward matmuls in NVFP4 (e2m1 values, an e4m3 scale per 16 along the
    contracting dimension and a float32 one per tensor), those whose contracting
    size is a multiple of 16, and their backward products in MXFP8 (in NVFP4 too,
    by NVIDIA's training recipe, with `.with_nvfp4_backward()`); convolutions as
    `MXFP8` does."""

    def __init__(
        self,
        name: str,
        scaling: str,
        activation_products: bool = False,
        where_it_pays: bool = False,
    ):
        self.name = name
        self.scaling = scaling
        # Only products whose fp8 GEMMs save more than their quantisation costs
        # (`fp8_cost_reason`), unless an `fp8_filter` chose the modules.
        self.pays_only = where_it_pays
        # What an fp8 GEMM needs every dimension (an MXFP8 one: the contracting
        # one) to be a multiple of.
        block = {"mxfp8": BLOCK} | dict.fromkeys(NVFP4_SCALINGS, NV_BLOCK)
        self.multiple = block.get(scaling, FP8_MULTIPLE)
        # Under `autocast`: also the products that read no parameter (attention's
        # scores and its probabilities times values), whose operands are quantised
        # at every call: at a GPT-2-small size on an H100 that costs more than the
        # fp8 GEMM saves, so they stay in the compute dtype unless asked for.
        self.activation_products = activation_products
        self.__doc__ = Fp8Rule.__doc__

    def with_activation_products(self) -> "Fp8Rule":
        """This rule, under `autocast` also for products that read no parameter
        (attention's `q @ k.T` and `probabilities @ v`), which it otherwise leaves
        in the compute dtype (`precision_report(...).fp8_skipped` lists them).

        ```python
        rule = eqx_amp.fp8.TENSORWISE.with_activation_products()
        forward = eqx_amp.autocast(model, rules={jax.lax.dot_general_p: rule})
        ```
        """
        return Fp8Rule(self.name, self.scaling, True, self.pays_only)

    def where_it_pays(self) -> "Fp8Rule":
        """This rule for the matmuls whose fp8 GEMMs save more time than their
        quantisation costs (a roofline estimate from the shapes, for an H100's
        tensorwise and rowwise GEMMs and a B200's MXFP8 ones: the fp8 guide gives
        it; convolutions are not estimated); the others stay in the compute dtype, and
        `precision_report(...).fp8_skipped` gives both figures. An `fp8_filter`
        given to `filter_amp` or `BiModel` still decides on its own: the modules it
        selects run in fp8 whatever they cost.

        ```python
        model = eqx_amp.filter_amp(model, fp8=eqx_amp.fp8.TENSORWISE.where_it_pays())
        ```
        """
        if self.scaling in NVFP4_SCALINGS:
            raise TypeError(
                "`where_it_pays` estimates what fp8 GEMMs save against their "
                "quantisation passes (tensorwise and rowwise on an H100, MXFP8 on a "
                "B200); NVFP4's 4-bit forward products are not modelled."
            )
        return Fp8Rule(self.name, self.scaling, self.activation_products, True)

    def with_nvfp4_backward(self) -> "Fp8Rule":
        """`eqx_amp.fp8.NVFP4` with its backward products in NVFP4 too, by NVIDIA's
        NVFP4 training recipe (arXiv 2509.25149): each weight quantised in 16 x 16
        tiles, so that the input gradient's product multiplies by the numbers the
        forward product did; output gradients rounded stochastically (unbiased);
        both inputs of each weight gradient rotated by a random 16 x 16 Hadamard
        matrix, which spreads a block's outlier over it. Every product of a layer
        is then a 4-bit GEMM on a B200; the plain `NVFP4` keeps the backward
        products in MXFP8.

        ```python
        rule = eqx_amp.fp8.NVFP4.with_nvfp4_backward()
        model = eqx_amp.filter_amp(model, fp8=rule)
        ```
        """
        if self.scaling not in NVFP4_SCALINGS:
            raise TypeError(
                f"`with_nvfp4_backward` is a form of `eqx_amp.fp8.NVFP4`; {self!r} "
                "runs its backward products as its forward ones already."
            )
        return Fp8Rule(
            self.name, "nvfp4_training", self.activation_products, self.pays_only
        )

    def __call__(self, *args, **kwargs):
        raise TypeError(
            f"eqx_amp.fp8.{self.name} is applied by `autocast` itself (it rebinds the "
            "matmul); it cannot be called as a rule function."
        )

    def run_in_fp8(
        self,
        fn: Callable,
        args: tuple,
        kwargs: dict,
        params: list[Any],
        chosen: bool = False,
    ) -> Any:
        """`fn(*args, **kwargs)` with each matmul that reads one of `params` run as
        an fp8 matmul where its shapes allow one (and, for a `where_it_pays()`
        rule, its cost, unless the user `chosen` the modules), each weight
        quantised once for all of them (`filter_amp(..., fp8=...)`, which reaches
        fp8 through this method rather than importing it)."""
        pays_only = self.pays_only and not chosen
        in_fp8 = ft.partial(self.quantizes_once, pays_only=pays_only)
        prepare = ft.partial(quantize_weights_once, in_fp8, None)
        with holding_fp8_values():
            return evaluate_function(
                _call,
                (fn, args, kwargs),
                Fp8ParamsHook(self.scaling, pays_only),
                param_arrays=params,
                prepare=prepare,
            )

    def quantizes_once(self, eqn: Any, pays_only: bool | None = None) -> bool:
        """Whether the product `eqn` reads weights quantised once per call
        (`quantize_weights_once`): its scales are whole-tensor ones
        (convolutions are always tensorwise), and it runs in fp8 (for a
        `where_it_pays()` rule, or `pays_only`: its shapes pay for it)."""
        if eqn.primitive is lax.conv_general_dilated_p:
            return True
        if self.scaling != "tensorwise":
            return False
        if self.pays_only if pays_only is None else pays_only:
            lhs, rhs = (v.aval.shape for v in eqn.invars)
            dims = eqn.params["dimension_numbers"]
            return fp8_cost_reason(self.scaling, lhs, rhs, dims) is None
        return True

    def __repr__(self) -> str:
        suffix = ".with_nvfp4_backward()" if self.scaling == "nvfp4_training" else ""
        suffix += ".with_activation_products()" if self.activation_products else ""
        suffix += ".where_it_pays()" if self.pays_only else ""
        return f"eqx_amp.fp8.{self.name}{suffix}"

    def _key(self) -> tuple:
        return (self.name, self.scaling, self.activation_products, self.pays_only)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Fp8Rule) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __reduce__(self):
        if (
            self.activation_products
            or self.pays_only
            or self.scaling != _PLAIN[self.name]
        ):
            options = (self.activation_products, self.pays_only)
            return _variant, (self.name, *options, self.scaling)
        return self.name


TENSORWISE = Fp8Rule("TENSORWISE", "tensorwise")
ROWWISE = Fp8Rule("ROWWISE", "rowwise")
MXFP8 = Fp8Rule("MXFP8", "mxfp8")
NVFP4 = Fp8Rule("NVFP4", "nvfp4")


# Each rule's scaling without options.
_PLAIN = {
    "TENSORWISE": "tensorwise",
    "ROWWISE": "rowwise",
    "MXFP8": "mxfp8",
    "NVFP4": "nvfp4",
}


def _variant(
    name: str, activation_products: bool, pays_only: bool, scaling: str | None = None
) -> Fp8Rule:
    """The rule `name` with its options (how such a rule unpickles)."""
    rules = {
        "TENSORWISE": TENSORWISE,
        "ROWWISE": ROWWISE,
        "MXFP8": MXFP8,
        "NVFP4": NVFP4,
    }
    rule = rules[name]
    rule = rule.with_nvfp4_backward() if scaling == "nvfp4_training" else rule
    rule = rule.with_activation_products() if activation_products else rule
    return rule.where_it_pays() if pays_only else rule


def conv_in_fp8(lhs, rhs, params: dict, how: Fp8Product) -> Array:
    """A convolution in fp8 (tensorwise, whatever `how.scaling`); with
    `how.only_eligible`, one whose feature counts an fp8 kernel cannot take runs in
    `how.out_dtype`, under a named scope that gives the reason. Under `jax.vmap`
    the batched convolution decides."""
    params = {k: v for k, v in params.items() if k != "preferred_element_type"}
    out_dtype = how.out_dtype
    if compat.is_batched(lhs) or compat.is_batched(rhs):
        tensorwise = dataclasses.replace(how, scaling="tensorwise")
        return _batched_as_one(lax.conv_general_dilated_p, params, tensorwise)(lhs, rhs)
    reason = fp8_conv_eligible(rhs.shape, params) if how.only_eligible else None
    if reason is not None:
        with jax.named_scope(f"{FP8_SKIPPED_SCOPE}: {reason}"):
            return lax.conv_general_dilated_p.bind(
                lhs.astype(out_dtype),
                rhs.astype(out_dtype),
                **params,
                preferred_element_type=None,
            )
    lhs_dtype, rhs_dtype = jnp.result_type(lhs), jnp.result_type(rhs)
    known = (known_fp8(lhs), known_fp8(rhs))
    conv = fp8_conv(params, out_dtype, lhs_dtype, rhs_dtype)
    return conv(*varying_alike(lhs, rhs), known)


class _Fp8Dots(Hook):
    """Binds every `dot_general` and convolution of a program as an fp8 one (where
    its shapes allow, if `how.only_eligible`)."""

    def __init__(self, how: Fp8Product):
        self.how = how

    def equation(self, eqn, invals, origins, frame, evaluate):
        if eqn.primitive in FP8_PRIMITIVES:
            return [product_in_fp8(eqn, *invals, how=self.how)]
        return evaluate(invals)


def product_in_fp8(eqn, lhs, rhs, *, how: Fp8Product) -> Array:
    """`eqn` (a `dot_general` or a convolution) on `lhs`, `rhs` in fp8, as `how`
    says; convolutions are scaled tensorwise."""
    if eqn.primitive is lax.conv_general_dilated_p:
        return conv_in_fp8(lhs, rhs, eqn.params, how)
    return matmul_in_fp8(lhs, rhs, eqn.params["dimension_numbers"], how)


def weight_operand(origins) -> int | None:
    """Which operand of a product (0 or 1) is a parameter, if exactly one is."""
    params = [i for i, origin in enumerate(origins) if origin is Origin.PARAMS]
    return params[0] if len(params) == 1 else None


def matmul_in_fp8(lhs, rhs, dims, how: Fp8Product) -> Array:
    """An fp8 matmul, as `how` says: with `how.only_eligible`, shapes an fp8 GEMM
    cannot take (and with `how.pays_only`, products that would not pay) run in
    `how.out_dtype` instead, under a named scope that gives the reason. Under
    `jax.vmap` the shapes decided on are the batched ones."""
    (lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch) = dims
    dims = (
        (tuple(lhs_contracting), tuple(rhs_contracting)),
        (tuple(lhs_batch), tuple(rhs_batch)),
    )
    if compat.is_batched(lhs) or compat.is_batched(rhs):
        if current_supply() is not None and how.scaling == "tensorwise":
            raise NotImplementedError(_DELAYED_BATCHED)
        params = {"dimension_numbers": dims}
        return _batched_as_one(lax.dot_general_p, params, how)(lhs, rhs)
    scaling, out_dtype, grad_dtype = how.scaling, how.out_dtype, how.grad_dtype
    reason = None
    if how.only_eligible:
        reason = ineligible(scaling, lhs.shape, rhs.shape, dims)
    if reason is None and scaling in BLOCK_SCALINGS and _PER_EXAMPLE.get():
        reason = _PER_EXAMPLE_REASON
    if reason is None and how.only_eligible and how.pays_only:
        reason = fp8_cost_reason(scaling, lhs.shape, rhs.shape, dims)
    if reason is not None or min(lhs.shape + rhs.shape, default=1) == 0:
        with jax.named_scope(f"{FP8_SKIPPED_SCOPE}: {reason or 'an empty product'}"):
            return lax.dot_general(lhs.astype(out_dtype), rhs.astype(out_dtype), dims)
    lhs_dtype, rhs_dtype = jnp.result_type(lhs), jnp.result_type(rhs)
    supply = current_supply()
    if supply is not None and scaling == "tensorwise":
        lhs, rhs = varying_alike(lhs, rhs)
        return delayed_matmul(
            supply, lhs, rhs, dims, out_dtype, lhs_dtype, rhs_dtype, grad_dtype
        )
    if scaling == "nvfp4_training":
        shapes = (lhs.shape, rhs.shape)
        matmul = nvfp4_matmul(
            dims, shapes, out_dtype, lhs_dtype, rhs_dtype, grad_dtype, how.weight
        )
        return matmul(*varying_alike(lhs, rhs), (None, None))
    if scaling in BLOCK_SCALINGS:
        nvfp4 = scaling == "nvfp4"
        matmul = block_scaled_matmul(
            dims,
            (lhs.shape, rhs.shape),
            out_dtype,
            lhs_dtype,
            rhs_dtype,
            grad_dtype,
            nvfp4_forward=nvfp4,
        )
        known = (None, None) if nvfp4 else _known_blocks(lhs, rhs, dims)
    else:
        matmul = fp8_matmul(dims, scaling, out_dtype, lhs_dtype, rhs_dtype, grad_dtype)
        known = (None, None)
        if scaling == "tensorwise":
            known = (known_fp8(lhs), known_fp8(rhs))
    return matmul(*varying_alike(lhs, rhs), known)


def _known_blocks(lhs, rhs, dims) -> tuple:
    """The recorded MXFP8 forms of the operands that their product contracts along
    their last axis alone, where the recorded blocks lie (`known_block_scaled`)."""
    (lc, rc), (lb, rb) = dims
    return tuple(
        known_block_scaled(x) if tuple(c) == (x.ndim - 1,) and not b else None
        for x, c, b in ((lhs, lc, lb), (rhs, rc, rb))
    )


_DELAYED_BATCHED = (
    "Delayed fp8 scales (`eqx_amp.fp8.delayed`) reach the products of a program "
    "traced outside `jax.vmap` only: apply the wrapper outside the vmap, "
    "`filter_amp(eqx.filter_vmap(model), fp8=...)`."
)


def _batched_as_one(primitive, params, how: Fp8Product):
    """Under `jax.vmap`, the batched product is one fp8 product: its scales cover
    the whole batch."""

    def plain(lhs, rhs):
        if primitive is lax.conv_general_dilated_p:
            return primitive.bind(lhs, rhs, **params, preferred_element_type=None)
        return lax.dot_general(lhs, rhs, params["dimension_numbers"])

    def op(lhs, rhs):
        if primitive is lax.conv_general_dilated_p:
            return conv_in_fp8(lhs, rhs, params, how)
        return matmul_in_fp8(lhs, rhs, params["dimension_numbers"], how)

    return batched_like(plain, op, _Fp8Dots(how))


class Fp8ParamsHook(Hook):
    """Runs a program unchanged, except that each `dot_general` reading a parameter
    (an array of the modules the fp8 filter selected) runs as an fp8 matmul where
    its shapes allow one (`filter_amp(..., fp8=eqx_amp.fp8.TENSORWISE)`)."""

    def __init__(self, scaling: str, pays_only: bool = False):
        self.scaling = scaling
        self.pays_only = pays_only

    def equation(self, eqn, invals, origins, frame, evaluate):
        reads_params = any(
            origin is Origin.PARAMS and jnp.issubdtype(jnp.result_type(v), jnp.floating)
            for v, origin in zip(invals, origins)
        )
        if batched_after_tracing(eqn, invals, origins):
            with traced_per_example(eqn):
                return evaluate(invals)
        if eqn.primitive in FP8_PRIMITIVES and reads_params:
            out_dtype = eqn.outvars[0].aval.dtype
            how = Fp8Product(
                self.scaling,
                out_dtype,
                # The weight gradients are summed (and GSPMD reduces them) in
                # the compute dtype, as the policy's reduce dtype is.
                grad_dtype=out_dtype,
                pays_only=self.pays_only,
                weight=weight_operand(origins),
            )
            return [product_in_fp8(eqn, *invals, how=how)]
        return evaluate(invals)


_TRACED_PER_EXAMPLE = (
    "The matmuls inside this `{name}` cannot run in fp8: a `jax.vmap` applied outside "
    "`filter_amp`/`autocast`/`BiModel` batches its body after eqx_amp has traced it, "
    "one example at a time, and one example's matmul (a matrix times a vector) is "
    "not a shape an fp8 GEMM takes, nor can JAX batch a block-scaled (MXFP8, NVFP4) one; "
    "they run in the compute dtype (`precision_report` lists them). Apply the "
    "wrapper outside the vmap: `eqx_amp.filter_amp(eqx.filter_vmap(model), "
    "fp8=...)(x)`."
)
# Inside a body a `jax.vmap` outside the wrapper batches after it is traced.
_PER_EXAMPLE = contextvars.ContextVar("eqx_amp_fp8_traced_per_example", default=False)
_PER_EXAMPLE_REASON = (
    "traced one example at a time under a `jax.vmap` outside the wrapper, which "
    "cannot batch a block-scaled product"
)


@contextlib.contextmanager
def traced_per_example(eqn: Any) -> Iterator[None]:
    """The context to evaluate the body of `eqn` in, a higher-order primitive that a
    `jax.vmap` outside the wrapper batches after it is traced
    (`batched_after_tracing`): it says so, and keeps the body's block-scaled products in
    the compute dtype (JAX's block-scaled product does not batch an operand whose
    batch it was not traced with).

    ```python
    with traced_per_example(eqn):
        outs = evaluate(invals)
    ```
    """
    warn_once(_TRACED_PER_EXAMPLE.format(name=eqn.primitive))
    token = _PER_EXAMPLE.set(True)
    try:
        yield
    finally:
        _PER_EXAMPLE.reset(token)


def _call(fn: Callable, args: tuple, kwargs: dict) -> Any:
    return fn(*args, **kwargs)
