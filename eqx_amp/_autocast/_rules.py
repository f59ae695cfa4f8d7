"""The rule table of `autocast`: which dtype each primitive (or named scope) runs in."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.lax.linalg
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core._cast import (
    at_least_float32,
    is_floating_array,
    is_floating_dtype,
    widest_dtype,
)
from .._core._filters import FULL_PRECISION_SCOPE, NORM_SCOPES, keep
from .._fp8 import Fp8Rule
from .._jaxpr import _compat as compat
from .._jaxpr._hook import MATMUL_PRIMITIVES, Origin


# A rule has jaxamp's signature: it receives the compute dtype, the dtypes the
# inputs had when the function was traced, and the inputs as they arrive now, and
# returns the inputs (cast as it likes) and the primitive's params.
RuleFn = Callable[..., tuple[Sequence[Any], dict]]


def _floating_dtypes(values: Sequence[Any]) -> list[np.dtype]:
    return [v.dtype for v in values if is_floating_array(v)]


def _cast(value: Any, dtype: np.dtype | None, origin: Origin = Origin.DATA) -> Any:
    if dtype is None or not is_floating_array(value) or value.dtype == dtype:
        return value
    if origin is Origin.CONSTANT:
        value = saturate(value, dtype)
    return lax.convert_element_type(value, dtype)


def saturate(value: Any, dtype: np.dtype) -> Any:
    """`value` clipped to the finite range of `dtype`, where that range is narrower
    than its own: a constant such as a mask's fill value (float32's minimum) becomes
    the narrower dtype's minimum, not -inf (and a fully masked softmax row, not NaN).
    NumPy values are clipped now; traced ones by an op XLA folds into the cast."""
    low, high = (float(x) for x in (jnp.finfo(dtype).min, jnp.finfo(dtype).max))
    if float(jnp.finfo(value.dtype).max) <= high:
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        return np.clip(value, low, high)
    return lax.clamp(
        jnp.asarray(low, value.dtype), value, jnp.asarray(high, value.dtype)
    )


def follows_activations(origins: Sequence[Origin]) -> list[bool]:
    """Which values follow the activations they meet: those computed from parameters
    and constants alone, which are weakly typed as Python scalars are in JAX."""
    return [origin >= Origin.PARAMS for origin in origins]


def promotion_dtypes(
    invals: Sequence[Any], from_params: Sequence[bool]
) -> list[np.dtype]:
    """The dtypes that decide a promotion: those of the floating inputs computed from
    data. Values computed from parameters and constants alone follow the activations
    they meet, as Python scalars do in JAX, so `bf16 matmul + f32 bias` stays
    bfloat16 (PyTorch's autocast casts a Linear's bias with its matmul, too). Only
    when every input comes from parameters do their own dtypes decide."""
    data = [
        v.dtype
        for v, is_param in zip(invals, from_params)
        if is_floating_array(v) and not is_param
    ]
    return data or _floating_dtypes(invals)


_NOT_A_RULE_CALL: Any = object()
_RULE_AS_FILTER_SPEC = (
    "`eqx_amp.{0}` is an autocast rule, for `eqx_amp.autocast(fn, rules=...)`, not a "
    "filter spec. To keep modules in their parameter dtype under `filter_amp`, "
    "`BiModel` or `cast_tree`, pass `filter_spec=eqx_amp.keep(model, Type, ...)`."
)
_FILTER_SPEC_AS_RULE = (
    "The rule for {!r} is `eqx_amp.keep`, which builds a filter spec for "
    "`filter_amp`, `BiModel` and `cast_tree`. The autocast rule that runs an op in "
    "the dtypes it was traced with is `eqx_amp.KEEP`."
)


class BuiltinRule:
    """One of `LOW`, `FULL`, `PROMOTE`, `KEEP`. Built-in rules are themselves
    callables with the jaxamp signature, so user rules can wrap them."""

    # `target` is `None` for a subclass that overrides `cast`.
    def __init__(self, name: str, target: Callable | None, doc: str | None):
        self.name = name
        self._target = target
        self.__doc__ = doc

    def __call__(
        self, compute_dtype, original_dtypes=_NOT_A_RULE_CALL, *invals, **params
    ):
        if original_dtypes is _NOT_A_RULE_CALL:
            # Called with one argument: used as a filter spec (`leaf -> bool`).
            raise TypeError(_RULE_AS_FILTER_SPEC.format(self.name))
        return self.cast(
            compute_dtype, original_dtypes, invals, [Origin.DATA] * len(invals)
        ), params

    def cast(
        self, compute_dtype, original_dtypes, invals, origins, cast=None
    ) -> list[Any]:
        """The inputs cast by this rule; `origins` says what each was computed from,
        and `cast(value, dtype, origin)` does the casting (autocast passes one that
        casts each value once)."""
        cast = _cast if cast is None else cast
        target = self._target
        assert target is not None, "a rule without a target must override `cast`"
        deciding = promotion_dtypes(invals, follows_activations(origins))
        targets = [
            target(compute_dtype, original, value.dtype, deciding)
            if is_floating_array(value)
            else None
            for value, original in zip(invals, original_dtypes)
        ]
        return [cast(v, t, o) for v, t, o in zip(invals, targets, origins)]

    def __repr__(self) -> str:
        return f"eqx_amp.{self.name}"

    def __reduce__(self):
        return self.name


LOW = BuiltinRule(
    "LOW",
    lambda compute, original, current, all_current: compute,
    "Casts floating inputs to the compute dtype (matmuls, convolutions).",
)
FULL = BuiltinRule(
    "FULL",
    lambda compute, original, current, all_current: at_least_float32(current),
    "Casts floating inputs up to float32 (ops that overflow or lose precision in "
    "half precision: exp, log, pow, rsqrt, large reductions, ...).",
)
PROMOTE = BuiltinRule(
    "PROMOTE",
    lambda compute, original, current, all_current: widest_dtype(all_current),
    "Casts floating inputs to the widest floating dtype among the data-derived "
    "inputs (binary and n-ary elementwise ops, which need their operands to agree); "
    "parameters and constants follow, as weakly typed values do in JAX.",
)
KEEP = BuiltinRule(
    "KEEP",
    lambda compute, original, current, all_current: (
        original if is_floating_dtype(original) else current
    ),
    "Casts floating inputs back to the dtypes the original program had.",
)
BUILTIN_RULES = (LOW, FULL, PROMOTE, KEEP)


class _ParameterLookup(BuiltinRule):
    """The rule of `gather` and `dynamic_slice`: a parameter table read at positions
    chosen by the data (an embedding lookup) is an activation, so it is read in the
    compute dtype, as from a model cast by hand. Lookups of data, and slices of a
    parameter at constant positions, are not cast."""

    def cast(self, compute_dtype, original_dtypes, invals, origins, cast=None):
        cast = _cast if cast is None else cast
        table, *positions = invals
        from_params = follows_activations(origins)
        if from_params[0] and not all(from_params[1:]):
            table = cast(table, compute_dtype, origins[0])
        return [table, *positions]

    def __repr__(self) -> str:
        return "eqx_amp.DEFAULT_RULES[jax.lax.gather_p]"


LOOKUP = _ParameterLookup("LOOKUP", None, _ParameterLookup.__doc__)


def _full_for_float16(compute_dtype, original_dtypes, *invals, **params):
    """For ops whose trouble in half precision is float16's range, not its precision:
    `x**3` (in GELU) overflows float16 from x = 41, and `logistic` saturates to
    exactly 0 or 1 far earlier than in float32. bfloat16 has float32's range, so
    there they stay in the low dtype (and the activations after them too)."""
    if any(v.dtype == jnp.float16 for v in invals if is_floating_array(v)):
        return FULL(compute_dtype, original_dtypes, *invals, **params)
    return list(invals), params


def _square_in_full(compute_dtype, original_dtypes, *invals, **params):
    """`x**2` is a square (see `lax.square_p` below): float32. Other powers (`x**3`
    in GELU) have float16's range for trouble, not its precision."""
    if params.get("y") == 2:
        return FULL(compute_dtype, original_dtypes, *invals, **params)
    return _full_for_float16(compute_dtype, original_dtypes, *invals, **params)


