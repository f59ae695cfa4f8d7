"""Call-boundary mixed precision: `filter_amp` and `full_precision`."""

import functools as ft
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

from .._core._cast import (
    KEEP_OR_RESCALE,
    at_least_float32,
    cast_all_but_state,
    overflows_by_dtype,
    warn_if_cast_overflows,
    warn_of_overflow,
)
from .._core._describe import in_selected_modules, is_module
from .._core._filters import (
    FULL_PRECISION_SCOPE,
    FilterSpec,
    default_filter_spec,
    selection_mask,
)
from .._core._policy import Policy, get_policy, resolve_policy
from .._core._wrapper import FunctionWrapper, check_callable, user_stacklevel
from .._jaxpr._evaluate import evaluate_function
from .._sharding import ReduceInHook
from ._boundary import call_at
from ._first_call import call_checked
from ._view import amp_view, cast_arguments, check_mutable_captures, is_pytree_node


_P = ParamSpec("_P")
_T = TypeVar("_T")

_sentinel: Any = object()

_PYTREE_SPEC_NEEDS_PYTREE = (
    "`filter_spec` is a pytree, but the function passed to `filter_amp` is not an "
    "`eqx.Module`, so there is no structure for it to match. Pass the module itself "
    "(`filter_amp(model, filter_spec=spec)`), or a bool or a callable "
    "`leaf -> bool`, which is applied to every module the function closes over."
)


@runtime_checkable
class Fp8Pass(Protocol):
    """What `filter_amp(..., fp8=...)` takes (`eqx_amp.fp8.TENSORWISE`, `ROWWISE`,
    `MXFP8`):
    the object runs the call with the matmuls reading the selected parameters in
    fp8. The call reaches fp8 through it, so that this module does not import fp8."""

    def run_in_fp8(
        self,
        fn: Callable,
        args: tuple,
        kwargs: dict,
        params: list[Any],
        chosen: bool = False,
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
        fn = amp_view(self.fn, policy, self.filter_spec, {}, copies)
        cast_args, cast_kwargs = cast_arguments(args, kwargs, policy, self.arg_spec)
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
            # Modules an `fp8_filter` chose run in fp8 whatever the rule's cost
            # estimate says (`where_it_pays`).
            chosen = self.fp8_filter is not None
            out = self.fp8.run_in_fp8(fn, cast_args, cast_kwargs, params, chosen)
        elif policy.reduce_dtype == policy.compute_dtype:
            out = call_checked(self, policy, fn, cast_args, cast_kwargs)
        else:
            # Only the matmuls reading parameters change: their weight gradients are
            # emitted (and so reduced across devices) in the reduce dtype.
            out = evaluate_function(
                _call,
                (fn, cast_args, cast_kwargs),
                ReduceInHook(policy.reduce_dtype),
                params_are=is_module,
            )
        return cast_all_but_state(out, lambda _: policy.output_dtype)


def _arrays_of_selected(
    copies: list[tuple[Any, Any]], selected: Callable[[Any], Any]
) -> list[Any]:
    """The arrays of the cast copies of the modules `selected` picks among the
    originals (from the outside in: a module it picks is picked whole)."""
    found: list[Any] = []

    def visit(original, copy):
        if is_module(original) and selected(original):
            found.extend(leaf for leaf in jtu.tree_leaves(copy) if eqx.is_array(leaf))
            return
        originals = _children(original)
        copied = _children(copy)
        if len(originals) != len(copied):  # not a copy of the same structure
            return
        for child, child_copy in zip(originals, copied):
            if is_module(child):
                visit(child, child_copy)

    for original, copy in copies:
        visit(original, copy)
    return found


def _children(node: Any) -> list[Any]:
    """The leaves of `node`, its submodules (other than itself) counted as leaves."""
    return jtu.tree_leaves(node, is_leaf=lambda x: x is not node and is_module(x))


def _warn_fp8_filter_selects_nothing(copies: list[tuple[Any, Any]]) -> None:
    has_modules = any(
        is_module(node)
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
            stacklevel=user_stacklevel(),
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
            "supported yet (fp8 matmuls sum their weight gradients in the compute "
            "dtype); drop the reduce dtype, or use `autocast`, which takes both."
        )


def check_fp8_options(fp8: Any, fp8_filter: Any) -> None:
    if fp8 is not None and not isinstance(fp8, Fp8Pass):
        raise TypeError(
            "`fp8` must be `eqx_amp.fp8.TENSORWISE`, `eqx_amp.fp8.ROWWISE` or None "
            "(or `eqx_amp.fp8.MXFP8`, or a variant such as "
            f"`TENSORWISE.where_it_pays()`), but got {fp8!r}."
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
    - `fp8`: `eqx_amp.fp8.TENSORWISE`, `ROWWISE` or `MXFP8` (or a variant such as
        `TENSORWISE.where_it_pays()`) to run the matmuls reading the parameters in
        fp8 (with a compute dtype of bfloat16 or wider); `None` for none.
    - `fp8_filter`: which modules' matmuls run in fp8, a callable `module -> bool`
        asked of the modules as `filter_amp` is given them; `None` means all.

    **Returns:**

    An `AmpWrapper`: called as `fn` is, with its parameters and result type (a
    type checker sees `amp_model(x)` as `model(x)`, and no attribute of `model` on
    `amp_model`: reach those through `model` itself). It is an `eqx.Module`, so it
    can be passed through `eqx.filter_jit` and `eqx.filter_grad` like `fn` itself.
    The call traces `fn` once, as `fn` alone would be. On the first traced call of
    each model class under each policy, less than half of the matmul FLOPs in the
    compute dtype is warned of (`eqx_amp.diagnostics.CoverageWarning`, with the
    cause and the fix); `eqx_amp.precision_report(amp_model, x)` shows the rest.

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
    check_fp8_options(fp8, fp8_filter)
    if policy is not None:
        policy = get_policy(policy)
    _check_filter_spec(fn, filter_spec)
    _check_arg_spec(arg_spec)
    check_mutable_captures(fn)
    overflows = _warn_if_weights_overflow(fn, policy, filter_spec)
    fp8_selected = None
    if fp8_filter is not None and (isinstance(fn, eqx.Module) or is_pytree_node(fn)):
        # Asked now, of the module given: the wrapper below holds a rebuilt copy.
        fp8_selected = in_selected_modules(fn, fp8_filter)
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
    if not (isinstance(fn, eqx.Module) or is_pytree_node(fn)):
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
    if isinstance(fn, eqx.Module) or is_pytree_node(fn):
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
        if isinstance(fn, eqx.Module) or is_pytree_node(fn):
            fn = cast_all_but_state(fn, at_least_float32)
        with jax.named_scope(FULL_PRECISION_SCOPE):
            return call_at(fn, args, kwargs, at_least_float32)


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
