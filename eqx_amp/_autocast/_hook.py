"""`autocast`'s pass over a jaxpr: each op's floating inputs cast by its rule."""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core._cast import is_floating_array, is_floating_dtype, widest_dtype
from .._fp8 import (
    FP8_PRIMITIVES,
    FP8_SCOPE,
    FP8_SKIPPED_SCOPE,
    Fp8Product,
    Fp8Rule,
    known_fp8,
    product_in_fp8,
    quantize_weights_once,
    remember_fp8,
    traced_per_example,
    weight_operand,
)
from .._jaxpr import _compat as compat
from .._jaxpr._hook import Evaluate, Frame, Hook, Origin, is_higher_order, traced_dtypes
from .._jaxpr._outer_vmap import batched_after_tracing
from .._sharding import (
    bind_reducing_gradients,
    reduced_operands,
    warn_if_batched_after_tracing,
)
from ._layer_calls import LayerCalls
from ._rules import (
    LOW,
    BuiltinRule,
    RuleTable,
    follows_activations,
    promotion_dtypes,
    saturate,
)


class AutocastHook(Hook):
    """Casts each first-order op's inputs by the rule its primitive (or innermost
    named scope) has; higher-order primitives are left to the evaluator, which
    recurses into them under this hook."""

    def __init__(
        self,
        rules: RuleTable,
        compute_dtype: np.dtype,
        reduce_dtype: np.dtype | None = None,
    ):
        self.rules = rules
        self.compute_dtype = compute_dtype
        # Weight gradients are emitted in it, where it differs from compute_dtype.
        self.reduce_dtype = None if reduce_dtype == compute_dtype else reduce_dtype

    def enter_jaxpr(self, frame: Frame) -> "_JaxprCasts":
        return _JaxprCasts(self, frame)

    def quantize_weights(self, jaxpr: Any, values: list, origins: list) -> None:
        """Quantises the weights that the program's fp8 products read, once for
        all of them (`quantize_weights_once`, as `evaluate_function`'s `prepare`)."""

        def in_fp8(eqn) -> bool:
            rule = self.rules.lookup(eqn.primitive, compat.scope_names(eqn))
            return isinstance(rule, Fp8Rule) and rule.quantizes_once(eqn)

        quantize_weights_once(in_fp8, self.compute_dtype, jaxpr, values, origins)


class _JaxprCasts(Hook):
    """The autocast hook for one jaxpr: its casts (one per value and dtype) and the
    norm-layer calls it holds."""

    def __init__(self, autocast: AutocastHook, frame: Frame):
        self._rules = autocast.rules
        self._compute_dtype = autocast.compute_dtype
        self._reduce_dtype = autocast.reduce_dtype
        self._casts = _CastCache()
        self._layer_calls = LayerCalls(frame)

    def equation(self, eqn, invals, origins, frame, evaluate: Evaluate) -> list:
        call = self._layer_calls.call_of(eqn, frame)
        invals = self._layer_calls.read(
            eqn.invars, invals, follows_activations(origins), call, self._casts
        )
        if is_higher_order(eqn):
            if self._reduce_dtype is not None:
                warn_if_batched_after_tracing(eqn, invals, origins)
            if self._rules.uses_fp8 and batched_after_tracing(eqn, invals, origins):
                with traced_per_example(eqn):
                    outs = evaluate(invals)
            else:
                outs = evaluate(invals)
        else:
            outs = self._first_order(eqn, invals, origins, frame, evaluate)
        self._layer_calls.made(eqn.outvars, call)
        return outs

    def _first_order(self, eqn, invals, origins, frame, evaluate) -> list:
        if FP8_SCOPE in frame.scopes:
            # An fp8 product's own arithmetic (scales, quantisation, its dots and
            # their CPU forms) has its dtypes by design.
            return evaluate(invals)
        original = traced_dtypes(eqn.invars)
        rule = self._rules.lookup(eqn.primitive, frame.scopes)
        if isinstance(rule, Fp8Rule):
            if eqn.primitive in FP8_PRIMITIVES and all(
                is_floating_array(v) for v in invals
            ):
                return self._fp8(eqn, rule, invals, original, origins)
            rule = self._rules.by_primitive.get(eqn.primitive)
        if rule is None:
            invals = _agree_if_they_did(invals, original, origins, self._casts)
        elif isinstance(rule, BuiltinRule):
            invals = rule.cast(
                self._compute_dtype, original, invals, origins, self._casts
            )
        else:
            # A user's rule gets exactly what it returns.
            return evaluate(
                *self._rules.call_user_rule(
                    rule,
                    eqn.primitive,
                    self._compute_dtype,
                    original,
                    invals,
                    eqn.params,
                )
            )
        params = _follow_inputs(eqn, invals)
        weights = reduced_operands(eqn, invals, origins)
        if self._reduce_dtype is not None and weights:
            return bind_reducing_gradients(
                eqn, invals, weights, self._reduce_dtype, params
            )
        return evaluate(invals, params)

    def _fp8(self, eqn, rule, invals, original, origins) -> list:
        known = [known_fp8(v) for v in invals]  # quantised before the program ran
        invals = LOW.cast(self._compute_dtype, original, invals, origins, self._casts)
        if (
            eqn.primitive is lax.dot_general_p
            and not rule.activation_products
            and all(o is Origin.DATA for o in origins)
        ):
            # As the compute-dtype rule runs it: the accumulation type follows the
            # new inputs (a float32 output would make its backward products float32
            # GEMMs).
            params = _follow_inputs(eqn, invals)
            with jax.named_scope(f"{FP8_SKIPPED_SCOPE}: {_NO_PARAMETER}"):
                return [lax.dot_general_p.bind(*invals, **params)]
        for value, fp8 in zip(invals, known):
            if fp8 is not None:
                remember_fp8(value, *fp8)  # its cast holds the same fp8 values
        params = _follow_inputs(eqn, invals)
        out_dtype = params.get("preferred_element_type") or widest_dtype(
            v.dtype for v in invals
        )
        how = Fp8Product(
            rule.scaling,
            out_dtype,
            grad_dtype=self._reduce_dtype or self._compute_dtype,
            pays_only=rule.pays_only,
            weight=weight_operand(origins),
        )
        return [product_in_fp8(eqn, *invals, how=how)]


