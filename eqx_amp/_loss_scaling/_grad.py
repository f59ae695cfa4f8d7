"""Gradients with loss scaling: `filter_value_and_grad` and `filter_grad`."""

import functools as ft
import inspect
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, overload

import equinox as eqx
from jaxtyping import Array, Bool, Float, PyTree

from .._core._wrapper import FunctionWrapper
from ._scaled_step import ScaledOptions, check_decorated, scaled_options, scaled_step
from ._scales import AbstractLossScale


_sentinel: Any = object()


_MISSING_LOSS_SCALE = (
    "Functions wrapped with `eqx_amp.filter_value_and_grad` or `eqx_amp.filter_grad` "
    "must be called with a `loss_scale` keyword argument, such as "
    "`grad_fn(model, x, y, loss_scale=eqx_amp.DynamicLossScale())`. Use "
    "`eqx_amp.NoOpLossScale()` to differentiate without scaling."
)


#
# The wrappers.
#


class _ScaledValueAndGradWrapper(FunctionWrapper):
    fn: Callable
    options: ScaledOptions = eqx.field(static=True)

    @property
    def __signature__(self) -> inspect.Signature:
        return _signature_with_loss_scale(self.fn)

    def __call__(self, /, *args, loss_scale: AbstractLossScale = _sentinel, **kwargs):
        if loss_scale is _sentinel:
            raise TypeError(_MISSING_LOSS_SCALE)
        step = scaled_step(self.fn, self.options, args, kwargs, loss_scale)
        return (step.value, step.grads), step.new_loss_scale, step.grads_finite


class _ScaledGradWrapper(FunctionWrapper):
    fn: Callable
    options: ScaledOptions = eqx.field(static=True)

    @property
    def __signature__(self) -> inspect.Signature:
        return _signature_with_loss_scale(self.fn)

    def __call__(self, /, *args, loss_scale: AbstractLossScale = _sentinel, **kwargs):
        if loss_scale is _sentinel:
            raise TypeError(_MISSING_LOSS_SCALE)
        step = scaled_step(self.fn, self.options, args, kwargs, loss_scale)
        return step.grads_and_aux(self.options), step.new_loss_scale, step.grads_finite


def _signature_with_loss_scale(fun: Callable) -> inspect.Signature:
    """`fun`'s signature with a keyword-only `loss_scale` added, so that
    `eqx.filter_jit` (which binds arguments to the signature) accepts it."""
    loss_scale = inspect.Parameter("loss_scale", inspect.Parameter.KEYWORD_ONLY)
    try:
        signature = inspect.signature(fun)
    except (TypeError, ValueError):
        return inspect.Signature(
            [
                inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
                loss_scale,
                inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
            ]
        )
    params = [p for p in signature.parameters.values() if p.name != "loss_scale"]
    var_keyword = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
    params = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    return signature.replace(parameters=[*params, loss_scale, *var_keyword])


# The gradients: the differentiated argument's structure, float arrays or `None`.
# Type checkers read jaxtyping's `PyTree` as unknown, so they are told `Any`.
if TYPE_CHECKING:
    Grads: TypeAlias = Any
else:
    Grads = PyTree[Float[Array, "..."] | None]


@overload
def filter_value_and_grad(
    *,
    has_aux: Literal[False] = False,
    redo_on_nan: int = 0,
    axis_name: Hashable | None = None,
    average: bool = True,
) -> Callable[
    [Callable[..., Float[Array, ""]]],
    Callable[
        ..., tuple[tuple[Float[Array, ""], Grads], AbstractLossScale, Bool[Array, ""]]
    ],
]: ...


@overload
def filter_value_and_grad(
    *,
    has_aux: Literal[True],
    redo_on_nan: int = 0,
    axis_name: Hashable | None = None,
    average: bool = True,
) -> Callable[
    [Callable[..., tuple[Float[Array, ""], Any]]],
    Callable[
        ...,
        tuple[
            tuple[tuple[Float[Array, ""], Any], Grads],
            AbstractLossScale,
            Bool[Array, ""],
        ],
    ],
]: ...


