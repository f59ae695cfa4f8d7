"""Loss scaling, with the semantics of google-deepmind/jmp, as `eqx.Module`s.

A loss scale multiplies the loss before differentiation so that small gradients do
not underflow in half precision, and divides the gradients afterwards. All three
scales are pytrees whose array leaves are scalars (`loss_scale` float32, `counter`
int32, `min_loss_scale` float32) and whose configuration (`period`, `factor`) is
static, so a scale passes through `jax.jit` with every field intact, can be a
`lax.scan` or `lax.while_loop` carry, and round-trips through
`eqx.tree_serialise_leaves`.
"""

import abc
import functools as ft
import math
import numbers
import operator
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from equinox import AbstractVar
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PyTree

from .._core._cast import at_least_float32, is_inexact_array
from .._core._describe import describe


_GRADS_FINITE_NOT_BOOL = (
    "`grads_finite` must be a boolean scalar, such as the output of "
    "`eqx_amp.all_finite(grads)`, but got {}."
)


#
# Helpers.
#


def _scalar_array(value: Any, dtype: Any, argname: str) -> Array:
    """`value` as a scalar array of `dtype`; the argument is named on error. A
    Python or NumPy number is checked before conversion, so that a value the dtype
    cannot hold is reported as given, not as what it became."""
    is_number = _is_real_number(value)
    is_real_array = eqx.is_array(value) and (
        jnp.issubdtype(value.dtype, jnp.integer)
        or jnp.issubdtype(value.dtype, jnp.floating)
    )
    if not (is_number or is_real_array):
        raise TypeError(
            f"`{argname}` must be a real number or a real scalar array, but got "
            f"{describe(value)}."
        )
    if np.shape(value) != ():
        raise ValueError(
            f"`{argname}` must be a scalar, but got an array of shape "
            f"{tuple(np.shape(value))}."
        )
    if not isinstance(value, jax.core.Tracer):
        # An array too: `jnp.asarray` would wrap an int64 past int32 and truncate a
        # float counter silently.
        _check_holds(value.item() if eqx.is_array(value) else value, dtype, argname)
    return jnp.asarray(value, dtype=dtype)


def _check_holds(value: int | float, dtype: Any, argname: str) -> None:
    """Raises unless the concrete number `value` is one `dtype` (int32 or float32)
    holds as it is: a whole number within int32, or a positive normal float32."""
    if jnp.issubdtype(dtype, jnp.floating):
        try:
            as_float = float(value)
        except OverflowError:  # an int past any float
            as_float = math.inf
        _check_normal_float32(as_float, argname, given=value)
        return
    if not (math.isfinite(value) and value == int(value)):
        raise ValueError(f"`{argname}` must be a whole number, but got {value!r}.")
    info = np.iinfo(dtype)
    if not info.min <= int(value) <= info.max:
        raise ValueError(
            f"`{argname}` must fit an int32 (from {info.min} to {info.max}), but got "
            f"{value!r}."
        )


def _is_real_number(value: Any) -> bool:
    # A predicate of its own: inline, the `isinstance` narrowing of `value` would
    # leak into the array checks of `_scalar_array`. NumPy scalars are told apart by
    # dtype: bfloat16's (from ml_dtypes) is no `np.floating`.
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, np.generic):
        return jnp.issubdtype(value.dtype, jnp.integer) or jnp.issubdtype(
            value.dtype, jnp.floating
        )
    return isinstance(value, numbers.Real)


_FLOAT32 = np.finfo(np.float32)


def _check_normal_float32(value: float, argname: str, given: Any = None) -> None:
    """A scale must be a positive normal float32: XLA flushes subnormals to zero on
    most backends, and a scale of exactly 0 (or inf) ends training silently.
    `given`: the number as the caller gave it, for the message."""
    if not (float(_FLOAT32.tiny) <= value <= float(_FLOAT32.max)):
        raise ValueError(
            f"`{argname}` must be a positive, normal float32 number, between "
            f"{float(_FLOAT32.tiny):.6g} (2**-126) and {float(_FLOAT32.max):.6g}, "
            f"but got {value if given is None else given!r}."
        )


_as_loss_scale = ft.partial(_scalar_array, dtype=jnp.float32, argname="loss_scale")
_as_counter = ft.partial(_scalar_array, dtype=jnp.int32, argname="counter")
_as_min_loss_scale = ft.partial(
    _scalar_array, dtype=jnp.float32, argname="min_loss_scale"
)


