"""Kept layers at their own dtype: each runs behind a casting boundary (its
inputs cast to its dtype, its floating outputs back), and convolutions cast their
inputs to their weight's dtype."""

import dataclasses
import functools as ft
from collections.abc import Callable
from typing import (
    Any,
)

import equinox as eqx
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .._core._cast import (
    cast_all_but_state,
    drop_state,
    is_floating_array,
    widest_floating_dtype,
)
from .._core._filters import (
    NORM_LAYERS,
    SELF_CASTING_LAYERS,
    STATE_TYPES,
    FilterSpec,
    default_filter_spec,
    selection_mask,
)


#
# Running a function at another dtype, with casts at its boundary.
#


def call_at(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    dtype_of: Callable[[np.dtype], np.dtype],
) -> Any:
    """Calls `fn` with floating inputs cast by `dtype_of`, and casts floating outputs
    back to the widest floating input dtype, so that the caller sees no change of
    dtype."""
    caller_dtype = widest_floating_dtype(drop_state((args, kwargs)))
    args, kwargs = cast_all_but_state((args, kwargs), dtype_of)
    out = fn(*args, **kwargs)
    if caller_dtype is None:
        return out
    return cast_all_but_state(out, lambda _: caller_dtype)


@ft.cache
def _boundary_class(cls: type, dtype: np.dtype) -> type:
    """A subclass of `cls` whose `__call__` runs at `dtype` with casts at its own call
    boundary. A subclass rather than a wrapper, so that `isinstance` checks made by
    the surrounding model (`eqx.nn.Sequential` looks for `StatefulLayer`) still
    hold."""

    def __init__(self, module):
        # The module's fields, as they are: its own checks already ran.
        for field in dataclasses.fields(module):
            object.__setattr__(self, field.name, getattr(module, field.name))

    def __call__(self, *args, **kwargs):
        return call_at(ft.partial(cls.__call__, self), args, kwargs, lambda _: dtype)

    namespace = {
        "__init__": __init__,
        "__call__": __call__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
    }
    return type(cls.__name__, (cls,), namespace)


def _with_boundary_class(module: eqx.Module, dtype: np.dtype) -> eqx.Module:
    return _boundary_class(type(module), dtype)(module)


def _fully_kept(node: eqx.Module, mask: PyTree[bool]) -> bool:
    """True when `node` has floating arrays and the spec keeps all of them, or has
    none and is a norm layer (kept by default: an affine-free `BatchNorm`, whose
    statistics are `State`, still computes them from its input's dtype)."""
    selected = [
        sel
        for leaf, sel in zip(jtu.tree_leaves(node), jtu.tree_leaves(mask))
        if is_floating_array(leaf)
    ]
    if not selected:
        return isinstance(node, NORM_LAYERS)
    return not any(selected)


def _runs_at_own_dtype(node: eqx.Module) -> bool:
    """Equinox's LayerNorm, RMSNorm and GroupNorm (not a subclass that changes their
    call) compute in float32 and return their input's dtype by themselves."""
    return any(
        isinstance(node, layer) and type(node).__call__ is layer.__call__
        for layer in SELF_CASTING_LAYERS
    )


def _is_boundary_candidate(node: Any) -> bool:
    return (
        isinstance(node, eqx.Module)
        and not isinstance(node, STATE_TYPES)
        and callable(node)
        and not _runs_at_own_dtype(node)
    )


# JAX refuses a convolution of two dtypes (where a matmul promotes), so an array made
# in float32 inside the function (a GAN's noise, a diffusion model's time
# concatenated with its image) meeting a cast convolution would fail the call with
# JAX's error. These layers cast their floating inputs to their weight's dtype
# instead: only calls that would have failed change. Their output stays in the
# weight's dtype: cast back to the float32 of such an input, it made every layer
# after the convolution run wide (a diffusion model's MLPs: 22% of its FLOPs in
# half precision instead of 100%).
_CASTS_INPUTS_TO_WEIGHT = (eqx.nn.Conv, eqx.nn.ConvTranspose)
_CASTS_INPUTS = "_eqx_amp_casts_inputs_to_weight"


