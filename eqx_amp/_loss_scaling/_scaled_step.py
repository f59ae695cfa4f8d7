"""The one scaled-gradient core every gradient function runs (`scaled_step`):
scale, differentiate, unscale, check finiteness (agreed across devices), adjust
the scale, and redo with a lower scale inside one `lax.while_loop`."""

import abc
import functools as ft
import operator
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Bool, PyTree

from .._core._axes import check_axis_name, unbound_axis_name_error
from .._core._cast import at_least_float32, is_inexact_array
from .._core._describe import describe
from .._core._loss_scale_in_effect import loss_scaled_by
from .._jaxpr import _compat as compat
from .._sharding import recording_gathers
from ._scales import AbstractLossScale
from ._skipping import all_finite


_NO_POSITIONAL = (
    "Functions wrapped with `eqx_amp.filter_value_and_grad` or `eqx_amp.filter_grad` "
    "must have their first argument passed by position: it is the argument that is "
    "differentiated."
)
_HAS_AUX_NOT_PAIR = (
    "`fun` was wrapped with `has_aux=True`, so it must return a pair "
    "`(loss, aux)`, but it returned {}."
)
_LOSS_NOT_ARRAY = (
    "The output of `fun` must be a scalar loss (a floating array of shape ()), but "
    "`fun` returned {}.{}"
)
_HINT_HAS_AUX = " If `fun` returns `(loss, aux)`, pass `has_aux=True`."


class GradThrough(eqx.Module):
    """A first argument differentiated through a part of itself: a `BiModel` is
    differentiated through its compute copy (the half-precision gradients are the
    memory saving), and its gradients have the structure of that part."""

    @abc.abstractmethod
    def grad_target(self) -> tuple[PyTree, Callable[[PyTree], Any]]:
        """`(target, rebuild)`: the tree to differentiate, and a function that
        rebuilds this argument from a stand-in for it (a tracer, under `grad`)."""


class ScaledOptions(NamedTuple):
    """The options every scaled-gradient function takes, checked."""

    has_aux: bool
    redo_on_nan: int
    axis_name: Hashable | None
    average: bool


def scaled_options(
    has_aux: Any, redo_on_nan: Any, axis_name: Any, average: Any
) -> ScaledOptions:
    redo_on_nan = _check_options(has_aux, redo_on_nan, axis_name, average)
    return ScaledOptions(bool(has_aux), redo_on_nan, axis_name, bool(average))


#
# Checking what `fun` returns.
#


def _split_output(out: Any, has_aux: bool) -> tuple[Array, Any]:
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(_HAS_AUX_NOT_PAIR.format(describe(out))) from None
        loss, aux = out
    else:
        loss, aux = out, None
    if isinstance(loss, bool) or not isinstance(
        loss, jax.Array | np.ndarray | np.generic | float | int
    ):
        hint = _HINT_HAS_AUX if isinstance(loss, tuple) and not has_aux else ""
        raise TypeError(_LOSS_NOT_ARRAY.format(describe(loss), hint)) from None
    loss = jnp.asarray(loss)
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(
            "The output of `fun` must be a floating scalar loss, but `fun` returned "
            f"an array of dtype {loss.dtype}."
        ) from None
    if loss.shape != ():
        raise ValueError(
            "The output of `fun` must be a scalar loss (shape ()), but `fun` returned "
            f"an array of shape {tuple(loss.shape)}. Reduce it first, for example "
            "with `jnp.mean`."
        ) from None
    return loss, aux


#
# One forward and backward pass.
#