def _concrete(x: Array) -> float | None:
    """The value of a scalar array, or `None` under tracing (a scale is rebuilt with
    tracers inside `jit`, and those values cannot be checked)."""
    if isinstance(x, jax.core.Tracer):
        return None
    return float(x)


def _as_period(period: Any) -> int:
    if isinstance(period, (bool, np.bool_)):
        raise TypeError("`period` must be a Python int, not a bool.")
    try:
        period = operator.index(period)
    except TypeError:
        raise TypeError(
            f"`period` must be a Python int (it is static configuration, part of "
            f"the pytree structure), but got {describe(period)}."
        ) from None
    if not 1 <= period <= _MAX_PERIOD:
        raise ValueError(
            f"`period` must be from 1 to {_MAX_PERIOD} (the number of finite steps in "
            f"a row before the scale grows; the counter is an int32), but got "
            f"{period}."
        )
    return period


_MAX_PERIOD = 2**31 - 1


def _as_factor(factor: Any) -> int | float:
    if not _is_real_number(factor):
        raise TypeError(
            f"`factor` must be a Python int or float (it is static configuration, "
            f"part of the pytree structure), but got {describe(factor)}."
        )
    given = factor
    try:
        with np.errstate(over="ignore"):
            in_float32 = float(np.float32(factor))
    except OverflowError:  # an int past any float
        in_float32 = math.inf
    # The scale is multiplied by `factor` in float32: one that rounds to 1 there
    # would never move it, and an int past int32 would not be taken as a scalar.
    if not (1 < in_float32 <= float(_FLOAT32.max)):
        raise ValueError(
            f"`factor` must be greater than 1 and at most the largest float32 (the "
            f"scale is multiplied by it to grow and divided by it to back off, in "
            f"float32, where it must not round to 1), but got {given!r}."
        )
    fits_int32 = isinstance(factor, (int, np.integer)) and factor <= _MAX_PERIOD
    return int(factor) if fits_int32 else float(factor)


def _check_positive_finite(x: Array, argname: str) -> None:
    value = _concrete(x)
    if value is not None:
        _check_normal_float32(value, argname)


def _scale_tree(tree: PyTree, loss_scale: Float[Array, ""]) -> PyTree:
    """Multiplies every inexact (floating or complex) array by `loss_scale`,
    computing in at least float32 and rounding once back to the leaf's dtype (so a
    float16 leaf times a scale of 2**16, which float16 cannot hold, is not
    `0 * inf = nan`)."""

    def scale(x):
        if not is_inexact_array(x):
            return x
        wide = at_least_float32(x.dtype)
        return (x.astype(wide) * loss_scale.astype(wide)).astype(x.dtype)

    return jtu.tree_map(scale, tree)


def _unscale_tree(tree: PyTree, loss_scale: Float[Array, ""] | None) -> PyTree:
    """Divides every inexact array by `loss_scale` in at least float32, and returns
    it in that dtype: half-precision leaves come back as float32, so a gradient too
    small for float16 survives the unscaling. Complex arrays are unscaled too:
    `eqx.filter_grad` differentiates every inexact array, so every one of them was
    scaled. `None` only upcasts."""

    def unscale(x):
        if not is_inexact_array(x):
            return x
        wide = at_least_float32(x.dtype)
        x = x.astype(wide)
        if loss_scale is None:
            return x
        # A division, not a multiplication by the reciprocal: exact for every scale,
        # and 1/scale is subnormal (flushed to zero on some backends) past 2**126.
        return x / loss_scale.astype(wide)

    return jtu.tree_map(unscale, tree)


def _check_grads_finite(grads_finite: Any) -> Bool[Array, ""]:
    if isinstance(grads_finite, (bool, np.bool_)):
        return jnp.asarray(grads_finite)
    if not eqx.is_array(grads_finite) or grads_finite.dtype != jnp.bool_:
        raise TypeError(_GRADS_FINITE_NOT_BOOL.format(describe(grads_finite)))
    if grads_finite.shape != ():
        raise ValueError(_GRADS_FINITE_NOT_BOOL.format(describe(grads_finite)))
    return jnp.asarray(grads_finite)


#
# Loss scales.
#


