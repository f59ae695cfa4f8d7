"""Optimizer-side precision: master weights kept in the optimizer state, and
compensated updates for bfloat16 weights.

- `master_weights(optimizer)`: the model holds half-precision weights and the
    optimizer state holds their float32 master copy, as Optimisers.jl's
    `MixedPrecision` does it. It owns the parameter update, so it wraps an
    optimizer rather than joining a chain.
- `kahan_summation()` and `stochastic_rounding(key)`: the last link of an optax
    chain for bfloat16 weights, with `eqx_amp.optim.apply_updates`.
"""

from typing import Any, NamedTuple, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jaxtyping import Array, PRNGKeyArray, PyTree, UInt32

from .._core._cast import floating_dtype, is_floating_array, is_inexact_array
from .._core._describe import describe, is_none
from ._rounding import (
    check_compensated_dtype,
    check_key,
    check_key_data,
    exact_update,
    kahan_add,
    key_impl,
    raw_key_data,
    round_to_nearest,
    stochastic_round,
    wrap_key,
)
from ._updates import add_in_float32, add_rounded_once, paired_leaves


def check_optimizer(optimizer: Any, where: str) -> None:
    """Raises unless `optimizer` is an optax optimizer."""
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            f"`{where}` wraps an optax optimizer (an object with `init` and `update`, "
            f"such as `optax.adam(1e-3)`), but got {type(optimizer).__name__}."
        )


def check_floating_params(params: PyTree, where: str) -> None:
    """Raises naming the first leaf of `params` that is an array but not a floating
    one: optimizers of weights are given the floating leaves only."""
    for path, leaf in jtu.tree_leaves_with_path(params):
        if eqx.is_array(leaf) and not is_inexact_array(leaf):
            raise ValueError(
                f"{where} was given {jtu.keystr(path) or 'params'}, an array of "
                f"dtype {leaf.dtype}, which is not a floating array and cannot be "
                "trained. Give it the floating leaves only: `eqx.filter(model, "
                "eqx.is_inexact_array)`."
            )


# Master weights ----------------------------------------------------------------


class MasterWeightsState(NamedTuple):
    """The state of `eqx_amp.optim.master_weights(optimizer)`.

    **Fields:**

    - `master`: the master copy, with the structure of the parameters: a float32
        array for every floating parameter narrower than float32, `None` elsewhere
        (wider parameters are their own master).
    - `inner_state`: the wrapped optimizer's state, which sees the master.
    """

    master: PyTree
    inner_state: Any