def _value_and_scaled_grad(
    fun: Callable,
    has_aux: bool,
    axis_name: Hashable | None,
    average: bool,
    x: PyTree,
    args: tuple,
    kwargs: dict,
    loss_scale: AbstractLossScale,
) -> tuple[Array, Any, PyTree, Bool[Array, ""]]:
    """Differentiates `loss_scale.scale(fun(x, ...))` with respect to `x`, and
    unscales the gradients with that same scale."""

    def scaled_loss(x, loss_scale):
        factor = loss_scale.scale(jnp.ones((), jnp.float32))
        with loss_scaled_by(jax.lax.stop_gradient(factor.astype(jnp.float32))):
            loss, aux = _split_output(fun(x, *args, **kwargs), has_aux)
        # Scale in (at least) float32: a float16 loss times 2**16 would overflow.
        loss = loss.astype(at_least_float32(loss.dtype))
        return loss_scale.scale(loss), (loss, aux)

    with recording_gathers() as gathered:
        (_, (value, aux)), grads = eqx.filter_value_and_grad(scaled_loss, has_aux=True)(
            x, loss_scale
        )
    grads = loss_scale.unscale(grads)
    if axis_name is not None and average:
        _check_replicated(x, axis_name)
        if axis_name in gathered:
            raise ValueError(_AVERAGING_GATHERED.format(axis=axis_name))
        with unbound_axis_name_error(axis_name):
            grads = jax.lax.pmean(grads, axis_name)
            value = jax.lax.pmean(value, axis_name)
    grads_finite = all_finite(grads, axis_name=axis_name)
    return value, aux, grads, grads_finite


_AVERAGING_SHARDS = (
    "`axis_name={axis!r}` averages the gradients over {axis!r}, as for parameters "
    "every device holds whole, but `{path}` varies over {axis!r} (a shard, or a "
    "stacked copy: its `in_specs` name the axis). The fix depends on what each "
    "device holds:\n"
    "- a whole copy per device (a stack of copies split with `P({axis!r})`, as for "
    "`jax.pmap`): pass one copy, replicated, `in_specs=P()`, and "
    "return the global mean loss, `jax.lax.pmean(loss, {axis!r})`; JAX then sums "
    "their gradients over {axis!r} and they arrive identical on every device "
    "(`average=False` here would leave every device with its own, un-averaged "
    "gradients);\n"
    "- a shard of a parameter (FSDP, gathered with `eqx_amp.sharding.gather_params`): pass "
    "`average=False`; the check for finiteness is still agreed across {axis!r}, "
    "and the transpose of the gather already sums the gradients into their shards "
    "(in the policy's `reduce_dtype`)."
)

_AVERAGING_GATHERED = (
    "`axis_name={axis!r}` averages the gradients over {axis!r}, as for parameters "
    "every device holds whole, but the loss gathers parameters sharded over "
    "{axis!r} with `eqx_amp.sharding.gather_params`: their gradients are already reduced "
    "into their shards, and averaging would mix the gradients of different "
    "parameters. Pass `average=False`; the check for finiteness is still agreed "
    "across {axis!r}."
)


def _check_replicated(x: PyTree, axis_name: Hashable) -> None:
    """Refuses to average the gradients of parameters `jax.shard_map` types as
    differing per device: those are shards, not replicas."""
    for path, leaf in jtu.tree_flatten_with_path(x)[0]:
        if is_inexact_array(leaf) and axis_name in compat.varying_axes(leaf):
            raise ValueError(
                _AVERAGING_SHARDS.format(axis=axis_name, path=jtu.keystr(path))
            )


def _placeholder(struct: jax.ShapeDtypeStruct) -> Array:
    return jnp.zeros(struct.shape, struct.dtype)