@ft.cache
def _input_cast_class(cls: type) -> type:
    """A subclass of `cls` (a convolution) whose floating inputs are cast to its
    weight's dtype as it is when called (`full_precision` may have made it float32).
    Its floating outputs are in the narrower of that dtype and the caller's: a
    float32 input to a bfloat16 convolution gives bfloat16, as the same convolution
    given bfloat16 would; a weight a filter spec keeps in float32, read by
    bfloat16 data, hands back bfloat16, as a kept layer does."""

    def __init__(self, module):
        for field in dataclasses.fields(module):
            object.__setattr__(self, field.name, getattr(module, field.name))

    def __call__(self, *args, **kwargs):
        call = ft.partial(cls.__call__, self)
        weight = getattr(self, "weight", None)
        if weight is None or not is_floating_array(weight):
            return call(*args, **kwargs)
        dtype = weight.dtype
        inputs = jtu.tree_leaves(drop_state((args, kwargs)))
        caller_dtype = widest_floating_dtype(inputs)
        if caller_dtype is None or all(
            x.dtype == dtype for x in inputs if is_floating_array(x)
        ):
            return call(*args, **kwargs)
        if caller_dtype.itemsize < dtype.itemsize:
            return call_at(call, args, kwargs, lambda _: dtype)
        args, kwargs = cast_all_but_state((args, kwargs), lambda _: dtype)
        return call(*args, **kwargs)

    namespace = {
        "__init__": __init__,
        "__call__": __call__,
        _CASTS_INPUTS: True,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
    }
    return type(cls.__name__, (cls,), namespace)


def _casts_inputs_to_weight(node: Any) -> bool:
    return isinstance(node, _CASTS_INPUTS_TO_WEIGHT) and not getattr(
        type(node), _CASTS_INPUTS, False
    )


def add_kept_boundaries(tree: PyTree, mask: PyTree[bool], dtype: np.dtype) -> PyTree:
    """Makes every callable submodule whose floating leaves are all kept run at
    `dtype`, with casts at its own call boundary; and every other convolution cast
    its inputs to its weight's dtype."""

    def replace(node: Any, node_mask: PyTree[bool]) -> Any:
        if _is_kept_layer(node, node_mask):
            return _with_boundary_class(node, dtype)
        if _casts_inputs_to_weight(node):
            return _input_cast_class(type(node))(node)
        return None

    return _replace_submodules(tree, mask, replace)


def _is_kept_layer(node: Any, node_mask: PyTree[bool]) -> bool:
    return _is_boundary_candidate(node) and _fully_kept(node, node_mask)


def _replace_submodules(
    tree: PyTree, mask: PyTree[bool], replace: Callable[[Any, PyTree[bool]], Any]
) -> PyTree:
    """`tree` with each module for which `replace(module, its mask)` is not `None`
    (looked for from the outside in) replaced by what it returns."""

    def visit(node, node_mask):
        replaced = replace(node, node_mask)
        if replaced is not None:
            return replaced
        is_child_module = lambda x: x is not node and isinstance(x, eqx.Module)  # noqa: E731
        children_leaves = jtu.tree_leaves(node, is_leaf=is_child_module)
        if not any(isinstance(c, eqx.Module) for c in children_leaves):
            return node
        return jtu.tree_map(visit, node, node_mask, is_leaf=is_child_module)

    return visit(tree, mask)


def kept_layer_names(tree: PyTree, filter_spec: FilterSpec | None) -> set[str]:
    """The classes of the submodules of `tree` that `filter_amp` (and `BiModel`)
    run in the parameter dtype at their own call boundary, because `filter_spec`
    keeps all their floating leaves (normalisation layers, by default)."""
    spec = default_filter_spec(tree) if filter_spec is None else filter_spec
    names: set[str] = set()

    def record(node: Any, node_mask: PyTree[bool]) -> Any:
        if _is_kept_layer(node, node_mask):
            names.add(type(node).__name__)
            return node
        return None

    _replace_submodules(tree, selection_mask(tree, spec), record)
    return names