def master_weights(
    optimizer: optax.GradientTransformation, dtype: Any = jnp.float32
) -> optax.GradientTransformationExtraArgs:
    """Trains a half-precision model with float32 master weights kept in the
    optimizer state (Optimisers.jl's `MixedPrecision`).

    The model itself holds bfloat16 (or float16) weights and runs as it is. The
    state holds a float32 copy of every half-precision weight; `update` casts the
    gradients to float32, runs the wrapped optimizer against the master, adds its
    updates to the master in float32, and returns float32 updates that take each
    weight exactly to the new master rounded to its dtype, through
    `optax.apply_updates` or `eqx_amp.optim.apply_updates` (which add in float32
    and round once; `eqx.apply_updates` would keep the float32 sum). There is no
    compute copy to keep in sync: the model *is* the compute copy.

    Use it for a model already stored in half precision, or when the optimizer is
    the natural owner of precision. Use `eqx_amp.BiModel` instead to keep a float32
    model as the source of truth with `filter_amp` semantics (norms kept in
    float32 at call boundaries). Both store the same bytes: master + half copy.

    **Arguments:**

    - `optimizer`: any optax optimizer (chains, schedules, `optax.MultiSteps`).
        It is an optax `GradientTransformation` itself, so it composes either way:
        inside `eqx_amp.loss_scaling(...)` a skipped step leaves the master, and so
        the model, as they were.
    - `dtype`: the master dtype (float32).

    **Returns:**

    An `optax.GradientTransformationExtraArgs` whose state is a
    `MasterWeightsState`: `update(grads, state, params) -> (updates, state)`.
    `params` (required) is the model (or any pytree; only its floating arrays are
    trained); `grads` has its structure with `None` where there is no gradient (as
    `eqx.filter_grad` returns it). The updates are float32 differences of two
    half-precision values, exact unless a weight shrinks more than 2**15-fold in
    one step (then the weight lands within float32 rounding of the master).

    **Raises:**

    `TypeError` if `optimizer` is not an optimizer; `ValueError` for a master
    dtype that is not floating, for gradients whose structure does not match the
    parameters, or for a gradient of a non-floating leaf.

    **Example:**

    ```python
    model = eqx_amp.cast_tree(model, jnp.bfloat16)           # a bfloat16 model
    optimizer = eqx_amp.optim.master_weights(optax.adamw(1e-3))
    opt_state = optimizer.init(model)                        # float32 master inside

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx_amp.optim.apply_updates(model, updates), opt_state, loss
    ```
    """
    check_optimizer(optimizer, "master_weights")
    master_dtype = floating_dtype(dtype, "dtype")
    inner = optax.with_extra_args_support(optimizer)

    def needs_master(leaf: Any) -> bool:
        return is_floating_array(leaf) and leaf.dtype.itemsize < master_dtype.itemsize

    def master_view(master: PyTree, params: PyTree) -> PyTree:
        # What the wrapped optimizer trains: the master where there is one, the
        # parameter itself elsewhere; floating leaves only.
        trainable = eqx.filter(params, is_inexact_array)
        return jtu.tree_map(
            lambda m, p: p if m is None else m, master, trainable, is_leaf=is_none
        )

    def init_fn(params: PyTree) -> MasterWeightsState:
        master = jtu.tree_map(
            lambda p: p.astype(master_dtype) if needs_master(p) else None, params
        )
        return MasterWeightsState(master, inner.init(master_view(master, params)))

    def update_fn(
        grads: PyTree, state: MasterWeightsState, params: PyTree = None, **extra_args
    ) -> tuple[PyTree, MasterWeightsState]:
        params = _require_params(params, "optim.master_weights")
        if not isinstance(state, MasterWeightsState):
            raise TypeError(
                "The state passed to the `update` of `eqx_amp.optim.master_weights(...)` "
                f"must be the `MasterWeightsState` its `init` made, but got "
                f"{type(state).__name__}."
            )
        view = master_view(state.master, params)
        paired_leaves(grads, params, "params", what="grads")
        grads = jtu.tree_map(
            lambda g, v: None if g is None else g.astype(v.dtype),
            grads,
            view,
            is_leaf=is_none,
        )
        updates, inner_state = inner.update(
            grads, state.inner_state, view, **extra_args
        )
        new_view = jtu.tree_map(add_rounded_once, updates, view, is_leaf=is_none)
        new_master = jtu.tree_map(
            lambda m, v: None if m is None else v,
            state.master,
            new_view,
            is_leaf=is_none,
        )

        # A weight with a master steps to its new master rounded to its dtype: the
        # difference of two values of that dtype, which the master dtype holds
        # exactly. A weight that is its own master (float32 and wider, complex)
        # takes the wrapped optimizer's update as it is.
        def step_to(master, update, new, param):
            if master is None:
                return update
            rounded = round_to_nearest(new, param.dtype)
            return rounded.astype(master.dtype) - param.astype(master.dtype)

        new_updates = jtu.tree_map(
            step_to, state.master, updates, new_view, params, is_leaf=is_none
        )
        return new_updates, MasterWeightsState(new_master, inner_state)

    return optax.GradientTransformationExtraArgs(
        cast(optax.TransformInitFn, init_fn),
        cast(optax.TransformUpdateExtraArgsFn, update_fn),
    )


# Compensated bfloat16 weights ------------------------------------------------------


class KahanSummationState(NamedTuple):
    """The state of `eqx_amp.optim.kahan_summation()`.

    **Fields:**

    - `compensation`: with the structure of the parameters, a buffer of the
        weight's dtype (bfloat16) holding what rounding took from the weight so
        far, for every bfloat16 parameter; `None` elsewhere.
    """

    compensation: PyTree