def _is_struct(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _redo_until_finite(attempt: Callable, loss_scale: AbstractLossScale, redo: int):
    """Runs `attempt` with `loss_scale`, and while its gradients are not finite (at
    most `redo` more times) with the adjusted scale, inside one `lax.while_loop`, so
    that the forward and backward passes are compiled once. The user's loss is
    traced once: the loop body evaluates the traced program."""
    attempt = eqx.filter_closure_convert(attempt, loss_scale)
    # Typed as a plain callable, what `filter_closure_convert` returns is a module
    # that also holds the structure of its output.
    out_struct = cast(Any, attempt).out_struct
    out_dynamic_struct, out_static = eqx.partition(out_struct, _is_struct)
    dynamic_spec = jtu.tree_map(_is_struct, out_struct)
    scale_dynamic, scale_static = eqx.partition(loss_scale, eqx.is_array)

    def cond(carry):
        tries, _, _, _, grads_finite, scale_moved = carry
        # A retry at a scale `adjust` did not change (one at its floor) would fail
        # the same way.
        return (tries <= redo) & jnp.logical_not(grads_finite) & scale_moved

    def body(carry):
        tries, scale_dynamic, _, _, _, _ = carry
        scale = eqx.combine(scale_dynamic, scale_static)
        out = attempt(scale)
        grads_finite = out[-1]
        new_scale = scale.adjust(grads_finite)
        new_scale_dynamic, _ = eqx.partition(new_scale, eqx.is_array)
        # Split as the traced output was, not by what the leaves are now: an
        # output that is a constant (the finite flag of gradients with no arrays,
        # a loss that reads no weight) comes out of the jaxpr as a NumPy scalar,
        # which `eqx.is_array` does not count, and the carry would lose it.
        out_dynamic = jtu.tree_map(
            lambda struct, x: jnp.asarray(x, struct.dtype),
            out_dynamic_struct,
            eqx.filter(out, dynamic_spec),
        )
        scale_moved = new_scale.loss_scale != scale.loss_scale
        return (
            tries + 1,
            new_scale_dynamic,
            scale_dynamic,
            out_dynamic,
            grads_finite,
            scale_moved,
        )

    init = (
        jnp.zeros((), jnp.int32),
        scale_dynamic,
        scale_dynamic,
        jtu.tree_map(_placeholder, out_dynamic_struct),
        jnp.asarray(False),
        jnp.asarray(True),
    )
    _, new_dynamic, used_dynamic, out_dynamic, _, _ = jax.lax.while_loop(
        cond, body, init
    )
    out = eqx.combine(out_dynamic, out_static)
    used = eqx.combine(used_dynamic, scale_static)
    return out, eqx.combine(new_dynamic, scale_static), used


def scaled_step(
    fun: Callable,
    options: ScaledOptions,
    args: tuple,
    kwargs: dict,
    loss_scale: AbstractLossScale,
) -> "ScaledStep":
    """The one scaled differentiation every gradient function runs: the value,
    unscaled gradients, whether they are finite, the scale that produced them and
    that scale adjusted (after at most `redo_on_nan` retries)."""
    if not isinstance(loss_scale, AbstractLossScale):
        raise TypeError(
            "`loss_scale` must be an `eqx_amp.AbstractLossScale` (such as "
            f"`eqx_amp.DynamicLossScale()`), but got {type(loss_scale).__name__}."
        )
    if len(args) == 0:
        raise TypeError(_NO_POSITIONAL)
    x, *rest = args
    # A `BiModel`, alone or anywhere in a container (`(bimodel, scaling)`), is
    # differentiated through its compute copy.
    parts, treedef = jtu.tree_flatten(x, is_leaf=_is_grad_through)
    if any(_is_grad_through(part) for part in parts):
        targets = [_grad_target(part) for part in parts]
        x = jtu.tree_unflatten(treedef, [target for target, _ in targets])
        rebuilds = tuple(rebuild for _, rebuild in targets)
        fun = _Rebuilding(fun, _RebuildEach(treedef, rebuilds))
    attempt = ft.partial(
        _value_and_scaled_grad,
        fun,
        options.has_aux,
        options.axis_name,
        options.average,
        x,
        tuple(rest),
        kwargs,
    )
    # Recomputing with a scale that `adjust` does not change would give the same
    # non-finite gradients again.
    if options.redo_on_nan == 0 or loss_scale.is_fixed:
        value, aux, grads, grads_finite = attempt(loss_scale)
        new_loss_scale = loss_scale.adjust(grads_finite)
        used_loss_scale = loss_scale
    else:
        (value, aux, grads, grads_finite), new_loss_scale, used_loss_scale = (
            _redo_until_finite(attempt, loss_scale, options.redo_on_nan)
        )
    if options.has_aux:
        value = (value, aux)
    return ScaledStep(value, grads, grads_finite, used_loss_scale, new_loss_scale)


def _is_grad_through(node: Any) -> bool:
    return isinstance(node, GradThrough)


def _grad_target(part: Any) -> tuple[PyTree, Callable[[PyTree], Any]]:
    if isinstance(part, GradThrough):
        return part.grad_target()
    return part, _unchanged


def _unchanged(part: Any) -> Any:
    return part


class _RebuildEach(eqx.Module):
    """Rebuilds a first argument holding `GradThrough`s (`treedef`, with them as
    leaves) from its differentiated parts, each by its own `rebuild`."""

    treedef: Any = eqx.field(static=True)
    rebuilds: tuple[Callable, ...]

    def __call__(self, targets: PyTree) -> PyTree:
        parts = self.treedef.flatten_up_to(targets)
        rebuilt = [rebuild(part) for rebuild, part in zip(self.rebuilds, parts)]
        return jtu.tree_unflatten(self.treedef, rebuilt)


class _Rebuilding(eqx.Module):
    """`fun` of the argument `rebuild` makes from the differentiated part."""

    fun: Callable
    rebuild: Callable

    def __call__(self, target, *args, **kwargs):
        return self.fun(self.rebuild(target), *args, **kwargs)


class ScaledStep(NamedTuple):
    """What one scaled differentiation gives: the value, unscaled gradients, whether
    they are finite, the scale that produced them, and that scale adjusted."""

    value: Any
    grads: PyTree
    grads_finite: Bool[Array, ""]
    used_loss_scale: AbstractLossScale
    new_loss_scale: AbstractLossScale

    def grads_and_aux(self, options: ScaledOptions) -> Any:
        """What a grad-only function returns: `grads`, or `(grads, aux)`."""
        return (self.grads, self.value[1]) if options.has_aux else self.grads


def check_decorated(fun: Any, transform: str) -> None:
    if not callable(fun):
        raise TypeError(
            f"`fun` must be callable, but got {type(fun).__name__}. Use "
            f"`{transform}(fun, ...)` or `@{transform}(has_aux=...)`."
        )


_MAX_REDO = 2**31 - 2  # the retry counter, an int32, reaches `redo_on_nan + 1`


def _check_options(
    has_aux: Any, redo_on_nan: Any, axis_name: Any, average: Any = True
) -> int:
    if not isinstance(has_aux, bool | np.bool_):
        raise TypeError(f"`has_aux` must be a bool, but got {has_aux!r}.")
    if not isinstance(average, bool | np.bool_):
        raise TypeError(f"`average` must be a bool, but got {average!r}.")
    if isinstance(redo_on_nan, bool | np.bool_):
        raise TypeError("`redo_on_nan` must be a Python int, not a bool.")
    try:
        redo_on_nan = operator.index(redo_on_nan)
    except TypeError:
        raise TypeError(
            "`redo_on_nan` must be a Python int (how many times to recompute the "
            f"gradients when they are not finite), but got {redo_on_nan!r}."
        ) from None
    if redo_on_nan < 0:
        raise ValueError(
            "`redo_on_nan` must be 0 or more (how many times to recompute the "
            f"gradients with a lower loss scale when they are not finite), but got "
            f"{redo_on_nan}."
        )
    if redo_on_nan > _MAX_REDO:
        raise ValueError(
            f"`redo_on_nan` must be at most {_MAX_REDO} (the retries are counted in "
            f"int32), but got {redo_on_nan}."
        )
    check_axis_name(axis_name)
    return redo_on_nan
