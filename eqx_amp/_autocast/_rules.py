"""The rule table of `autocast`: which dtype each primitive (or named scope) runs in."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._cast import is_floating_array, widest_dtype
from .._filter_amp import FULL_PRECISION_SCOPE


# A rule has jaxamp's signature: it receives the compute dtype, the dtypes the
# inputs had when the function was traced, and the inputs as they arrive now, and
# returns the inputs (cast as it likes) and the primitive's params.
RuleFn = Callable[..., tuple[Sequence[Any], dict]]


def _floating_dtypes(values: Sequence[Any]) -> list[np.dtype]:
    return [v.dtype for v in values if _is_floating(v)]


def _is_floating(value: Any) -> bool:
    return is_floating_array(value)  # Tracers are `jax.Array`s too.


def _cast(value: Any, dtype: np.dtype | None) -> Any:
    if dtype is None or not _is_floating(value) or value.dtype == dtype:
        return value
    return lax.convert_element_type(value, dtype)


def promotion_dtypes(invals: Sequence[Any], weak: Sequence[bool]) -> list[np.dtype]:
    """The dtypes that decide a promotion: those of the data-derived ("strong")
    floating inputs. Parameters and constants are weakly typed, like Python scalars
    in JAX: they follow the activations they meet, so `bf16 matmul + f32 bias` stays
    bfloat16 (PyTorch's autocast casts a Linear's bias with its matmul, too). Only
    when every input is weak do their own dtypes decide."""
    strong = [v.dtype for v, w in zip(invals, weak) if _is_floating(v) and not w]
    return strong or _floating_dtypes(invals)


class BuiltinRule:
    """One of `LOW`, `FULL`, `PROMOTE`, `KEEP`. Built-in rules are themselves
    callables with the jaxamp signature, so user rules can wrap them."""

    def __init__(self, name: str, target: Callable, doc: str):
        self.name = name
        self._target = target
        self.__doc__ = doc

    def __call__(self, compute_dtype, original_dtypes, *invals, **params):
        return self.cast(
            compute_dtype, original_dtypes, invals, [False] * len(invals)
        ), params

    def cast(
        self, compute_dtype, original_dtypes, invals, weak, cast=None
    ) -> list[Any]:
        """The inputs cast by this rule; `weak` marks the parameter-derived ones, and
        `cast(value, dtype)` does the casting (the interpreter passes one that casts
        each value once)."""
        cast = _cast if cast is None else cast
        deciding = promotion_dtypes(invals, weak)
        targets = [
            self._target(compute_dtype, original, value.dtype, deciding)
            if _is_floating(value)
            else None
            for value, original in zip(invals, original_dtypes)
        ]
        return [cast(v, t) for v, t in zip(invals, targets)]

    def __repr__(self) -> str:
        return f"eqx_amp.{self.name}"

    def __reduce__(self):
        return self.name


def _upcast_to_float32(dtype: np.dtype) -> np.dtype:
    return widest_dtype([dtype, jnp.dtype(jnp.float32)])


LOW = BuiltinRule(
    "LOW",
    lambda compute, original, current, all_current: compute,
    "Casts floating inputs to the compute dtype (matmuls, convolutions).",
)
FULL = BuiltinRule(
    "FULL",
    lambda compute, original, current, all_current: _upcast_to_float32(current),
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
        original if jnp.issubdtype(original, jnp.floating) else current
    ),
    "Casts floating inputs back to the dtypes the original program had.",
)
BUILTIN_RULES = (LOW, FULL, PROMOTE, KEEP)


class _ParameterLookup(BuiltinRule):
    """The rule of `gather` and `dynamic_slice`: a parameter table read at positions
    chosen by the data (an embedding lookup) is an activation, so it is read in the
    compute dtype, as from a model cast by hand. Lookups of data, and slices of a
    parameter at constant positions, are not cast."""

    def cast(self, compute_dtype, original_dtypes, invals, weak, cast=None):
        cast = _cast if cast is None else cast
        table, *positions = invals
        if weak[0] and not all(weak[1:]):
            table = cast(table, compute_dtype)
        return [table, *positions]

    def __repr__(self) -> str:
        return "eqx_amp.DEFAULT_RULES[jax.lax.gather_p]"


LOOKUP = _ParameterLookup("LOOKUP", None, _ParameterLookup.__doc__)


def _full_for_float16(compute_dtype, original_dtypes, *invals, **params):
    """For ops whose trouble in half precision is float16's range, not its precision:
    `x**3` (in GELU) overflows float16 from x = 41, and `logistic` saturates to
    exactly 0 or 1 far earlier than in float32. bfloat16 has float32's range, so
    there they stay in the low dtype (and the activations after them too)."""
    if any(v.dtype == jnp.float16 for v in invals if _is_floating(v)):
        return FULL(compute_dtype, original_dtypes, *invals, **params)
    return list(invals), params


def _primitive(name: str) -> Any | None:
    return getattr(lax, f"{name}_p", None)


_LOW_PRIMITIVES = (
    "dot_general",
    "conv_general_dilated",
    "ragged_dot",
    "ragged_dot_general",
)
_FULL_PRIMITIVES = (
    "exp", "exp2", "expm1", "log", "log1p", "pow", "rsqrt", "tan",
    "sinh", "cosh", "asin", "acos", "erf_inv", "reduce_sum", "reduce_prod",
    "cumsum", "cumprod", "cumlogsumexp",
)  # fmt: skip
_PROMOTE_PRIMITIVES = (
    "add", "sub", "mul", "div", "rem", "max", "min", "atan2", "nextafter",
    "eq", "ne", "lt", "le", "gt", "ge", "select_n", "concatenate", "pad", "clamp",
    "dynamic_update_slice", "scatter", "scatter_add", "scatter_sub", "scatter_mul",
    "scatter_min", "scatter_max", "add_any",
)  # fmt: skip

# Equinox's normalisation layers open these named scopes: their statistics must be
# computed in float32. Code under `full_precision()` keeps its traced dtypes.
NORM_SCOPES = (
    "eqx.nn.LayerNorm",
    "eqx.nn.RMSNorm",
    "eqx.nn.GroupNorm",
    "eqx.nn.BatchNorm",
)

# The norm layers among them end with `out.astype(orig_dtype)`: they hand back the
# dtype their input arrived in, and under autocast they still do (BatchNorm promotes
# with its float32 running statistics instead).
LAYERS_RETURNING_INPUT_DTYPE = (
    "eqx.nn.LayerNorm",
    "eqx.nn.RMSNorm",
    "eqx.nn.GroupNorm",
)


def _default_rules() -> dict[Any, Any]:
    rules: dict[Any, Any] = {}
    for names, rule in (
        (_LOW_PRIMITIVES, LOW),
        (_FULL_PRIMITIVES, FULL),
        (_PROMOTE_PRIMITIVES, PROMOTE),
    ):
        for name in names:
            primitive = _primitive(name)
            if primitive is not None:  # ragged_dot and friends depend on the version
                rules[primitive] = rule
    add_any = getattr(jax.extend.core.primitives, "add_jaxvals_p", None)
    if add_any is not None:
        rules[add_any] = PROMOTE
    rules[lax.gather_p] = LOOKUP
    rules[lax.dynamic_slice_p] = LOOKUP
    rules[lax.logistic_p] = _full_for_float16
    rules[lax.integer_pow_p] = _full_for_float16
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
    "`eqx_amp.LOW`, `eqx_amp.FULL`, `eqx_amp.PROMOTE`, `eqx_amp.KEEP`, or a callable "
    "`rule(compute_dtype, original_dtypes, *invals, **params) -> (invals, params)`."
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
                if not (
                    isinstance(key, str) or isinstance(key, jax.extend.core.Primitive)
                ):
                    raise TypeError(_BAD_KEY.format(key, type(key).__name__))
                if not callable(rule):
                    raise ValueError(_BAD_VALUE.format(key, rule))
                merged[key] = rule
        self.by_primitive = {k: v for k, v in merged.items() if not isinstance(k, str)}
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

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RuleTable) and self._key == other._key
