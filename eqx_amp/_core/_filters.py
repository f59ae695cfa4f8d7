"""Filter specs: which floating leaves of a model are cast to the compute dtype."""

from collections.abc import Callable
from typing import Any, TypeAlias

import equinox as eqx
import jax.tree_util as jtu
from jaxtyping import PyTree


FilterSpec: TypeAlias = (
    bool | Callable[[Any], bool] | PyTree[bool | Callable[[Any], bool]]
)

# Their statistics overflow or lose precision in half precision, and they are a
# tiny share of the FLOPs, so they run in the parameter dtype by default.
NORM_LAYERS = (eqx.nn.LayerNorm, eqx.nn.RMSNorm, eqx.nn.GroupNorm, eqx.nn.BatchNorm)
# Running statistics must keep their dtype across steps: never cast state.
STATE_TYPES = (eqx.nn.State, eqx.nn.StateIndex)

# The named scopes Equinox's norm layers open around their ops: `autocast` computes
# under them in float32.
NORM_SCOPES = tuple(f"eqx.nn.{layer.__name__}" for layer in NORM_LAYERS)
# The norm layers among them that compute in (at least) float32 whatever their input
# dtype, and end with `out.astype(orig_dtype)`: they hand back the dtype their input
# arrived in, so with float32 weights they already run at a call boundary of their
# own (`filter_amp` passes them as they are), and under autocast they still do.
# (BatchNorm promotes with its float32 running statistics instead.)
SELF_CASTING_LAYERS = (eqx.nn.LayerNorm, eqx.nn.RMSNorm, eqx.nn.GroupNorm)
LAYERS_RETURNING_INPUT_DTYPE_SCOPES = tuple(
    f"eqx.nn.{layer.__name__}" for layer in SELF_CASTING_LAYERS
)
# `autocast` keeps every op under this scope (`with full_precision():`) at the dtypes
# it was traced with.
FULL_PRECISION_SCOPE = "eqx_amp.full_precision"

_NOT_SELECTED = object()

_SPEC_MISMATCH = (
    "`filter_spec` does not match the structure of the tree it filters. A filter "
    "spec is a bool, a callable `leaf -> bool`, or a pytree prefix of the model "
    "whose leaves are bools or such callables (build one with "
    "`eqx_amp.default_filter_spec(model)`, `eqx_amp.keep(model, ...)` or "
    "`jax.tree_util.tree_map(lambda _: True, model)`). JAX reported: {}"
)

_SPEC_BAD_LEAF = (
    "`filter_spec` must be a bool, a callable `leaf -> bool`, or a pytree prefix of "
    "the model whose leaves are bools or such callables; it has a leaf that is "
    "neither."
)


def _is_kept_by_default(node: Any) -> bool:
    return isinstance(node, NORM_LAYERS + STATE_TYPES)


def selection_mask(tree: PyTree, filter_spec: FilterSpec) -> PyTree[bool]:
    """Resolves a filter spec to a tree of bools with exactly `tree`'s structure."""
    try:
        marked = eqx.filter(tree, filter_spec, replace=_NOT_SELECTED)
    except ValueError as e:
        if "booleans and callables" in str(e):
            raise ValueError(_SPEC_BAD_LEAF) from None
        raise ValueError(_SPEC_MISMATCH.format(e)) from None
    return jtu.tree_map(lambda leaf: leaf is not _NOT_SELECTED, marked)


def _spec_keeping(model: PyTree, is_kept: Callable[[Any], bool]) -> PyTree[bool]:
    return jtu.tree_map(lambda node: not is_kept(node), model, is_leaf=is_kept)


def default_filter_spec(model: PyTree) -> PyTree[bool]:
    """The filter spec `filter_amp` and `BiModel` use when none is given: `True`
    (cast) everywhere except the leaves of normalisation layers
    (`eqx.nn.LayerNorm`, `RMSNorm`, `GroupNorm`, `BatchNorm`) and of any
    `eqx.nn.State`, which stay in the parameter dtype.

    **Arguments:**

    - `model`: any pytree, usually an `eqx.Module`.

    **Returns:**

    A pytree prefix of `model` with bool leaves.

    **Example:**

    ```python
    block = eqx.nn.Sequential([eqx.nn.Linear(4, 4, key=key), eqx.nn.LayerNorm(4)])
    spec = eqx_amp.default_filter_spec(block)
    # spec.layers == (Linear(weight=True, bias=True, ...), False)
    ```
    """
    return _spec_keeping(model, _is_kept_by_default)


def keep(
    model: PyTree, *types_or_predicates: type | Callable[[Any], bool]
) -> PyTree[bool]:
    """A filter spec that keeps more submodules in the parameter dtype, on top of
    `default_filter_spec`.

    **Arguments:**

    - `model`: the model the spec is for.
    - `*types_or_predicates`: module types (every instance is kept), submodules of
        `model` (`model.layers[-1]`: that one is kept), or predicates
        `module -> bool` called on each `eqx.Module` in the model (the ones they
        select are kept).

    **Returns:**

    A pytree prefix of `model` with bool leaves.

    **Example:**

    ```python
    # Keep the attention layers and the final projection in float32 too.
    spec = eqx_amp.keep(model, eqx.nn.MultiheadAttention, lambda m: m is model.head)
    amp_model = eqx_amp.filter_amp(model, filter_spec=spec)
    ```
    """
    types = []
    predicates = []
    for item in types_or_predicates:
        if isinstance(item, type):
            types.append(item)
        elif isinstance(item, eqx.Module):
            # A submodule instance (callable itself, but not a predicate).
            predicates.append(lambda node, item=item: node is item)
        elif callable(item):
            predicates.append(item)
        else:
            raise TypeError(
                "`keep` takes module types or predicates `module -> bool` (or "
                f"submodules of the model) after the model, but got {item!r} of type "
                f"{type(item).__name__}."
            )
    types = tuple(types)

    def is_kept(node: Any) -> bool:
        if _is_kept_by_default(node) or (types and isinstance(node, types)):
            return True
        return isinstance(node, eqx.Module) and any(bool(p(node)) for p in predicates)

    return _spec_keeping(model, is_kept)