@overload
def filter_value_and_grad(
    fun: Callable[..., Float[Array, ""]],
    *,
    has_aux: Literal[False] = False,
    redo_on_nan: int = 0,
    axis_name: Hashable | None = None,
    average: bool = True,
) -> Callable[
    ..., tuple[tuple[Float[Array, ""], Grads], AbstractLossScale, Bool[Array, ""]]
]: ...


@overload
def filter_value_and_grad(
    fun: Callable[..., tuple[Float[Array, ""], Any]],
    *,
    has_aux: Literal[True],
    redo_on_nan: int = 0,
    axis_name: Hashable | None = None,
    average: bool = True,
) -> Callable[
    ...,
    tuple[
        tuple[tuple[Float[Array, ""], Any], Grads], AbstractLossScale, Bool[Array, ""]
    ],
]: ...


@overload  # `has_aux` known only as a bool
def filter_value_and_grad(
    fun: Callable = ...,
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    axis_name: Hashable | None = None,
    average: bool = True,
) -> Callable: ...


def filter_value_and_grad(
    fun: Callable = _sentinel,
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    axis_name: Hashable | None = None,
    average: bool = True,
) -> Callable:
    """Like `eqx.filter_value_and_grad`, with loss scaling.

    The returned function is called as `g(*args, loss_scale=ls, **kwargs)`. It
    differentiates `ls.scale(fun(*args, **kwargs))` with respect to every floating
    array of the first argument (non-floating leaves get `None`), unscales the
    gradients with `ls` (the scale that produced them), checks that they are finite,
    and only then adjusts the scale.

    **Arguments:**

    - `fun`: the function to differentiate. It returns a floating scalar loss, or a
        pair `(loss, aux)` with `has_aux=True`.
    - `has_aux`: whether `fun` returns auxiliary data alongside the loss.
    - `redo_on_nan`: when the gradients are not finite, adjust the scale (for a
        `DynamicLossScale`, divide it by its `factor`) and recompute them, at most
        this many more times. The tries run inside one `lax.while_loop`, so the
        forward and backward passes are compiled once. `0` (the default) computes
        once and leaves skipping the step to the caller. Recomputing at a scale
        that `adjust` left unchanged (a `NoOpLossScale`, a `StaticLossScale`, a
        `DynamicLossScale` at its `min_loss_scale`) would give the same result, so
        it stops there.
    - `axis_name`: the name of a mapped axis (of `jax.shard_map`, `jax.pmap` or a
        named `jax.vmap`). The finiteness check is agreed across it, so every device
        takes (or skips) the step and adjusts the scale identically; and with
        `average=True` the gradients and the loss are first averaged over it with
        `lax.pmean` (data parallelism: every device holds the whole parameters).
    - `average`: whether `axis_name` also averages the gradients and the loss.
        `False` for gradients that are already reduced: parameters sharded over
        the axis (FSDP under `jax.shard_map`, with `eqx_amp.sharding.gather_params`, whose
        transpose sums each gradient into its shard). Averaging gradients that
        `jax.shard_map` types as varying over the axis, shards, is refused with a
        `ValueError`: it would mix different parameters' gradients.

    !!! info "Gradients under `jax.shard_map`"

        With `check_vma=True` (the default), JAX already *sums* the gradients of
        parameters replicated over the axis (`in_specs=P()`): the backward pass of
        the implicit broadcast of a replicated value is a `psum`. They arrive
        identical on every device, and `lax.pmean` leaves them as they are: the
        gradient of the *sum* of the per-device losses. To get the gradient of the
        mean, return the global mean loss from `fun`,
        `jax.lax.pmean(local_loss, axis_name)`, (or divide the local loss by
        `jax.lax.axis_size(axis_name)`). That recipe also gives the mean with
        `check_vma=False` and with `jax.pmap`, where gradients are per-device and
        `axis_name` averages them.

    **Returns:**

    A function `g(*args, loss_scale, **kwargs)` returning
    `((value, grads), new_loss_scale, grads_finite)`:

    - `value`: the unscaled loss, in float32 (or wider, if `fun` returns float64);
        `(loss, aux)` with `has_aux=True`.
    - `grads`: the unscaled gradients, with the structure of the first argument
        (a `BiModel` is differentiated through its compute copy, also as a part of
        a tuple first argument such as `(bimodel, fp8_scaling)`). Gradients of
        half-precision leaves are unscaled in float32 and returned in float32, so
        unscaling never rounds them to half precision.
    - `new_loss_scale`: `ls.adjust(grads_finite)`, the scale for the next step.
    - `grads_finite`: a boolean scalar, whether every gradient is finite. Skipping
        the step when it is `False` is the caller's choice: use
        `eqx_amp.select_tree` or `optax.apply_if_finite`.

    `g` is an `eqx.Module`: it works under `eqx.filter_jit` and as a method.

    **Example:**

    ```python
    @eqx_amp.filter_value_and_grad
    def loss_fn(model, x, y):
        pred = jax.vmap(eqx_amp.filter_amp(model, policy="mixed_float16"))(x)
        return jnp.mean((pred - y) ** 2)

    @eqx.filter_jit
    def step(model, opt_state, loss_scale, x, y):
        (loss, grads), loss_scale, grads_finite = loss_fn(
            model, x, y, loss_scale=loss_scale
        )
        updates, new_opt_state = optim.update(grads, opt_state, model)
        new_model = eqx.apply_updates(model, updates)
        model, opt_state = eqx_amp.select_tree(
            grads_finite, (new_model, new_opt_state), (model, opt_state)
        )
        return model, opt_state, loss_scale, loss
    ```
    """
    options = scaled_options(has_aux, redo_on_nan, axis_name, average)
    if fun is _sentinel:
        return ft.partial(filter_value_and_grad, **options._asdict())
    check_decorated(fun, "filter_value_and_grad")
    return eqx.module_update_wrapper(_ScaledValueAndGradWrapper(fun, options))