_FULL_PRIMITIVES = (
    lax.exp_p, lax.exp2_p, lax.expm1_p, lax.log_p, lax.log1p_p, lax.pow_p,
    lax.rsqrt_p, lax.tan_p, lax.sinh_p, lax.cosh_p, lax.asin_p, lax.acos_p,
    lax.erf_inv_p, lax.reduce_sum_p, lax.reduce_prod_p, lax.cumsum_p, lax.cumprod_p,
    lax.cumlogsumexp_p,
    # A sum over each window (average pooling): in bfloat16 a running sum of values
    # near 1 stops growing at 2**8 steps of its own ulp.
    lax.reduce_window_sum_p,
    # XLA has no half-precision FFT (an RFFT of bfloat16 is refused).
    lax.fft_p,
    # A variance as E[x^2] - E[x]^2 cancels: squares rounded to bfloat16 (2^-9) are
    # off by more than the variance once the mean is ~16x the spread (a norm layer
    # that does not compute in float32 itself, such as Flax's).
    lax.square_p,
)  # fmt: skip
# Decompositions and solves: LAPACK and cuSOLVER have no half-precision kernels, and
# their results are ill-conditioned in half precision anyway (PyTorch's autocast
# lists them as float32 ops too).
_LINALG_PRIMITIVES = tuple(
    getattr(jax.lax.linalg, f"{name}_p", None)
    for name in (
        "cholesky", "cholesky_update", "eig", "eigh", "hessenberg",
        "householder_product", "lu", "ormqr", "qr", "schur", "svd",
        "symmetric_product", "triangular_solve", "tridiagonal", "tridiagonal_solve",
    )
)  # fmt: skip
_PROMOTE_PRIMITIVES = (
    lax.add_p, lax.sub_p, lax.mul_p, lax.div_p, lax.rem_p, lax.max_p, lax.min_p,
    lax.atan2_p, lax.nextafter_p, lax.eq_p, lax.ne_p, lax.lt_p, lax.le_p, lax.gt_p,
    lax.ge_p, lax.select_n_p, lax.concatenate_p, lax.pad_p, lax.clamp_p,
    lax.dynamic_update_slice_p, lax.scatter_p, lax.scatter_add_p, lax.scatter_sub_p,
    lax.scatter_mul_p, lax.scatter_min_p, lax.scatter_max_p,
)  # fmt: skip