def kahan_summation() -> optax.GradientTransformation:
    """Makes bfloat16 weights train like float32 ones: Kahan-compensated updates,
    as the last link of an optax chain.

    An update smaller than half a bfloat16 ulp of its weight (about 2^-9 of it)
    rounds away, so plain bfloat16 weights stall. This transformation adds each
    update to the weight in float32 together with the compensation buffer, rounds
    the sum to bfloat16, keeps what rounding lost in the buffer for the next step,
    and returns the float32 update that lands exactly on the rounded weight. Apply
    it with `eqx_amp.optim.apply_updates`. float32 (and wider) weights pass through
    unchanged.

    The buffer is bfloat16 too: the weight follows the float32 sum to within an ulp
    while each update is at least about 2^-17 of the weight; smaller ones are
    rounded away in the buffer (use `stochastic_rounding` or `master_weights` at
    learning rates that small).

    Memory: 2 bytes per bfloat16 weight (the buffer), so a bfloat16 model with
    this costs what a float32 one does in weights, and half a float32 master +
    bfloat16 copy. `eqx_amp.optim.stochastic_rounding` needs no buffer.

    **Returns:**

    An `optax.GradientTransformation` whose state is a `KahanSummationState`. Its
    `update` needs `params`.

    **Raises:**

    At `init`: `ValueError` for float16 (or float8) weights (compensation needs
    bfloat16; keep a float32 master for float16) and for non-floating arrays. At
    `update`: `ValueError` without `params`.

    **Example:**

    ```python
    model = eqx_amp.cast_tree(model, jnp.bfloat16)
    optimizer = optax.chain(optax.adamw(1e-3), eqx_amp.optim.kahan_summation())
    params = eqx.filter(model, eqx.is_inexact_array)
    opt_state = optimizer.init(params)
    ...
    updates, opt_state = optimizer.update(grads, opt_state, params)
    model = eqx_amp.optim.apply_updates(model, updates)
    ```
    """

    def init_fn(params: PyTree) -> KahanSummationState:
        _check_compensated_params(params, "kahan_summation")
        return KahanSummationState(
            jtu.tree_map(
                lambda p: jnp.zeros_like(p) if _compensated(p) else None, params
            )
        )

    def update_fn(
        updates: PyTree, state: optax.OptState, params: PyTree | None = None
    ) -> tuple[PyTree, KahanSummationState]:
        if not isinstance(state, KahanSummationState):
            raise TypeError(_NOT_OUR_STATE.format("kahan_summation()", type(state)))
        params = _require_params(params, "optim.kahan_summation")
        pairs = paired_leaves(updates, params, "params")
        compensation = state.compensation
        comp_leaves = jtu.tree_structure(updates, is_leaf=is_none).flatten_up_to(
            compensation
        )
        new_updates, new_comp = [], []
        for (update, param), comp in zip(pairs, comp_leaves):
            if update is None or comp is None:
                new_updates.append(update)
                new_comp.append(comp)
                continue
            if not is_floating_array(param) or param.dtype != comp.dtype:
                raise ValueError(
                    _KAHAN_DTYPE_CHANGED.format(comp.dtype, describe(param))
                )
            new, kept = kahan_add(param, update, comp)
            new_updates.append(exact_update(new, param))
            new_comp.append(kept)
        update_def = jtu.tree_structure(updates, is_leaf=is_none)
        return update_def.unflatten(new_updates), KahanSummationState(
            update_def.unflatten(new_comp)
        )

    return optax.GradientTransformation(init_fn, update_fn)


class StochasticRoundingState(NamedTuple):
    """The state of `eqx_amp.optim.stochastic_rounding(key)`.

    **Fields:**

    - `key`: the raw data of the PRNG key the next step's roundings are drawn from
        (`jax.random.key_data`; stored raw so that `eqx.tree_serialise_leaves`
        and orbax save it like any array).
    """

    key: UInt32[Array, "..."]