# Why an fp8 rule leaves a product of two activations in the compute dtype.
_NO_PARAMETER = (
    "reads no parameter (attention's scores or probabilities times values: "
    "quantising both operands at every call costs more than the fp8 GEMM saves; "
    "`rule.with_activation_products()` runs them in fp8)"
)


class _CastCache:
    """One cast per (value, dtype) per jaxpr: a LayerNorm output read by the q, k and
    v projections is converted once, not three times (each copy would otherwise be
    a separate value saved for the backward pass)."""

    def __init__(self):
        self._casts: dict[tuple[int, np.dtype], tuple[Any, Any]] = {}

    def __call__(
        self, value: Any, dtype: np.dtype | None, origin: Origin = Origin.DATA
    ) -> Any:
        if dtype is None or not is_floating_array(value) or value.dtype == dtype:
            return value
        # A constant too large for the narrower dtype becomes its largest value.
        saturated = saturate if origin is Origin.CONSTANT else lambda v, _: v
        if isinstance(value, (np.ndarray, np.generic)):
            # A literal: cast now, so it stays a constant rather than becoming a
            # traced value (which the backward pass might save).
            return np.asarray(saturated(value, dtype)).astype(dtype)
        key = (id(value), jnp.dtype(dtype))
        if key not in self._casts:
            # The source is kept alive with its cast, so its id cannot be reused.
            cast = lax.convert_element_type(saturated(value, dtype), dtype)
            self._casts[key] = (value, cast)
        return self._casts[key][1]


def _floating_positions(values: Sequence[Any]) -> list[int]:
    return [i for i, v in enumerate(values) if is_floating_array(v)]


def _agree_if_they_did(
    invals: list, original: list[np.dtype], origins: list[Origin], cast: _CastCache
) -> list:
    """An op no rule covers runs on the dtypes that reach it, but where its floating
    operands had one dtype in the original program (as lax requires of most
    multi-operand ops), they are promoted to agree again."""
    positions = _floating_positions(invals)
    if len(positions) < 2 or len({original[i] for i in positions}) != 1:
        return invals
    if len({invals[i].dtype for i in positions}) == 1:
        return invals
    target = widest_dtype(promotion_dtypes(invals, follows_activations(origins)))
    return [
        cast(v, target, origin) if i in positions else v
        for i, (v, origin) in enumerate(zip(invals, origins))
    ]


def _follow_inputs(eqn: Any, invals: list) -> dict:
    """The equation's params, with a default accumulation type that follows the
    inputs' new dtypes. One the user asked for explicitly (bf16 x bf16 -> f32, say)
    is honoured."""
    params = dict(eqn.params)
    preferred = params.get("preferred_element_type")
    floating_in = [v.dtype for v in invals if is_floating_array(v)]
    if preferred is None or not floating_in or not is_floating_dtype(preferred):
        return params
    original = [d for d in traced_dtypes(eqn.invars) if is_floating_dtype(d)]
    # An fp8 product (fp8 values, e8m0 scales) chose its output dtype itself, and
    # 8-bit floats have no promotion to follow.
    if any(jnp.dtype(d).itemsize == 1 for d in [*original, *floating_in]):
        return params
    original_widest = widest_dtype(original)
    if original_widest is not None and jnp.dtype(preferred) == original_widest:
        params["preferred_element_type"] = widest_dtype(floating_in)
    return params
