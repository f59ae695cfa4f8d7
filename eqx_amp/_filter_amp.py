"""Call-boundary mixed precision: `filter_amp` and `full_precision`."""

import dataclasses
import functools as ft
import operator
import types
import warnings
from collections.abc import Callable
from typing import (
    Any,
    ParamSpec,
    Protocol,
    TypeVar,
    cast,
    overload,
    runtime_checkable,
)

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from ._cast import (
    KEEP_OR_RESCALE,
    at_least_float32,
    cast_all_but_state,
    cast_leaf,
    drop_state,
    is_floating_array,
    overflows_by_dtype,
    warn_if_cast_overflows,
    warn_of_overflow,
    widest_floating_dtype,
)
from ._filters import (
    FULL_PRECISION_SCOPE,
    SELF_CASTING_LAYERS,
    STATE_TYPES,
    FilterSpec,
    default_filter_spec,
    selection_mask,
)
from ._jaxpr._evaluate import evaluate_function
from ._jaxpr._hook import Origin, leaf_origins
from ._policy import Policy, get_policy, resolve_policy
from ._sharding import ReduceInHook
from ._wrapper import FunctionWrapper, check_callable, user_stacklevel


_P = ParamSpec("_P")
_T = TypeVar("_T")

_sentinel: Any = object()

_PYTREE_SPEC_NEEDS_PYTREE = (
    "`filter_spec` is a pytree, but the function passed to `filter_amp` is not an "
    "`eqx.Module`, so there is no structure for it to match. Pass the module itself "
    "(`filter_amp(model, filter_spec=spec)`), or a bool or a callable "
    "`leaf -> bool`, which is applied to every module the function closes over."
)


#
# Running a function at another dtype, with casts at its boundary.
#


