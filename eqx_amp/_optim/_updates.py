"""Adding optimizer updates to weights of any dtype: `eqx_amp.optim.apply_updates`."""

from typing import Any

import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from .._core._cast import at_least_float32, is_inexact_array
from .._core._describe import describe, first_line, is_none
from ._rounding import round_to_nearest


UPDATE_FOR_NON_FLOAT = (
    "`{what}` has {update} where `{name}` has {param}, which is not a floating "
    "array and is never updated. Put `None` there (as `eqx.filter(..., "
    "eqx.is_inexact_array)` and `eqx.filter_grad` do)."
)
BAD_UPDATE = (
    "`{what}` must hold floating arrays (or `None`), one per floating array of "
    "`{name}`, with the same shape; it has {update} where `{name}` has an array of "
    "dtype {dtype} and shape {shape}."
)
UPDATES_MISMATCH = (
    "`{what}` must have the structure of `{name}` (the same containers, module "
    "types and static fields), with `None` allowed in place of any subtree, as "
    "{source} returns it. The structure of `{what}` does not match. JAX reported: "
    "{error}"
)
_SOURCES = {
    "updates": "`optimizer.update(grads, opt_state, eqx.filter({name}, "
    "eqx.is_inexact_array))`",
    "grads": "`eqx.filter_grad(loss)({name}, ...)`",
}


def paired_leaves(
    updates: PyTree, params: PyTree, name: str, what: str = "updates"
) -> list[tuple]:
    """`(update, param)` for every leaf of `updates` (`None` included), each update
    checked against the leaf of `params` it updates. Errors call `params` `name`
    and `updates` `what` ("updates" or "grads")."""
    update_leaves, update_def = jtu.tree_flatten(updates, is_leaf=is_none)
    try:
        param_parts = update_def.flatten_up_to(params)
    except (ValueError, TypeError) as e:
        source = _SOURCES[what].format(name=name)
        raise ValueError(
            UPDATES_MISMATCH.format(
                what=what, name=name, source=source, error=first_line(e)
            )
        ) from None
    for update, param in zip(update_leaves, param_parts):
        check_update(update, param, name, what)
    return list(zip(update_leaves, param_parts))


def check_update(update: Any, param: Any, name: str, what: str = "updates") -> None:
    if update is None:
        return
    # Complex parameters are differentiated and updated like real ones.
    if not is_inexact_array(param):
        raise ValueError(
            UPDATE_FOR_NON_FLOAT.format(
                what=what, update=describe(update), name=name, param=describe(param)
            )
        ) from None
    # A complex update of a real weight would lose its imaginary part in the sum.
    complex_into_real = jnp.iscomplexobj(update) and not jnp.iscomplexobj(param)
    if not is_inexact_array(update) or update.shape != param.shape or complex_into_real:
        raise ValueError(
            BAD_UPDATE.format(
                what=what,
                name=name,
                update=describe(update),
                dtype=param.dtype,
                shape=tuple(param.shape),
            )
        ) from None


def add_in_float32(param: Any, update: Any) -> Any:
    """`param + update` in at least float32 (not yet rounded to `param`'s dtype)."""
    wide = at_least_float32(param.dtype)
    return param.astype(wide) + update.astype(wide)


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """Adds optimizer updates to weights of any dtype: each sum is computed in at
    least float32 and rounded once to the weight's own dtype.

    `eqx.apply_updates` adds in the promoted dtype and so turns a bfloat16 weight
    with a float32 update into a float32 weight; `optax.apply_updates` adds in the
    promoted dtype and rounds back, but fails under strict dtype promotion. This is
    the function to apply the updates of `eqx_amp.optim.kahan_summation()` and
    `eqx_amp.optim.stochastic_rounding(key)`, whose float32 updates land exactly on the
    rounded weights they computed.

    **Arguments:**

    - `params`: the model (any pytree; non-array leaves are kept as they are).
    - `updates`: the updates, with the structure of `params` and `None` wherever
        there is nothing to update (as `optimizer.update(grads, opt_state,
        eqx.filter(model, eqx.is_inexact_array))` returns them).

    **Returns:**

    `params` with the updates applied, every leaf in its original dtype.

    **Raises:**

    `ValueError` if the structure of `updates` does not match `params`, if there is
    an update for a leaf that is not a floating array, or if an update is not a
    floating array of the leaf's shape.

    **Example:**

    ```python
    optimizer = optax.chain(optax.adamw(1e-3), eqx_amp.optim.kahan_summation())
    updates, opt_state = optimizer.update(grads, opt_state, params)
    model = eqx_amp.optim.apply_updates(model, updates)   # bf16 weights stay bf16
    ```
    """
    paired_leaves(updates, params, "params")
    return jtu.tree_map(add_rounded_once, updates, params, is_leaf=is_none)


def add_rounded_once(update: Any, param: Any) -> Any:
    """`param + update` in at least float32, rounded once to `param`'s dtype;
    `param` itself (a whole subtree, where `updates` has `None` above leaves) when
    `update` is None."""
    if update is None:
        return param
    return round_to_nearest(add_in_float32(param, update), param.dtype)