@overload
def filter_grad(
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    axis_name: Hashable | None = None,
    average: bool = True,
) -> Callable[[Callable], Callable]: ...


@overload
def filter_grad(
    fun: Callable[..., Float[Array, ""]],
    *,
    has_aux: Literal[False] = False,
    redo_on_nan: int = 0,
    axis_name: Hashable | None = None,
    average: bool = True,
) -> Callable[..., tuple[Grads, AbstractLossScale, Bool[Array, ""]]]: ...


@overload
def filter_grad(
    fun: Callable[..., tuple[Float[Array, ""], Any]],
    *,
    has_aux: Literal[True],
    redo_on_nan: int = 0,
    axis_name: Hashable | None = None,
    average: bool = True,
) -> Callable[..., tuple[tuple[Grads, Any], AbstractLossScale, Bool[Array, ""]]]: ...


def filter_grad(
    fun: Callable = _sentinel,
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    axis_name: Hashable | None = None,
    average: bool = True,
) -> Callable:
    """Like `eqx.filter_grad`, with loss scaling: `eqx_amp.filter_value_and_grad`
    without the value.

    **Arguments:**

    The same as `eqx_amp.filter_value_and_grad`.

    **Returns:**

    A function `g(*args, loss_scale, **kwargs)` returning
    `(grads, new_loss_scale, grads_finite)`, or
    `((grads, aux), new_loss_scale, grads_finite)` with `has_aux=True`. `grads` are
    unscaled, in float32 for every half-precision leaf.

    **Example:**

    ```python
    grad_fn = eqx_amp.filter_grad(loss_fn, redo_on_nan=2)
    grads, loss_scale, grads_finite = grad_fn(model, x, y, loss_scale=loss_scale)
    ```
    """
    options = scaled_options(has_aux, redo_on_nan, axis_name, average)
    if fun is _sentinel:
        return ft.partial(filter_grad, **options._asdict())
    check_decorated(fun, "filter_grad")
    return eqx.module_update_wrapper(_ScaledGradWrapper(fun, options))
