"""Loss scaling kept in the optimizer state: a float16 training loop three lines away
from a float32 one, as with Keras' `LossScaleOptimizer`."""

import functools as ft
import inspect
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, Protocol, TypeVar, cast, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jaxtyping import Array, Bool, Int, PyTree

from .._core._axes import check_axis_name
from .._core._wrapper import FunctionWrapper
from .._optim._transforms import check_optimizer
from ._grad import Grads
from ._scaled_step import ScaledOptions, check_decorated, scaled_options, scaled_step
from ._scales import AbstractLossScale, DynamicLossScale
from ._skipping import all_finite, cond_or_select


class LossScalingState(NamedTuple):
    """The state of `eqx_amp.loss_scaling(optimizer)`.

    **Fields:**

    - `inner_state`: the wrapped optimizer's state. It does not change on a skipped
        step, so neither do its step counter and the learning-rate schedule.
    - `loss_scale`: the current loss scale (an `eqx_amp.AbstractLossScale`), which
        `eqx_amp.scaled_value_and_grad` reads.
    - `notfinite_count`: how many steps in a row had non-finite gradients (int32).
    - `total_notfinite`: how many steps so far had non-finite gradients (int32).
    - `last_finite`: whether the last step's gradients were finite.
    """

    inner_state: Any
    loss_scale: AbstractLossScale
    notfinite_count: Int[Array, ""]
    total_notfinite: Int[Array, ""]
    last_finite: Bool[Array, ""]