class AbstractLossScale(eqx.Module):
    """Base class of loss scales: `NoOpLossScale`, `StaticLossScale` and
    `DynamicLossScale`.

    A loss scale is an immutable pytree. `scale` multiplies the loss (or any pytree)
    by `loss_scale`, `unscale` divides gradients by it, and `adjust` returns the scale
    to use for the next step, given whether this step's gradients were finite.

    Subclass it to write your own scale: give it a `loss_scale` (a float32 scalar
    array) and implement `scale`, `unscale` and `adjust`. Everything in `eqx_amp`
    that accepts a loss scale accepts any `AbstractLossScale`.
    """

    loss_scale: AbstractVar[Float[Array, ""]]

    @property
    def is_fixed(self) -> bool:
        """Whether `adjust` always returns the same scale. Retrying a step
        (`redo_on_nan`) with a fixed scale would fail the same way, so it is not
        retried. `False` unless a subclass says otherwise."""
        return False

    @abc.abstractmethod
    def scale(self, tree: PyTree) -> PyTree:
        """Multiplies the floating and complex arrays of `tree` by the loss scale.

        **Arguments:**

        - `tree`: any pytree, usually the loss. Integer, boolean and PRNG-key arrays,
            Python scalars and non-array leaves are returned unchanged.

        **Returns:**

        A pytree of the same structure and dtypes.
        """

    @abc.abstractmethod
    def unscale(self, tree: PyTree) -> PyTree:
        """Divides the floating and complex arrays of `tree` by the loss scale
        (everything `eqx.filter_grad` differentiates).

        **Arguments:**

        - `tree`: any pytree, usually gradients. Integer, boolean and PRNG-key
            arrays, Python scalars, `None` and non-array leaves are returned
            unchanged.

        **Returns:**

        A pytree of the same structure. Floating arrays narrower than float32
        (bfloat16, float16, float8) are unscaled in float32 and returned as float32,
        so unscaling never rounds a gradient to half precision; wider ones (and
        complex ones) keep their dtype.
        """

    @abc.abstractmethod
    def adjust(self, grads_finite: Bool[ArrayLike, ""]) -> "AbstractLossScale":
        """The loss scale for the next step.

        **Arguments:**

        - `grads_finite`: a boolean scalar, usually `eqx_amp.all_finite(grads)`.

        **Returns:**

        A new loss scale of the same type. The scale it is called on is unchanged.
        """


class _AbstractFixedLossScale(AbstractLossScale):
    """A loss scale that `adjust` never changes."""

    @property
    def is_fixed(self) -> bool:
        return True

    def adjust(self, grads_finite: Bool[ArrayLike, ""]) -> "_AbstractFixedLossScale":
        _check_grads_finite(grads_finite)
        return self


class NoOpLossScale(_AbstractFixedLossScale):
    """A loss scale that does not scale: `loss_scale` is 1, and `adjust` returns the
    same scale. Use it to switch loss scaling off (for bfloat16 or float32 training)
    without changing the training loop.

    `unscale` still returns half-precision leaves as float32, like the other scales,
    so the dtypes of gradients do not depend on the kind of scale.

    **Example:**

    ```python
    loss_scale = eqx_amp.NoOpLossScale()
    loss_scale.scale(jnp.float32(3.0))  # Array(3., dtype=float32)
    ```
    """

    # A property may implement an `AbstractVar` (Equinox allows it; the checker
    # compares it with the annotation as a field).
    @property
    def loss_scale(self) -> Float[Array, ""]:  # pyright: ignore[reportIncompatibleVariableOverride]
        return jnp.ones((), jnp.float32)

    def scale(self, tree: PyTree) -> PyTree:
        return tree

    def unscale(self, tree: PyTree) -> PyTree:
        return _unscale_tree(tree, None)


class StaticLossScale(_AbstractFixedLossScale):
    """A loss scale that stays the same: the loss is multiplied by `loss_scale` and
    the gradients are divided by it at every step, and `adjust` returns the same
    scale.

    **Arguments:**

    - `loss_scale`: a positive, finite number or scalar array, stored as a float32
        scalar array. Powers of two make scaling and unscaling exact.

    **Example:**

    ```python
    loss_scale = eqx_amp.StaticLossScale(2.0**10)
    loss_scale.scale(jnp.float32(3.0))  # Array(3072., dtype=float32)
    loss_scale.unscale(jnp.float16(3072.0))  # Array(3., dtype=float32)
    ```
    """

    loss_scale: Float[Array, ""] = eqx.field(converter=_as_loss_scale)

    def __check_init__(self):
        _check_positive_finite(self.loss_scale, "loss_scale")

    def scale(self, tree: PyTree) -> PyTree:
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree: PyTree) -> PyTree:
        return _unscale_tree(tree, self.loss_scale)


