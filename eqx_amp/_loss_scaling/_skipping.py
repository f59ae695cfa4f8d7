"""Skipping a step: whether gradients are finite (agreed across devices), and the
choice that keeps the old model and optimizer state when they are not."""

from collections.abc import Hashable
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, PyTree

from .._core._axes import check_axis_name, unbound_axis_name_error
from .._core._cast import is_inexact_array
from .._core._describe import describe


_PRED_NOT_BOOL = (
    "`pred` must be a boolean scalar (a Python bool or a bool array of shape ()), "
    "such as the output of `eqx_amp.all_finite(grads)`, but got {}."
)
_STRUCTURE_MISMATCH = (
    "`a` and `b` must have the same pytree structure (the same containers, module "
    "types and static fields), so that either can be returned in place of the "
    "other. `a` is {} and `b` is {}."
)


def _inexact_arrays(tree: PyTree) -> list[Array]:
    return [x for x in jtu.tree_leaves(tree) if is_inexact_array(x)]


def all_finite(tree: PyTree, axis_name: Hashable | None = None) -> Bool[Array, ""]:
    """Whether every floating (and complex) array in `tree` is free of infs and NaNs.

    **Arguments:**

    - `tree`: any pytree, such as gradients or a whole `eqx.Module`. Integer,
        boolean and PRNG-key arrays (always finite), `None`, Python scalars and
        non-array leaves (functions, strings, ...) are ignored.
    - `axis_name`: the name of a mapped axis (of `jax.shard_map`, `jax.pmap` or
        `jax.vmap`). If given, the answer is agreed across that axis: `True` on every
        device only if the arrays are finite on every device.

    **Returns:**

    A boolean scalar array. `True` for a tree with no floating arrays.

    **Example:**

    ```python
    grads_finite = eqx_amp.all_finite(grads)
    model = eqx_amp.select_tree(grads_finite, updated_model, model)
    ```
    """
    leaves = _inexact_arrays(tree)
    if leaves:
        finite = jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()
    else:
        finite = jnp.asarray(True)
    check_axis_name(axis_name)
    if axis_name is not None:
        with unbound_axis_name_error(axis_name):
            finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name) == 1
    return finite


def _check_pred(pred: Any) -> bool | Bool[Array, ""]:
    if isinstance(pred, (bool, np.bool_)):
        return bool(pred)
    if not eqx.is_array(pred) or pred.dtype != jnp.bool_ or pred.shape != ():
        raise TypeError(_PRED_NOT_BOOL.format(describe(pred)))
    if isinstance(pred, jax.core.Tracer):
        return pred
    return bool(pred)


def _same_static_leaf(x: Any, y: Any) -> bool:
    if x is y:
        return True
    try:
        return bool(x == y)
    except Exception:  # noqa: BLE001 (`==` of arbitrary user objects may raise anything)
        return False


def select_tree(pred: Bool[ArrayLike, ""], a: PyTree, b: PyTree) -> PyTree:
    """Leafwise `a if pred else b`, for a traced `pred`.

    The usual use is skipping a training step whose gradients are not finite:
    `select_tree(grads_finite, (new_model, new_opt_state), (model, opt_state))`.

    On a CPU the choice is one `lax.cond` over the whole tree: with a select per
    leaf, XLA's CPU program of a small transformer step has about 3x the
    instructions of one that never skips, against 1.08x with the `lax.cond`
    (`benchmarks/skip_overhead.py`). On GPUs and TPUs it is a select per leaf, which
    keeps each leaf's sharding: XLA's GPU partitioner replicates the outputs of a
    `lax.cond` over sharded arrays when the step's output shardings are not given,
    so an FSDP model and optimizer state would be all-gathered whole every step
    (`benchmarks/h100_aot.py --fsdp 8`).

    **Arguments:**

    - `pred`: a boolean scalar: a Python bool, or a bool array of shape `()`.
    - `a`, `b`: pytrees with the same structure (an `eqx.Module` with non-array
        leaves is fine). Each pair of array leaves must have the same shape and
        dtype; each pair of non-array leaves (activation functions, Python scalars,
        ...) must be equal, and is passed through.

    **Returns:**

    A pytree with the structure of `a`: the arrays of `a` where `pred` is true, those
    of `b` where it is false. If `pred` is concrete (a Python bool, or an array
    outside `jit`), `a` or `b` itself is returned.

    **Example:**

    ```python
    (loss, grads), loss_scale, grads_finite = grad_fn(model, x, y, loss_scale=ls)
    updates, new_opt_state = optim.update(grads, opt_state, model)
    new_model = eqx.apply_updates(model, updates)
    model, opt_state = eqx_amp.select_tree(
        grads_finite, (new_model, new_opt_state), (model, opt_state)
    )
    ```
    """
    pred = _check_pred(pred)
    a_leaves, a_def = jtu.tree_flatten(a)
    b_leaves, b_def = jtu.tree_flatten(b)
    if a_def != b_def:
        raise ValueError(_STRUCTURE_MISMATCH.format(a_def, b_def))
    for i, (x, y) in enumerate(zip(a_leaves, b_leaves)):
        x_array = eqx.is_array(x)
        y_array = eqx.is_array(y)
        if x_array != y_array:
            raise ValueError(
                f"Leaf {i} of `a` is {describe(x)} but leaf {i} of `b` is "
                f"{describe(y)}: either both are arrays or both are the same "
                "non-array value."
            )
        if x_array:
            if x.shape != y.shape or x.dtype != y.dtype:
                raise ValueError(
                    f"Leaf {i} of `a` and `b` must have the same shape and dtype, "
                    f"but `a` has {describe(x)} and `b` has {describe(y)}."
                )
        elif not _same_static_leaf(x, y):
            raise ValueError(
                f"Leaf {i} is not an array, so it must be the same in `a` and `b` "
                f"(it is passed through), but `a` has {describe(x)} and `b` has "
                f"{describe(y)}."
            )
    if isinstance(pred, bool):
        return a if pred else b
    a_dynamic, static = eqx.partition(a, eqx.is_array)
    b_dynamic, _ = eqx.partition(b, eqx.is_array)
    chosen = cond_or_select(pred, lambda x, _: x, lambda _, y: y, a_dynamic, b_dynamic)
    return eqx.combine(chosen, static)


def cond_or_select(
    pred: Bool[Array, ""], when_true: Any, when_false: Any, *operands: Any
) -> Any:
    """`lax.cond(pred, when_true, when_false, *operands)` on a CPU; elsewhere both
    branches, then a `lax.select` per leaf. XLA's GPU partitioner replicates the
    outputs of a `lax.cond` over sharded arrays whose output shardings are not
    given (an FSDP step's whole state, all-gathered every step); a select keeps
    each leaf's sharding. On a CPU the cond compiles to a smaller program."""

    def by_cond(pred, *operands):
        return jax.lax.cond(pred, when_true, when_false, *operands)

    def by_select(pred, *operands):
        chosen, other = when_true(*operands), when_false(*operands)
        return jtu.tree_map(lambda x, y: jax.lax.select(pred, x, y), chosen, other)

    return jax.lax.platform_dependent(pred, *operands, cpu=by_cond, default=by_select)