def loss_scaling(
    optimizer: optax.GradientTransformation,
    loss_scale: AbstractLossScale | None = None,
    *,
    axis_name: Hashable | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax optimizer so that it keeps the loss scale in its state and
    skips steps whose gradients are not finite.

    `update(grads, state, params)` checks the (unscaled) gradients: if they are all
    finite it runs the wrapped optimizer; if not it returns zero updates and leaves
    the wrapped optimizer's state as it was (its step count and schedules do not
    advance). Either way the loss scale is adjusted (`loss_scale.adjust`) and the
    counters are updated. Use it with `eqx_amp.scaled_value_and_grad`, which reads
    the scale from the state.

    **Arguments:**

    - `optimizer`: any optax `GradientTransformation` (or an object with `init`
        and `update`, such as `optax.MultiSteps`), chains and schedules included.
        `loss_scaling` goes outside any wrapper that skips non-finite steps
        (`loss_scaling(optax.apply_if_finite(optimizer, 5))`): around it, that
        wrapper would skip the steps without the scale backing off, which
        `scaled_value_and_grad` refuses.
    - `loss_scale`: the initial `eqx_amp.AbstractLossScale`; `None` means
        `eqx_amp.DynamicLossScale()` (2**15, doubling after 2000 finite steps).
    - `axis_name`: a mapped axis to agree on finiteness over, for gradients that
        differ per device (with `scaled_value_and_grad(..., axis_name=...)` they are
        already averaged).

    **Returns:**

    An `optax.GradientTransformationExtraArgs` whose state is a
    `LossScalingState`.

    **Example:**

    ```python
    optim = eqx_amp.loss_scaling(optax.adam(1e-3))
    opt_state = optim.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        grad_fn = eqx_amp.scaled_value_and_grad(loss_fn)
        (loss, grads), opt_state = grad_fn(model, x, y, opt_state=opt_state)
        updates, opt_state = optim.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss
    ```
    """
    check_optimizer(optimizer, "loss_scaling")
    if loss_scale is None:
        loss_scale = DynamicLossScale()
    if not isinstance(loss_scale, AbstractLossScale):
        raise TypeError(
            "`loss_scale` must be an `eqx_amp.AbstractLossScale` (such as "
            f"`eqx_amp.DynamicLossScale()`) or None, but got "
            f"{type(loss_scale).__name__}."
        )
    check_axis_name(axis_name)
    inner = optax.with_extra_args_support(optimizer)

    def init_fn(params):
        # Every leaf its own buffer, and none shared with `loss_scale` or with
        # another state: a training step that donates its optimizer state would
        # otherwise donate one buffer twice, or delete another state's.
        own_scale = jtu.tree_map(
            lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, loss_scale
        )
        return LossScalingState(
            inner.init(params),
            own_scale,
            jnp.zeros((), jnp.int32),
            jnp.zeros((), jnp.int32),
            jnp.asarray(True),
        )

    # The first argument is named as optax's protocol names it (callers may pass
    # `updates=`); here it holds the unscaled gradients.
    def update_fn(updates, state, params=None, **extra_args):
        if not isinstance(state, LossScalingState):
            raise TypeError(_NOT_OUR_STATE.format(type(state).__name__))
        grads = updates
        grads_finite = all_finite(grads, axis_name=axis_name)

        def apply(inner_state):
            return inner.update(grads, inner_state, params, **extra_args)

        def reject(inner_state):
            update_shapes, state_shapes = jax.eval_shape(apply, inner_state)
            zeros = jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), update_shapes)
            # The state as it was, in the dtypes a step would leave it in (an
            # optimizer may store what it was given in another dtype: moments
            # decoded to float32 from bfloat16, say), so both branches agree.
            kept = jtu.tree_map(_in_dtype_of, inner_state, state_shapes)
            return zeros, kept

        updates, inner_state = cond_or_select(
            grads_finite, apply, reject, state.inner_state
        )
        notfinite = jnp.logical_not(grads_finite).astype(jnp.int32)
        new_state = LossScalingState(
            inner_state=inner_state,
            loss_scale=state.loss_scale.adjust(grads_finite),
            notfinite_count=(state.notfinite_count + 1) * notfinite,
            total_notfinite=state.total_notfinite + notfinite,
            last_finite=grads_finite,
        )
        return updates, new_state

    # optax types a state as a nest of arrays (`OptState`); this one also holds the
    # loss scale, an `eqx.Module`.
    return optax.GradientTransformationExtraArgs(
        cast(optax.TransformInitFn, init_fn),
        cast(optax.TransformUpdateExtraArgsFn, update_fn),
    )


def _in_dtype_of(x: Any, shape: Any) -> Any:
    return x if x.dtype == shape.dtype else x.astype(shape.dtype)


_NOT_OUR_STATE = (
    "The state passed to the `update` of `eqx_amp.loss_scaling(...)` must be the "
    "`LossScalingState` its `init` made, but got {}."
)
_NO_STATE = (
    "`opt_state` holds no `eqx_amp.optim.LossScalingState`: wrap the optimizer with "
    "`eqx_amp.loss_scaling(optimizer)` and pass the state its `init` or `update` "
    "returned."
)
_SEVERAL_STATES = (
    "`opt_state` holds {} `eqx_amp.optim.LossScalingState`s; `scaled_value_and_grad` needs "
    "exactly one loss scale to read. Wrap only the outermost optimizer with "
    "`eqx_amp.loss_scaling`."
)


_SKIPPED_AROUND = (
    "`opt_state` holds the `LossScalingState` of `eqx_amp.loss_scaling` inside {}, "
    "which skips a step with non-finite gradients without calling the update of "
    "`loss_scaling`: the loss scale could not back off, and a scale that overflows "
    "would stay (for `max_consecutive_errors` steps, or for good). `loss_scaling` "
    "skips those steps itself, backing off at once: drop the outer wrapper, or put "
    "it inside, as in `eqx_amp.loss_scaling(optax.apply_if_finite(optimizer, 5))`."
)


def _is_state(node: Any) -> bool:
    return isinstance(node, LossScalingState)


def _skipping_wrapper(node: Any) -> str | None:
    """What an optax wrapper that skips non-finite steps is, by its state."""
    if isinstance(node, optax.ApplyIfFiniteState):
        return "an `optax.apply_if_finite`"
    if isinstance(node, optax.MultiStepsState) and jtu.tree_leaves(node.skip_state):
        return "an `optax.MultiSteps` with a `should_skip_update_fn`"
    return None


def _loss_scaling_state(opt_state: PyTree) -> LossScalingState:
    found = [s for s in jtu.tree_leaves(opt_state, is_leaf=_is_state) if _is_state(s)]
    if not found:
        raise ValueError(_NO_STATE)
    if len(found) > 1:
        raise ValueError(_SEVERAL_STATES.format(len(found)))
    for node in jtu.tree_leaves(
        opt_state, is_leaf=lambda n: _is_state(n) or _skipping_wrapper(n) is not None
    ):
        wrapper = _skipping_wrapper(node)
        if wrapper is not None and any(
            map(_is_state, jtu.tree_leaves(node, is_leaf=_is_state))
        ):
            raise ValueError(_SKIPPED_AROUND.format(wrapper))
    return found[0]


def _with_loss_scale(opt_state: PyTree, loss_scale: AbstractLossScale) -> PyTree:
    def replace(node):
        return node._replace(loss_scale=loss_scale) if _is_state(node) else node

    return jtu.tree_map(replace, opt_state, is_leaf=_is_state)


_missing: Any = object()


class _ShortForm(FunctionWrapper):
    """`scaled_value_and_grad(fn)` and `scaled_grad(fn)`: the one scaled-gradient
    core, with the loss scale read from (and written back to) `opt_state`."""

    fn: Callable
    options: ScaledOptions = eqx.field(static=True)
    value_too: bool = eqx.field(static=True)

    @property
    def __signature__(self) -> inspect.Signature:
        return _signature_with_opt_state(self.fn)

    def __call__(self, /, *args, opt_state: PyTree = _missing, **kwargs):
        if opt_state is _missing:
            raise TypeError(_MISSING_OPT_STATE)
        loss_scale = _loss_scaling_state(opt_state).loss_scale
        step = scaled_step(self.fn, self.options, args, kwargs, loss_scale)
        # The scale that gave these gradients: `update` adjusts it by their finiteness.
        new_state = _with_loss_scale(opt_state, step.used_loss_scale)
        if self.value_too:
            return (step.value, step.grads), new_state
        return step.grads_and_aux(self.options), new_state


_MISSING_OPT_STATE = (
    "Functions wrapped with `eqx_amp.scaled_value_and_grad` or `eqx_amp.scaled_grad` "
    "must be called with an `opt_state` keyword argument, the state of an optimizer "
    "wrapped by `eqx_amp.loss_scaling`: `loss_fn(model, x, y, opt_state=opt_state)`."
)


def _signature_with_opt_state(fun: Callable) -> inspect.Signature:
    """`fun`'s signature with a keyword-only `opt_state` added, so that
    `eqx.filter_jit` (which binds arguments to the signature) accepts it."""
    opt_state = inspect.Parameter("opt_state", inspect.Parameter.KEYWORD_ONLY)
    try:
        signature = inspect.signature(fun)
    except (TypeError, ValueError):
        return inspect.Signature(
            [
                inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
                opt_state,
                inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
            ]
        )
    params = [p for p in signature.parameters.values() if p.name != "opt_state"]
    var_keyword = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
    params = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    return signature.replace(parameters=[*params, opt_state, *var_keyword])


_S = TypeVar("_S")


class ScaledValueAndGradFn(Protocol):
    """What `scaled_value_and_grad` returns: the new optimizer state has the type of
    the one given."""

    def __call__(
        self, *args: Any, opt_state: _S, **kwargs: Any
    ) -> tuple[tuple[Any, Grads], _S]: ...


class ScaledGradFn(Protocol):
    """What `scaled_grad` returns."""

    def __call__(
        self, *args: Any, opt_state: _S, **kwargs: Any
    ) -> tuple[Grads, _S]: ...


@overload
def scaled_value_and_grad(
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    axis_name: Hashable | None = None,
    average: bool = True,
) -> Callable[[Callable], ScaledValueAndGradFn]: ...


@overload
def scaled_value_and_grad(
    fun: Callable,
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    axis_name: Hashable | None = None,
    average: bool = True,
) -> ScaledValueAndGradFn: ...


def scaled_value_and_grad(
    fun: Callable = _missing,
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    axis_name: Hashable | None = None,
    average: bool = True,
) -> Callable:
    """`eqx.filter_value_and_grad` with the loss scale kept in the state of an
    optimizer wrapped by `eqx_amp.loss_scaling`: the short float16 form.

    The returned function is called as `g(*args, opt_state=opt_state, **kwargs)`.
    It multiplies the loss by the scale in `opt_state`, differentiates with respect
    to the first argument (a `BiModel`: through its compute copy), unscales the
    gradients with that scale, and returns the new optimizer state carrying the
    scale that produced them; `loss_scaling`'s `update` then adjusts the scale and
    skips the step if they are not finite. It shares its core with
    `eqx_amp.filter_value_and_grad`.

    **Arguments:**

    - `fun`: the loss, differentiated with respect to its first argument. Omit it
        to use `scaled_value_and_grad(has_aux=True)` as a decorator.
    - `has_aux`: whether `fun` returns `(loss, aux)`.
    - `redo_on_nan`: on non-finite gradients, recompute with a backed-off scale at
        most this many more times, inside one `lax.while_loop` (compiled once).
    - `axis_name`, `average`: agree on the gradients' finiteness across this
        mapped axis, and (unless `average=False`, for parameters sharded over it)
        average the gradients and the loss over it, as in
        `eqx_amp.filter_value_and_grad`.

    **Returns:**

    A function `g(*args, opt_state, **kwargs)` returning
    `((value, grads), new_opt_state)`, whatever the options: `value` is the float32
    loss (`(loss, aux)` with `has_aux`), `grads` are unscaled, in float32 for every
    half-precision leaf, and `new_opt_state` holds the scale that produced them.
    Pass it to the optimizer's `update`.

    **Raises:**

    `TypeError` for a `fun` that is not callable or a call without `opt_state`;
    `ValueError` for an `opt_state` with no (or more than one)
    `eqx_amp.optim.LossScalingState`, or one that `optax.apply_if_finite` wraps.

    **Example:**

    ```python
    @eqx_amp.scaled_value_and_grad
    def loss_fn(model, x, y):
        pred = jax.vmap(eqx_amp.filter_amp(model, policy="mixed_float16"))(x)
        return jnp.mean((pred - y) ** 2)

    (loss, grads), opt_state = loss_fn(model, x, y, opt_state=opt_state)
    updates, opt_state = optim.update(grads, opt_state, model)
    ```
    """
    options = scaled_options(has_aux, redo_on_nan, axis_name, average)
    if fun is _missing:
        return ft.partial(scaled_value_and_grad, **options._asdict())
    check_decorated(fun, "scaled_value_and_grad")
    return eqx.module_update_wrapper(_ShortForm(fun, options, value_too=True))


@overload
def scaled_grad(
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    axis_name: Hashable | None = None,
    average: bool = True,
) -> Callable[[Callable], ScaledGradFn]: ...


@overload
def scaled_grad(
    fun: Callable,
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    axis_name: Hashable | None = None,
    average: bool = True,
) -> ScaledGradFn: ...


def scaled_grad(
    fun: Callable = _missing,
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    axis_name: Hashable | None = None,
    average: bool = True,
) -> Callable:
    """`eqx.filter_grad` with the loss scale kept in the optimizer state:
    `eqx_amp.scaled_value_and_grad` without the value.

    **Arguments:**

    The same as `eqx_amp.scaled_value_and_grad`.

    **Returns:**

    A function `g(*args, opt_state, **kwargs)` returning `(grads, new_opt_state)`,
    or `((grads, aux), new_opt_state)` with `has_aux=True`.

    **Example:**

    ```python
    @eqx_amp.scaled_grad
    def loss_fn(model, x, y):
        pred = jax.vmap(eqx_amp.filter_amp(model, policy="mixed_float16"))(x)
        return jnp.mean((pred - y) ** 2)

    grads, opt_state = loss_fn(model, x, y, opt_state=opt_state)
    ```
    """
    options = scaled_options(has_aux, redo_on_nan, axis_name, average)
    if fun is _missing:
        return ft.partial(scaled_grad, **options._asdict())
    check_decorated(fun, "scaled_grad")
    return eqx.module_update_wrapper(_ShortForm(fun, options, value_too=False))
