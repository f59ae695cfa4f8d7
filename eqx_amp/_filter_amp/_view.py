"""Views of a callable with its parameters cast: a module's selected leaves, a
function's closure and defaults, the arguments `arg_spec` selects."""

import functools as ft
import operator
import types
from collections.abc import Callable
from typing import (
    Any,
)

import equinox as eqx
import jax.tree_util as jtu
from jaxtyping import PyTree

from .._core._cast import (
    cast_leaf,
    is_floating_array,
)
from .._core._filters import (
    FilterSpec,
    default_filter_spec,
    selection_mask,
)
from .._core._policy import Policy
from ._boundary import add_kept_boundaries


#
# Views of a callable with its parameters cast.
#


def _cast_module(
    tree: PyTree, policy: Policy, filter_spec: FilterSpec | None
) -> PyTree:
    spec = default_filter_spec(tree) if filter_spec is None else filter_spec
    return _cast_selected(tree, selection_mask(tree, spec), policy)


_ARG_SPEC_MISMATCH = (
    "`arg_spec` does not fit the arguments `({args}, {kwargs})` of this call: it "
    "must be a bool, a callable `leaf -> bool`, or a pytree prefix of `(args, "
    "kwargs)`, such as `((False, True), {{}})` to keep the first positional argument "
    "in its dtype. ({error})"
)


def cast_arguments(
    args: tuple, kwargs: dict, policy: Policy, arg_spec: FilterSpec | None
) -> tuple[tuple, dict]:
    """The call's floating arguments cast to the compute dtype, those `arg_spec`
    selects (all by default); `eqx.nn.State` never."""
    tree = (args, kwargs)
    default = selection_mask(tree, default_filter_spec(tree))
    if arg_spec is None:
        return _cast_selected(tree, default, policy)
    try:
        chosen = selection_mask(tree, arg_spec)
    except ValueError as error:
        raise ValueError(
            _ARG_SPEC_MISMATCH.format(
                args=f"{len(args)} positional", kwargs=sorted(kwargs), error=error
            )
        ) from None
    return _cast_selected(tree, jtu.tree_map(operator.and_, chosen, default), policy)


def _cast_selected(tree: PyTree, mask: PyTree[bool], policy: Policy) -> PyTree:
    compute = policy.compute_dtype
    cast = jtu.tree_map(
        lambda selected, leaf: cast_leaf(leaf, compute) if selected else leaf,
        mask,
        tree,
    )
    return add_kept_boundaries(cast, mask, policy.param_dtype)


def amp_view(
    fn: Any,
    policy: Policy,
    filter_spec: FilterSpec | None,
    memo: dict[int, Any],
    copies: list[tuple[Any, Any]] | None = None,
) -> Any:
    """`fn` with the floating leaves it holds cast to the compute dtype: the leaves of
    a module, of the object a method is bound to, of the arguments of a
    `functools.partial`, and of the values a function closes over or takes as
    defaults. Lists, dicts and other mutable objects are passed as they are (never
    copied), so a function's changes to them are seen. `memo` maps each object seen
    to its view, so that a recursive function calls its own view; `copies` gets
    each pytree cast and its cast copy."""
    key = id(fn)
    if key in memo:
        return memo[key]
    view = lambda x: amp_view(x, policy, filter_spec, memo, copies)  # noqa: E731
    if isinstance(fn, eqx.Module) or is_pytree_node(fn) or is_floating_array(fn):
        memo[key] = _cast_module(fn, policy, filter_spec)
        if copies is not None:
            copies.append((fn, memo[key]))
    elif isinstance(fn, types.MethodType):
        memo[key] = types.MethodType(fn.__func__, view(fn.__self__))
    elif isinstance(fn, ft.partial):
        memo[key] = ft.partial(
            view(fn.func),
            *map(view, fn.args),
            **{k: view(v) for k, v in fn.keywords.items()},
        )
    elif isinstance(fn, types.FunctionType):
        _function_view(fn, view, memo)
    elif isinstance(fn, tuple):
        items = [view(item) for item in fn]
        memo[key] = type(fn)(*items) if hasattr(fn, "_fields") else tuple(items)
    else:
        memo[key] = fn
    return memo[key]


def _function_view(fn: types.FunctionType, view: Callable, memo: dict) -> None:
    if not (fn.__closure__ or fn.__defaults__ or fn.__kwdefaults__):
        memo[id(fn)] = fn
        return
    # The new function is in `memo` before its cells are filled: a cell holding the
    # function itself (a recursive local function) then holds the new one.
    cells = tuple(types.CellType() for _ in fn.__closure__ or ())
    new_fn = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, None, cells)
    memo[id(fn)] = new_fn
    for cell, new_cell in zip(fn.__closure__ or (), cells):
        try:
            new_cell.cell_contents = view(cell.cell_contents)
        except ValueError:  # A cell not yet filled: it stays empty.
            pass
    if fn.__defaults__:
        new_fn.__defaults__ = tuple(map(view, fn.__defaults__))
    if fn.__kwdefaults__:
        new_fn.__kwdefaults__ = {k: view(v) for k, v in fn.__kwdefaults__.items()}
    new_fn.__dict__.update(fn.__dict__)
    new_fn.__qualname__ = fn.__qualname__


_MUTABLE_HOLDS_WEIGHTS = (
    "`filter_amp` was given a function that closes over {what} `{name}` holding "
    "modules or floating arrays. Lists and dicts are passed to the function as they "
    "are, never copied (so that its changes to them are seen), and so their weights "
    "would not be cast. Hold them in a tuple or an `eqx.Module`, or pass them as an "
    "argument."
)


def check_mutable_captures(fn: Any, seen: set | None = None) -> None:
    """Fails where a function closes over a list or dict of weights."""
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return
    seen.add(id(fn))
    if isinstance(fn, types.MethodType):
        return check_mutable_captures(fn.__func__, seen)
    if isinstance(fn, ft.partial):
        for item in (fn.func, *fn.args, *fn.keywords.values()):
            check_mutable_captures(item, seen)
        return
    if not isinstance(fn, types.FunctionType):
        return
    names = fn.__code__.co_freevars
    captured = []
    for name, cell in zip(names, fn.__closure__ or ()):
        try:
            captured.append((name, cell.cell_contents))
        except ValueError:
            continue
    defaults = fn.__defaults__ or ()
    captured += [(f"default argument {i}", d) for i, d in enumerate(defaults)]
    captured += list((fn.__kwdefaults__ or {}).items())
    for name, value in captured:
        if isinstance(value, (list, dict, set)) and _holds_weights(value):
            what = "a list" if isinstance(value, list) else f"a {type(value).__name__}"
            raise TypeError(_MUTABLE_HOLDS_WEIGHTS.format(what=what, name=name))
        if isinstance(value, (types.FunctionType, ft.partial, types.MethodType)):
            check_mutable_captures(value, seen)


def _holds_weights(container: Any) -> bool:
    is_module = lambda x: isinstance(x, eqx.Module)  # noqa: E731
    return any(
        is_module(leaf) or is_floating_array(leaf)
        for leaf in jtu.tree_leaves(container, is_leaf=is_module)
    )


def is_pytree_node(obj: Any) -> bool:
    """Registered pytree nodes other than plain containers (those are handled with
    the closure logic so that functions inside them are looked into too)."""
    if isinstance(obj, (list, tuple, dict)) or obj is None:
        return False
    return jtu.treedef_is_leaf(jtu.tree_structure(obj)) is False