def _call_at(
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
        return _call_at(ft.partial(cls.__call__, self), args, kwargs, lambda _: dtype)

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
    """True when `node` has floating arrays and the spec keeps all of them."""
    selected = [
        sel
        for leaf, sel in zip(jtu.tree_leaves(node), jtu.tree_leaves(mask))
        if is_floating_array(leaf)
    ]
    return bool(selected) and not any(selected)


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
# instead: only calls that would have failed change.
_CASTS_INPUTS_TO_WEIGHT = (eqx.nn.Conv, eqx.nn.ConvTranspose)
_CASTS_INPUTS = "_eqx_amp_casts_inputs_to_weight"


@ft.cache
def _input_cast_class(cls: type) -> type:
    """A subclass of `cls` (a convolution) whose floating inputs are cast to its
    weight's dtype as it is when called (`full_precision` may have made it float32),
    and whose floating outputs are then cast back to the caller's dtype."""

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
        if all(x.dtype == dtype for x in inputs if is_floating_array(x)):
            return call(*args, **kwargs)
        return _call_at(call, args, kwargs, lambda _: dtype)

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


def _add_kept_boundaries(tree: PyTree, mask: PyTree[bool], dtype: np.dtype) -> PyTree:
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


def _cast_arguments(
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
    return _add_kept_boundaries(cast, mask, policy.param_dtype)


def _amp_view(
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
    view = lambda x: _amp_view(x, policy, filter_spec, memo, copies)  # noqa: E731
    if isinstance(fn, eqx.Module) or _is_pytree_node(fn) or is_floating_array(fn):
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


def _check_mutable_captures(fn: Any, seen: set | None = None) -> None:
    """Fails where a function closes over a list or dict of weights."""
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return
    seen.add(id(fn))
    if isinstance(fn, types.MethodType):
        return _check_mutable_captures(fn.__func__, seen)
    if isinstance(fn, ft.partial):
        for item in (fn.func, *fn.args, *fn.keywords.values()):
            _check_mutable_captures(item, seen)
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
            _check_mutable_captures(value, seen)


def _holds_weights(container: Any) -> bool:
    is_module = lambda x: isinstance(x, eqx.Module)  # noqa: E731
    return any(
        is_module(leaf) or is_floating_array(leaf)
        for leaf in jtu.tree_leaves(container, is_leaf=is_module)
    )


def _is_pytree_node(obj: Any) -> bool:
    """Registered pytree nodes other than plain containers (those are handled with
    the closure logic so that functions inside them are looked into too)."""
    if isinstance(obj, (list, tuple, dict)) or obj is None:
        return False
    return jtu.treedef_is_leaf(jtu.tree_structure(obj)) is False


@runtime_checkable
class Fp8Pass(Protocol):
    """What `filter_amp(..., fp8=...)` takes (`eqx_amp.fp8.TENSORWISE`, `ROWWISE`):
    the object runs the call with the matmuls reading the selected parameters in
    fp8. The call reaches fp8 through it, so that this module does not import fp8."""

    def run_in_fp8(
        self, fn: Callable, args: tuple, kwargs: dict, params: list[Any]
    ) -> Any: ...


class AmpWrapper(FunctionWrapper[_P, _T]):
    """What `filter_amp(fn)` returns: called as `fn` is, with its parameters and
    result type."""

    fn: Callable[_P, _T]
    # `None`: the default policy where the call is traced (`eqx_amp.using_policy`).
    policy: Policy | None = eqx.field(static=True)
    filter_spec: FilterSpec | None
    arg_spec: FilterSpec | None = None
    fp8: Fp8Pass | None = eqx.field(static=True, default=None)
    fp8_filter: Callable[[eqx.Module], bool] | None = eqx.field(
        static=True, default=None
    )
    # With `policy=None`: the weights too large for each dtype but the one in force
    # where `filter_amp` was applied (warned about there), as
    # `overflows_by_dtype` gives them; said where the policy is read.
    weight_overflows: tuple = eqx.field(static=True, default=())
    # `fp8_filter` applied to the module `filter_amp` was given, one bool per leaf
    # (asked then: Equinox rebuilds modules, so an identity test would fail later).
    fp8_selected: tuple[bool, ...] | None = eqx.field(static=True, default=None)

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        policy = resolve_policy(self.policy)
        warn_of_overflow(
            dict(self.weight_overflows).get(policy.compute_dtype.name, ()),
            policy.compute_dtype,
            cast_by=_CASTS_WEIGHTS_TO,
            fix=KEEP_OR_RESCALE,
            stacklevel=user_stacklevel() + 1,  # warned one call down
        )
        copies: list[tuple[Any, Any]] = []
        fn = _amp_view(self.fn, policy, self.filter_spec, {}, copies)
        cast_args, cast_kwargs = _cast_arguments(args, kwargs, policy, self.arg_spec)
        copies.append(((args, kwargs), (cast_args, cast_kwargs)))
        if self.fp8 is not None:
            _check_fp8_policy(policy)
            # The arrays of the modules the filter selects are the parameters whose
            # matmuls run in fp8. It is asked about the modules as they were given
            # (`m is model.head` holds for them, not for their cast copies), and
            # their arrays are found in the function's closure too.
            selected = self.fp8_filter or (lambda module: True)
            if self.fp8_selected is None:
                params = _arrays_of_selected(copies, selected)
            else:  # the module given: asked when `filter_amp` was applied
                params = [
                    leaf
                    for leaf, picked in zip(jtu.tree_leaves(fn), self.fp8_selected)
                    if picked and eqx.is_array(leaf)
                ]
                params += _arrays_of_selected(copies[-1:], selected)  # the arguments
            if not params and self.fp8_filter is not None:
                _warn_fp8_filter_selects_nothing(copies)
            out = self.fp8.run_in_fp8(fn, cast_args, cast_kwargs, params)
        elif policy.reduce_dtype == policy.compute_dtype:
            out = fn(*cast_args, **cast_kwargs)
        else:
            # Only the matmuls reading parameters change: their weight gradients are
            # emitted (and so reduced across devices) in the reduce dtype.
            out = evaluate_function(
                _call,
                (fn, cast_args, cast_kwargs),
                ReduceInHook(policy.reduce_dtype),
                params_are=_is_module,
            )
        return cast_all_but_state(out, lambda _: policy.output_dtype)


def _arrays_of_selected(
    copies: list[tuple[Any, Any]], selected: Callable[[Any], Any]
) -> list[Any]:
    """The arrays of the cast copies of the modules `selected` picks among the
    originals (from the outside in: a module it picks is picked whole)."""
    found: list[Any] = []

    def visit(original, copy):
        if _is_module(original) and selected(original):
            found.extend(leaf for leaf in jtu.tree_leaves(copy) if eqx.is_array(leaf))
            return
        originals = _children(original)
        copied = _children(copy)
        if len(originals) != len(copied):  # not a copy of the same structure
            return
        for child, child_copy in zip(originals, copied):
            if _is_module(child):
                visit(child, child_copy)

    for original, copy in copies:
        visit(original, copy)
    return found


def _children(node: Any) -> list[Any]:
    """The leaves of `node`, its submodules (other than itself) counted as leaves."""
    return jtu.tree_leaves(node, is_leaf=lambda x: x is not node and _is_module(x))


def fp8_selection(tree: Any, fp8_filter: Callable[[Any], Any]) -> tuple[bool, ...]:
    """One bool per leaf of `tree`: in a module `fp8_filter` selects, asked from the
    outside in (a module it selects is selected whole)."""

    def picked(node: Any) -> bool:
        return _is_module(node) and bool(fp8_filter(node))

    return tuple(origin is Origin.PARAMS for origin in leaf_origins(tree, picked))


def _warn_fp8_filter_selects_nothing(copies: list[tuple[Any, Any]]) -> None:
    has_modules = any(
        _is_module(node)
        for original, _ in copies
        for node in [original, *_children(original)]
    )
    if has_modules:
        warnings.warn(
            "`fp8_filter` selected no module with arrays, so no matmul runs in fp8. "
            "It is asked about the modules as `filter_amp` is given them (and as "
            "passed to the call): an identity test (`m is model.head`) fails for a "
            "copy, and `eqx.filter_vmap(model)`, `eqx.filter_jit`, `eqx.filter_grad` "
            "and optimizer updates all hold or pass rebuilt copies. Select by type or "
            "attribute, apply `filter_amp` to the model itself (`jax.vmap(filter_amp("
            "model, ...))`), or use `BiModel`.",
            stacklevel=user_stacklevel() + 1,
        )


def _check_fp8_policy(policy: Policy) -> None:
    if policy.compute_dtype.itemsize < 2:
        raise ValueError(
            "fp8 matmuls quantise their operands from the compute dtype and return "
            "products in it, so the compute dtype must be bfloat16, float16 or "
            f"wider, but the policy is {policy}."
        )
    if policy.reduce_dtype != policy.compute_dtype:
        raise ValueError(
            "`filter_amp(..., fp8=...)` with a `Policy.reduce_dtype` is not "
            "supported yet. fp8 matmuls already sum their weight gradients in "
            "float32; drop the reduce dtype, or use `autocast`, which takes both."
        )


def _check_fp8_options(fp8: Any, fp8_filter: Any) -> None:
    if fp8 is not None and not isinstance(fp8, Fp8Pass):
        raise TypeError(
            "`fp8` must be `eqx_amp.fp8.TENSORWISE`, `eqx_amp.fp8.ROWWISE` or None, but got "
            f"{fp8!r}."
        )
    if fp8_filter is not None:
        if fp8 is None:
            raise ValueError("`fp8_filter` selects modules for `fp8=`, which is None.")
        if not callable(fp8_filter):
            raise TypeError(
                "`fp8_filter` must be a callable `module -> bool` (which modules' "
                f"matmuls run in fp8), but got {type(fp8_filter).__name__}."
            )


def _call(fn: Callable, args: tuple, kwargs: dict) -> Any:
    return fn(*args, **kwargs)


def _is_module(node: Any) -> bool:
    return isinstance(node, eqx.Module)


@overload
def filter_amp(
    fn: Callable[_P, _T],
    *,
    policy: Policy | str | None = None,
    filter_spec: FilterSpec | None = None,
    arg_spec: FilterSpec | None = None,
    fp8: Fp8Pass | None = None,
    fp8_filter: Callable[[eqx.Module], bool] | None = None,
) -> AmpWrapper[_P, _T]: ...


@overload
def filter_amp(
    *,
    policy: Policy | str | None = None,
    filter_spec: FilterSpec | None = None,
    arg_spec: FilterSpec | None = None,
    fp8: Fp8Pass | None = None,
    fp8_filter: Callable[[eqx.Module], bool] | None = None,
) -> Callable[[Callable[_P, _T]], AmpWrapper[_P, _T]]: ...


def filter_amp(
    fn: Callable = _sentinel,
    *,
    policy: Policy | str | None = None,
    filter_spec: FilterSpec | None = None,
    arg_spec: FilterSpec | None = None,
    fp8: Fp8Pass | None = None,
    fp8_filter: Callable[[eqx.Module], bool] | None = None,
) -> Any:
    """Runs `fn` in mixed precision, casting at its call boundary.

    On each call, the floating leaves of `fn` that `filter_spec` selects and every
    floating array argument are cast to the compute dtype; `fn` runs; floating
    outputs are cast to the output dtype. A submodule whose floating leaves are all
    kept by the spec (normalisation layers, by default) runs in the parameter dtype,
    with casts at its own call boundary. `eqx.nn.State` is never cast. Gradients
    taken through the call arrive in the dtype of the parameters (the master dtype).

    **Arguments:**

    - `fn`: an `eqx.Module`, a method bound to one, a `functools.partial`, a closure
        over modules, or any callable. Arrays `fn` holds in a module, a partial or a
        closure are cast; module-level globals are not.
    - `policy`: a `Policy` or a policy string; `None` means `default_policy()` where
        the call is traced (set it once with `eqx_amp.using_policy`).
    - `filter_spec`: which floating leaves of `fn` are cast, as `eqx.partition`
        accepts; `None` means `default_filter_spec(fn)`. A pytree spec needs `fn` to
        be a module.
    - `arg_spec`: which floating arguments of a call are cast: a bool, a callable
        `leaf -> bool`, or a pytree prefix of `(args, kwargs)` (`((False, True),
        {})` keeps the first positional argument, a diffusion model's time, in its
        dtype). `None` casts every floating argument. `eqx.nn.State` never is.
    - `fp8`: `eqx_amp.fp8.TENSORWISE` or `ROWWISE` to run the matmuls reading the
        parameters in fp8 (with a compute dtype of bfloat16 or wider); `None` for
        none.
    - `fp8_filter`: which modules' matmuls run in fp8, a callable `module -> bool`
        asked of the modules as `filter_amp` is given them; `None` means all.

    **Returns:**

    An `AmpWrapper`: called as `fn` is, with its parameters and result type (a
    type checker sees `amp_model(x)` as `model(x)`, and no attribute of `model` on
    `amp_model`: reach those through `model` itself). It is an `eqx.Module`, so it
    can be passed through `eqx.filter_jit` and `eqx.filter_grad` like `fn` itself.
    The call traces `fn` once, as `fn` alone would be; run
    `eqx_amp.precision_report(amp_model, x)` once on a new model to see how much of
    it runs in the compute dtype, and why the rest does not.

    **Example:**

    ```python
    model = eqx.nn.MLP(784, 10, 256, 2, key=jax.random.key(0))
    amp_model = eqx_amp.filter_amp(model, policy="mixed_bfloat16")
    logits = jax.vmap(amp_model)(images)  # matmuls in bfloat16, logits in float32

    @eqx_amp.filter_amp
    def loss_fn(model, x, y): ...
    ```
    """
    if fn is _sentinel:
        return ft.partial(
            filter_amp,
            policy=policy,
            filter_spec=filter_spec,
            arg_spec=arg_spec,
            fp8=fp8,
            fp8_filter=fp8_filter,
        )
    check_callable(fn, "filter_amp")
    _check_fp8_options(fp8, fp8_filter)
    if policy is not None:
        policy = get_policy(policy)
    _check_filter_spec(fn, filter_spec)
    _check_arg_spec(arg_spec)
    _check_mutable_captures(fn)
    overflows = _warn_if_weights_overflow(fn, policy, filter_spec)
    fp8_selected = None
    if fp8_filter is not None and (isinstance(fn, eqx.Module) or _is_pytree_node(fn)):
        # Asked now, of the module given: the wrapper below holds a rebuilt copy.
        fp8_selected = fp8_selection(fn, fp8_filter)
    wrapper = AmpWrapper(
        cast(Callable, fn),  # the `isinstance` above narrowed it to a Module
        policy,
        filter_spec,
        arg_spec,
        fp8,
        fp8_filter,
        weight_overflows=overflows,
        fp8_selected=fp8_selected,
    )
    # Not `eqx.module_update_wrapper`'s return type, `Callable[_P, _T]`: the wrapper
    # itself, with its type.
    return cast(AmpWrapper, eqx.module_update_wrapper(wrapper))


_CASTS_WEIGHTS_TO = "`filter_amp` casts the weights to"


def _warn_if_weights_overflow(
    fn: Any, policy: Policy | None, filter_spec: FilterSpec | None
) -> tuple:
    """Says where the weights are concrete (not inside `jit`) that some will be
    cast to inf, when `filter_amp` is applied. With no policy, the one in force
    now is checked, and what other compute dtypes would make inf is returned, for
    the call to say where a `using_policy` block sets one."""
    if not (isinstance(fn, eqx.Module) or _is_pytree_node(fn)):
        return ()
    spec = default_filter_spec(fn) if filter_spec is None else filter_spec
    mask = selection_mask(fn, spec)
    if policy is not None:
        warn_if_cast_overflows(
            fn,
            policy.compute_dtype,
            mask,
            cast_by=_CASTS_WEIGHTS_TO,
            fix=KEEP_OR_RESCALE,
            stacklevel=4,
        )
        return ()
    now = resolve_policy(None).compute_dtype
    overflows = dict(overflows_by_dtype(fn, mask))
    warn_of_overflow(
        overflows.pop(now.name, ()),
        now,
        cast_by=_CASTS_WEIGHTS_TO,
        fix=KEEP_OR_RESCALE,
        stacklevel=4,
    )
    return tuple(overflows.items())


_AMBIGUOUS_ARG_SPEC = (
    "`arg_spec={spec!r}` is ambiguous: a sequence is read as a pytree prefix of the "
    "call's `(args, kwargs)`, whose first entry must be a tuple with one entry per "
    "positional argument. For one flag per positional argument, nest it: "
    "`arg_spec=({flags}, {{}})`. For one flag for all positional arguments and one "
    "for all keyword arguments, use a callable `leaf -> bool` or spell the "
    "positional ones out."
)


def _check_arg_spec(arg_spec: Any) -> None:
    """Refuses `(False, True)`: two positional flags, or "positional arguments
    kept, keyword arguments cast"? It was silently read as the latter."""
    if isinstance(arg_spec, (tuple, list)) and not (
        len(arg_spec) == 2 and isinstance(arg_spec[0], (tuple, list))
    ):
        flags = tuple(arg_spec) if len(arg_spec) != 1 else f"({arg_spec[0]!r},)"
        raise ValueError(_AMBIGUOUS_ARG_SPEC.format(spec=arg_spec, flags=flags))


def _check_filter_spec(fn: Any, filter_spec: FilterSpec | None) -> None:
    """Fails at `filter_amp(...)` rather than at the first call, from inside a jit."""
    if filter_spec is None:
        return
    if isinstance(fn, eqx.Module) or _is_pytree_node(fn):
        selection_mask(fn, filter_spec)
    elif not (isinstance(filter_spec, bool) or callable(filter_spec)):
        raise ValueError(_PYTREE_SPEC_NEEDS_PYTREE)


#
# full_precision
#


class FullPrecisionWrapper(FunctionWrapper[_P, _T]):
    """What `full_precision(fn)` returns: called as `fn` is, with its parameters
    and result type."""

    fn: Callable[_P, _T]

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        fn = self.fn
        if isinstance(fn, eqx.Module) or _is_pytree_node(fn):
            fn = cast_all_but_state(fn, at_least_float32)
        with jax.named_scope(FULL_PRECISION_SCOPE):
            return _call_at(fn, args, kwargs, at_least_float32)


class _FullPrecisionScope:
    """`with full_precision():` opens a named scope that `autocast` keeps at the
    traced dtypes; `@full_precision()` decorates like `@full_precision`."""

    def __init__(self):
        self._open_scopes = []

    def __enter__(self):
        scope = jax.named_scope(FULL_PRECISION_SCOPE)
        scope.__enter__()
        self._open_scopes.append(scope)

    def __exit__(self, *exc_info):
        return self._open_scopes.pop().__exit__(*exc_info)

    def __call__(self, fn: Callable[_P, _T]) -> FullPrecisionWrapper[_P, _T]:
        return full_precision(fn)


@overload
def full_precision(fn: Callable[_P, _T]) -> FullPrecisionWrapper[_P, _T]: ...


@overload
def full_precision(fn: None = None) -> _FullPrecisionScope: ...


def full_precision(
    fn: Callable | None = None,
) -> FullPrecisionWrapper | _FullPrecisionScope:
    """Runs a function in float32 inside mixed-precision code.

    As a decorator (`@full_precision` or `full_precision(fn)`), `fn` runs in float32:
    narrower floating inputs (and the floating leaves of `fn`, if it is a module) are
    cast up, and floating outputs are cast back to the widest floating input dtype of
    the call, so the code around it sees no change. As a context manager
    (`with full_precision():`), the ops inside are kept at the dtypes they were traced
    with by `autocast`.

    **Arguments:**

    - `fn`: the function or module to run in float32, or nothing for the
        context-manager form.

    **Example:**

    ```python
    @eqx_amp.full_precision
    def attention_weights(logits):
        return jax.nn.softmax(logits)  # float32 even when `logits` is bfloat16

    with eqx_amp.full_precision():
        y = jnp.exp(x)  # kept as traced under `autocast`
    ```
    """
    if fn is None:
        return _FullPrecisionScope()
    if not callable(fn):
        raise TypeError(
            "`full_precision` takes a callable to decorate, or no argument for the "
            f"context-manager form, but got {type(fn).__name__}."
        )
    return cast(
        FullPrecisionWrapper, eqx.module_update_wrapper(FullPrecisionWrapper(fn))
    )