def _default_rules() -> dict[Any, Any]:
    rules: dict[Any, Any] = {}
    for primitives, rule in (
        (MATMUL_PRIMITIVES, LOW),
        (_FULL_PRIMITIVES, FULL),
        (compat.present(*_LINALG_PRIMITIVES), FULL),
        (compat.present(*_PROMOTE_PRIMITIVES, compat.add_jaxvals_p), PROMOTE),
    ):
        rules.update((primitive, rule) for primitive in primitives)
    rules[lax.gather_p] = LOOKUP
    rules[lax.dynamic_slice_p] = LOOKUP
    rules[lax.logistic_p] = _full_for_float16
    rules[lax.integer_pow_p] = _square_in_full

    for scope in NORM_SCOPES:
        rules[scope] = FULL
    rules[FULL_PRECISION_SCOPE] = KEEP
    return rules


DEFAULT_RULES: Mapping[Any, Any] = _default_rules()

_BAD_KEY = (
    "`rules` keys must be JAX primitives (such as `jax.lax.exp_p`) or "
    "`jax.named_scope` names (strings), but got {!r} of type {}."
)
_BAD_VALUE = (
    "The rule for {!r} is {!r}, which is not a rule. A rule is one of "
    "`eqx_amp.LOW`, `eqx_amp.FULL`, `eqx_amp.PROMOTE`, `eqx_amp.KEEP`, "
    "`eqx_amp.fp8.TENSORWISE`, `eqx_amp.fp8.ROWWISE`, or a callable "
    "`rule(compute_dtype, original_dtypes, *invals, **params) -> (invals, params)`."
)

_BAD_RESULT = (
    "The autocast rule {!r}, called for `{}`, must return a pair `(invals, params)`: "
    "a list of the {} inputs (cast as it likes) and the primitive's params as a "
    "dict, as in `rule(compute_dtype, original_dtypes, *invals, **params) -> "
    "(invals, params)`."
)


class RuleTable:
    """User rules merged over `DEFAULT_RULES`, split into primitive and scope rules.
    Hashable by identity of its contents, so it can be a static field."""

    def __init__(self, rules: Mapping[Any, Any] | None):
        merged = dict(DEFAULT_RULES)
        if rules is not None:
            if not isinstance(rules, Mapping):
                raise TypeError(
                    "`rules` must be a mapping from primitives or scope names to "
                    f"rules, but got {type(rules).__name__}."
                )
            for key, rule in rules.items():
                if not (isinstance(key, str) or isinstance(key, compat.Primitive)):
                    raise TypeError(_BAD_KEY.format(key, type(key).__name__))
                if rule is keep:
                    raise TypeError(_FILTER_SPEC_AS_RULE.format(key))
                if not callable(rule) or isinstance(rule, type):
                    # A dtype such as `jnp.float32` is callable, but not a rule.
                    raise ValueError(_BAD_VALUE.format(key, rule))
                merged[key] = rule
        self.by_primitive = {k: v for k, v in merged.items() if not isinstance(k, str)}
        self.uses_fp8 = any(isinstance(v, Fp8Rule) for v in merged.values())
        self.by_scope = {k: v for k, v in merged.items() if isinstance(k, str)}
        self._key = tuple(sorted((repr(k), id(v)) for k, v in merged.items()))

    def lookup(self, primitive: Any, scopes: Sequence[str]) -> Any | None:
        """The innermost matching scope rule wins; otherwise the primitive's rule;
        otherwise `None` (the op runs on the dtypes that reach it)."""
        for scope in reversed(scopes):
            rule = self.by_scope.get(scope)
            if rule is not None:
                return rule
        return self.by_primitive.get(primitive)

    @staticmethod
    def call_user_rule(
        rule: RuleFn,
        primitive: Any,
        compute_dtype: np.dtype,
        original_dtypes: Sequence[np.dtype],
        invals: Sequence[Any],
        params: Mapping[str, Any],
    ) -> tuple[list, dict]:
        """Calls a user's rule and checks that it kept its contract."""
        result = rule(compute_dtype, list(original_dtypes), *invals, **params)
        if not (
            isinstance(result, tuple)
            and len(result) == 2
            and isinstance(result[0], (tuple, list))
            and len(result[0]) == len(invals)
            and isinstance(result[1], Mapping)
        ):
            raise TypeError(_BAD_RESULT.format(rule, primitive, len(invals)))
        return list(result[0]), dict(result[1])

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RuleTable) and self._key == other._key