class DynamicLossScale(AbstractLossScale):
    """A loss scale that adapts to the gradients, as in `jmp.DynamicLossScale`.

    On a step with finite gradients the counter goes up; after `period` finite steps
    in a row the scale is multiplied by `factor` (only if the result is finite) and
    the counter resets. On a step with non-finite gradients the scale is divided by
    `factor`, never below `min_loss_scale`, and the counter resets. `adjust` is
    branch-free (`jnp.where`), so it runs inside `jit`, `lax.scan` and
    `lax.while_loop`.

    Every field is kept by `jit` and by `eqx.tree_serialise_leaves` (`loss_scale`,
    `counter` and `min_loss_scale` are scalar arrays; `period` and `factor` are
    static, part of the pytree structure).

    **Arguments:**

    - `loss_scale`: the initial scale, a positive finite number, stored as a float32
        scalar array. Default `2**15`.
    - `counter`: finite steps in a row since the scale last changed, stored as an
        int32 scalar array. Default 0.
    - `period`: how many finite steps in a row make the scale grow; a Python int,
        at least 1. Default 2000.
    - `factor`: what the scale is multiplied by to grow and divided by to back off;
        a Python int or float greater than 1 in float32 (where the scale is
        multiplied by it). Default 2.
    - `min_loss_scale`: the scale never goes below this; a positive finite number,
        stored as a float32 scalar array. Default 1.

    **Example:**

    ```python
    loss_scale = eqx_amp.DynamicLossScale(2.0**15, period=2000)
    grads = loss_scale.unscale(scaled_grads)
    grads_finite = eqx_amp.all_finite(grads)
    loss_scale = loss_scale.adjust(grads_finite)  # halved if grads had inf/nan
    ```
    """

    loss_scale: Float[Array, ""] = eqx.field(default=2.0**15, converter=_as_loss_scale)
    counter: Int[Array, ""] = eqx.field(default=0, converter=_as_counter)
    period: int = eqx.field(default=2000, static=True, converter=_as_period)
    factor: int | float = eqx.field(default=2, static=True, converter=_as_factor)
    min_loss_scale: Float[Array, ""] = eqx.field(
        default=1.0, converter=_as_min_loss_scale
    )

    def __check_init__(self):
        _check_positive_finite(self.loss_scale, "loss_scale")
        _check_positive_finite(self.min_loss_scale, "min_loss_scale")
        scale = _concrete(self.loss_scale)
        minimum = _concrete(self.min_loss_scale)
        if scale is not None and minimum is not None and scale < minimum:
            raise ValueError(
                f"`loss_scale` ({scale}) must be at least `min_loss_scale` ({minimum})."
            )
        counter = _concrete(self.counter)
        if counter is not None and not 0 <= counter < self.period:
            raise ValueError(
                f"`counter` must be in [0, period) = [0, {self.period}), but got "
                f"{int(counter)}."
            )

    def scale(self, tree: PyTree) -> PyTree:
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree: PyTree) -> PyTree:
        return _unscale_tree(tree, self.loss_scale)

    def adjust(self, grads_finite: Bool[ArrayLike, ""]) -> "DynamicLossScale":
        grads_finite = _check_grads_finite(grads_finite)
        at_period = self.counter == self.period - 1
        grown = self.loss_scale * self.factor
        grown = jnp.where(at_period & jnp.isfinite(grown), grown, self.loss_scale)
        backed_off = jnp.maximum(self.min_loss_scale, self.loss_scale / self.factor)
        loss_scale = jnp.where(grads_finite, grown, backed_off)
        counter = jnp.where(grads_finite, (self.counter + 1) % self.period, 0)
        # `tree_at`, not the constructor: the new values are not validated again (and
        # not pulled to the host when not under `jit`).
        return eqx.tree_at(
            lambda s: (s.loss_scale, s.counter), self, (loss_scale, counter)
        )
