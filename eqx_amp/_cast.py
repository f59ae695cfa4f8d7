"""Casting pytrees: only real floating arrays are ever touched."""

import functools as ft
from collections.abc import Callable, Iterable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from ._filters import STATE_TYPES, FilterSpec, selection_mask


def is_floating_dtype(dtype: Any) -> bool:
    """True for real floating dtypes (float8 to float64)."""
    return jnp.issubdtype(dtype, jnp.floating)


def is_half_dtype(dtype: Any) -> bool:
    """True for real floating dtypes narrower than float32: what mixed precision
    computes in (bfloat16, float16, the float8 types)."""
    return is_floating_dtype(dtype) and jnp.dtype(dtype).itemsize < 4


def is_inexact_array(leaf: Any) -> bool:
    """True for arrays of a floating or complex dtype: what `eqx.filter_grad`
    differentiates, and so what a loss scale scales."""
    return eqx.is_inexact_array(leaf) or (
        isinstance(leaf, (np.ndarray, np.generic))
        and jnp.issubdtype(leaf.dtype, jnp.inexact)
    )


def is_floating_array(leaf: Any) -> bool:
    """True for JAX and NumPy arrays (and NumPy scalars) of a real floating dtype.

    Integer, boolean, complex and PRNG-key arrays, Python scalars and every other
    object are False: mixed precision never changes them. (Tracers are `jax.Array`s.)
    """
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        return False
    return is_floating_dtype(leaf.dtype)


def cast_leaf(leaf: Any, dtype: np.dtype) -> Any:
    """Casts one leaf if it is a floating array not already of `dtype`.

    Arrays already in `dtype` are returned as they are, so no convert op is traced.
    """
    if is_floating_array(leaf) and leaf.dtype != dtype:
        return leaf.astype(dtype)
    return leaf


def floating_dtype(
    dtype: Any, argname: str = "dtype", accepted_words: str = ""
) -> np.dtype:
    """`dtype` as an `np.dtype`, or a `ValueError` naming `argname` if it is not a
    real floating dtype."""
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        words = f", or one of {accepted_words}" if accepted_words else ""
        raise ValueError(
            f"`{argname}` must be a floating dtype such as jnp.bfloat16{words}, but "
            f"got {dtype!r}."
        ) from None
    if not is_floating_dtype(dtype):
        raise ValueError(
            f"`{argname}` must be a real floating dtype (float16, bfloat16, float32, "
            f"float64, or a float8 type), but got {dtype.name}. Mixed precision only "
            "changes floating arrays; integer, boolean and complex arrays are never "
            "cast."
        )
    return dtype


def cast_tree(tree: PyTree, dtype: Any, filter_spec: FilterSpec = True) -> PyTree:
    """Casts the floating arrays of `tree` that `filter_spec` selects to `dtype`.

    Integer, boolean, complex and PRNG-key arrays, Python scalars and non-array
    leaves are never touched, so a whole model (or a batch holding labels and keys)
    can be passed as it is.

    **Arguments:**

    - `tree`: any pytree.
    - `dtype`: a real floating dtype.
    - `filter_spec`: what `eqx.partition` accepts: a bool, a callable `leaf -> bool`,
        or a pytree prefix of `tree` with those as leaves. `True` casts, `False`
        keeps the leaf's dtype.

    **Returns:**

    A pytree of the same structure.

    **Example:**

    ```python
    model = eqx.nn.MLP(2, 2, 8, 2, key=jax.random.key(0))
    half = eqx_amp.cast_tree(model, jnp.bfloat16)
    norms_kept = eqx_amp.cast_tree(model, jnp.bfloat16, eqx_amp.default_filter_spec(model))
    ```
    """
    dtype = floating_dtype(dtype)
    if filter_spec is True:
        return jtu.tree_map(lambda leaf: cast_leaf(leaf, dtype), tree)
    mask = selection_mask(tree, filter_spec)
    return jtu.tree_map(
        lambda selected, leaf: cast_leaf(leaf, dtype) if selected else leaf, mask, tree
    )


def widest_floating_dtype(tree: PyTree) -> np.dtype | None:
    """The widest dtype among the floating arrays of `tree`, or `None` if it has none."""
    return widest_dtype(
        leaf.dtype for leaf in jtu.tree_leaves(tree) if is_floating_array(leaf)
    )


def widest_dtype(dtypes: Iterable[Any]) -> np.dtype | None:
    """The dtype `dtypes` promote to (bfloat16 and float16 give float32), or `None`
    for none. Standard promotion on purpose: a user's strict-promotion setting must not
    turn this bookkeeping into an error."""
    dtypes = frozenset(jnp.dtype(d) for d in dtypes)
    return _promote(dtypes) if dtypes else None


@ft.cache  # `jnp.result_type` costs ~0.2 ms, and autocast asks once per op
def _promote(dtypes: frozenset[np.dtype]) -> np.dtype:
    with jax.numpy_dtype_promotion("standard"):
        return jnp.dtype(jnp.result_type(*dtypes))


def at_least_float32(dtype: Any) -> np.dtype:
    """`dtype` widened to float32 if it is narrower (float64 stays float64)."""
    return widest_dtype([dtype, jnp.float32])


def cast_all_but_state(
    tree: PyTree, dtype_of: Callable[[np.dtype], np.dtype]
) -> PyTree:
    """Casts every floating array to `dtype_of(its dtype)`, except in `eqx.nn.State`
    (running statistics keep their dtype across steps)."""

    def cast(leaf):
        if is_floating_array(leaf):
            return cast_leaf(leaf, dtype_of(leaf.dtype))
        return leaf

    is_state = lambda x: isinstance(x, STATE_TYPES)  # noqa: E731
    return jtu.tree_map(lambda x: x if is_state(x) else cast(x), tree, is_leaf=is_state)


def overflowing_leaves(
    tree: PyTree, dtype: Any, mask: PyTree[bool] | None = None
) -> list[str]:
    """The paths of the concrete floating arrays of `tree` (those `mask` selects)
    holding a finite value too large for `dtype`: casting them would store inf.
    Traced arrays cannot be checked and are passed over."""
    dtype = jnp.dtype(dtype)
    limit = float(jnp.finfo(dtype).max)
    leaves = jtu.tree_leaves_with_path(tree)
    selected = [True] * len(leaves) if mask is None else jtu.tree_leaves(mask)
    found = []
    for (path, leaf), keep in zip(leaves, selected):
        if not (keep and is_floating_array(leaf)) or isinstance(leaf, jax.core.Tracer):
            continue
        if float(jnp.finfo(leaf.dtype).max) <= limit or leaf.size == 0:
            continue
        values = np.abs(np.asarray(leaf, np.float64))
        if np.any(np.isfinite(values) & (values > limit)):
            found.append(jtu.keystr(path))
    return found


def describe_leaves(paths: list[str], limit: int = 5) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def drop_state(tree: PyTree) -> PyTree:
    """`tree` with every `eqx.nn.State` replaced by `None`."""
    is_state = lambda x: isinstance(x, STATE_TYPES)  # noqa: E731
    return jtu.tree_map(lambda x: None if is_state(x) else x, tree, is_leaf=is_state)
