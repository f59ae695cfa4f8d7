"""Loss scaling kept in the optimizer state: a float16 training loop three lines away
from a float32 one, as with Keras' `LossScaleOptimizer`."""

from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jaxtyping import Array, Bool, Int, PyTree

from ._grad import filter_value_and_grad
from ._loss_scale import (
    AbstractLossScale,
    DynamicLossScale,
    all_finite,
    check_axis_name,
)
from ._optimizers import check_optimizer
from ._wrapper import FunctionWrapper, check_callable


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
        loss, grads = eqx_amp.scaled_value_and_grad(loss_fn, opt_state)(model, x, y)
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

        updates, inner_state = jax.lax.cond(
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


class _StateScaledValueAndGrad(FunctionWrapper):
    # An `eqx_amp.filter_value_and_grad` of the loss. Typed `Callable` (under its own
    # type the checker would bind it like a method, as in `_ScaledGradWrapper`), it
    # is taken for a plain function: reading its attributes waives that rule.
    fn: Callable
    opt_state: PyTree
    _returns_state: bool = eqx.field(static=True)

    @property
    def __wrapped__(self) -> Callable:
        # The loss itself, whose signature this has (no `loss_scale` keyword).
        return self.fn.__wrapped__  # pyright: ignore[reportFunctionMemberAccess]

    def __call__(self, /, *args, **kwargs):
        loss_scale = _loss_scaling_state(self.opt_state).loss_scale
        step = self.fn.step(args, kwargs, loss_scale)  # pyright: ignore[reportFunctionMemberAccess]
        if not self._returns_state:
            return step.value, step.grads
        # The scale that gave these gradients: `update` adjusts it by their finiteness.
        new_state = _with_loss_scale(self.opt_state, step.used_loss_scale)
        return (step.value, step.grads), new_state


def scaled_value_and_grad(
    fun: Callable,
    opt_state: PyTree,
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    axis_name: Hashable | None = None,
    average: bool = True,
) -> Callable:
    """`eqx.filter_value_and_grad` with the loss scale of an optimizer wrapped by
    `eqx_amp.loss_scaling`: the loss is multiplied by the scale in `opt_state`, and
    the gradients are unscaled before they are returned. A drop-in for
    `eqx.filter_value_and_grad(fun)`.

    **Arguments:**

    - `fun`: the loss, differentiated with respect to its first argument.
    - `opt_state`: the optimizer state (it holds a `LossScalingState`, anywhere in
        it).
    - `has_aux`: whether `fun` returns `(loss, aux)`.
    - `redo_on_nan`: on non-finite gradients, recompute with a backed-off scale at
        most this many more times, inside one `lax.while_loop` (compiled once).
        Then the new optimizer state, which carries the scale that worked, is
        returned too.
    - `axis_name`, `average`: agree on the gradients' finiteness across this
        mapped axis, and (unless `average=False`, for parameters sharded over it)
        average the gradients and the loss over it, as in
        `eqx_amp.filter_value_and_grad`.

    **Returns:**

    A function `g(*args, **kwargs)` returning `(value, grads)` like
    `eqx.filter_value_and_grad` (`value` is `(loss, aux)` with `has_aux`); with
    `redo_on_nan > 0`, `((value, grads), opt_state)`. `grads` are unscaled, in
    float32 for every half-precision leaf; the value is float32.

    **Example:**

    ```python
    loss, grads = eqx_amp.scaled_value_and_grad(loss_fn, opt_state)(model, x, y)
    updates, opt_state = optim.update(grads, opt_state, model)
    ```
    """
    check_callable(fun, "scaled_value_and_grad")
    _loss_scaling_state(opt_state)  # fails here, not at the first call
    value_and_grad = filter_value_and_grad(
        fun,
        has_aux=has_aux,
        redo_on_nan=redo_on_nan,
        axis_name=axis_name,
        average=average,
    )
    wrapper = _StateScaledValueAndGrad(value_and_grad, opt_state, redo_on_nan > 0)
    return eqx.module_update_wrapper(wrapper)