def stochastic_rounding(key: PRNGKeyArray) -> optax.GradientTransformation:
    """Makes bfloat16 weights train like float32 ones without a buffer: stochastic
    rounding, as the last link of an optax chain.

    Each update is added to its weight in float32 and the sum is rounded to
    bfloat16 up or down at random, with the probability that makes the rounding
    unbiased (a sum a quarter of the way to the next bfloat16 rounds up one time
    in four). Small updates then survive in expectation, where nearest rounding
    would drop them every time. The update returned lands exactly on the rounded
    weight: apply it with `eqx_amp.optim.apply_updates`. float32 (and wider) weights
    pass through unchanged.

    Memory: a PRNG key, nothing per weight. Runs are reproducible: the same key
    gives the same roundings, and the key is part of the state, so a resumed run
    continues exactly.

    **Arguments:**

    - `key`: a PRNG key (`jax.random.key(seed)`), required.

    **Returns:**

    An `optax.GradientTransformation` whose state is a `StochasticRoundingState`.
    Its `update` needs `params`.

    **Raises:**

    `TypeError` if `key` is not a PRNG key, `ValueError` for a batch of keys (one
    is needed). At `init`: `ValueError` for float16 (or float8) weights and for
    non-floating arrays. At `update`: `ValueError`
    without `params`, `TypeError` for a state without a key.

    **Example:**

    ```python
    optimizer = optax.chain(
        optax.adamw(1e-3), eqx_amp.optim.stochastic_rounding(jax.random.key(0))
    )
    updates, opt_state = optimizer.update(grads, opt_state, params)
    model = eqx_amp.optim.apply_updates(model, updates)
    ```
    """
    check_key(key, "`stochastic_rounding`")
    key_data, impl = raw_key_data(key), key_impl(key)

    def init_fn(params: PyTree) -> StochasticRoundingState:
        _check_compensated_params(params, "stochastic_rounding")
        return StochasticRoundingState(jnp.array(key_data, copy=True))

    def update_fn(
        updates: PyTree,
        state: optax.OptState,
        params: PyTree | None = None,
    ) -> tuple[PyTree, StochasticRoundingState]:
        if not isinstance(state, StochasticRoundingState):
            raise TypeError(
                _NOT_OUR_STATE.format("stochastic_rounding(key)", type(state))
            )
        check_key_data(state.key, impl, "The `StochasticRoundingState`")
        params = _require_params(params, "optim.stochastic_rounding")
        pairs = paired_leaves(updates, params, "params")
        _check_compensated_params(params, "stochastic_rounding")
        key, step_key = jax.random.split(wrap_key(state.key, impl))
        leaf_keys = iter(jax.random.split(step_key, max(len(pairs), 1)))
        new_updates = []
        for update, param in pairs:
            leaf_key = next(leaf_keys)
            if update is None or not _compensated(param):
                new_updates.append(update)
                continue
            new = stochastic_round(add_in_float32(param, update), param.dtype, leaf_key)
            new_updates.append(exact_update(new, param))
        update_def = jtu.tree_structure(updates, is_leaf=is_none)
        return update_def.unflatten(new_updates), StochasticRoundingState(
            jax.random.key_data(key)
        )

    return optax.GradientTransformation(init_fn, update_fn)


_KAHAN_DTYPE_CHANGED = (
    "`kahan_summation` keeps a {} compensation buffer for a weight that is now {}. "
    "Apply its updates with `eqx_amp.optim.apply_updates(model, updates)`, which keeps "
    "each weight's dtype (`eqx.apply_updates` promotes bfloat16 weights to float32)."
)
_NOT_OUR_STATE = (
    "The state passed to the `update` of `eqx_amp.{}` must be the one its `init` "
    "made, but got {}."
)


def _compensated(param: Any) -> bool:
    return is_floating_array(param) and param.dtype.itemsize < 4


def _check_compensated_params(params: PyTree, where: str) -> None:
    check_floating_params(params, f"`{where}`")
    for path, leaf in jtu.tree_leaves_with_path(params):
        if is_floating_array(leaf):
            check_compensated_dtype(
                leaf.dtype, f"`{where}` was given {jtu.keystr(path) or 'params'}: it"
            )


def _require_params(params: PyTree | None, where: str) -> PyTree:
    if params is None:
        raise ValueError(
            f"The `update` of `eqx_amp.{where}` needs the current weights to round "
            "against: call `optimizer.update(grads, opt_state, params)`."
        )
    return params
