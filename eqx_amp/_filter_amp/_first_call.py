"""The way the coverage warning reaches `filter_amp`'s call path.

The check lives with the diagnostics, which this floor may not import:
`eqx_amp/__init__` registers it (`register_coverage_check`) when the package is
imported, as `filter_amp(..., fp8=...)` reaches fp8 through the rule it is given.
A call runs it only on the first traced call of each model class under each policy
(the warning is said once for them anyway); every other call is the plain call."""

import contextlib
import functools as ft
import types
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Protocol

import equinox as eqx
import jax.tree_util as jtu

from .._core._cast import is_half_dtype
from .._core._policy import Policy
from .._jaxpr import _compat as compat


class CoverageCheck(Protocol):
    """What `register_coverage_check` takes: runs a call as the call itself would,
    tracing `fn` once, and warns where the call leaves most matmuls wide."""

    def run_checked(
        self, wrapper: Any, fn: Callable, args: tuple, kwargs: dict
    ) -> Any: ...


# The registered check (none, or one), and the (model, policy) keys it has run for.
_check: list[CoverageCheck] = []
_checked: set[tuple[Hashable, Policy]] = set()


def register_coverage_check(check: CoverageCheck | None) -> None:
    """Makes `check` the one `filter_amp`'s first calls run (`None`: none), and
    forgets which models were checked, so each is checked again once."""
    _check[:] = [] if check is None else [check]
    _checked.clear()


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """No call is checked inside: `precision_report` gives the advice itself.

    ```python
    with unchecked():
        closed = trace(fn, args, kwargs)
    ```
    """
    saved = _check[:]
    _check.clear()
    try:
        yield
    finally:
        _check[:] = saved


def call_checked(
    wrapper: Any, policy: Policy, fn: Callable, args: tuple, kwargs: dict
) -> Any:
    """`fn(*args, **kwargs)`, through the registered check on the first traced call
    of `wrapper`'s model under `policy`:

    ```python
    out = call_checked(self, policy, view, cast_args, cast_kwargs)
    ```
    """
    if _check and is_half_dtype(policy.compute_dtype):
        key = (model_key(wrapper.fn), policy)
        # Concrete calls are left to the call itself: where a call is traced (under
        # `jit`, `vmap`, `grad`) is where a once-only trace costs least.
        if key not in _checked and _is_traced((fn, args, kwargs)):
            _checked.add(key)
            return _check[0].run_checked(wrapper, fn, args, kwargs)
    return fn(*args, **kwargs)


def _is_traced(tree: Any) -> bool:
    return any(map(compat.is_traced, jtu.tree_leaves(tree)))


def model_key(fn: Any) -> Hashable:
    """What makes two models the same model to warn about: a module's class (with
    its layers for `eqx.nn.Sequential`, with what it wraps for a transform such as
    `eqx.filter_vmap`), a function's code.

    ```python
    model_key(eqx.filter_vmap(rnn)) == (type(eqx.filter_vmap(rnn)), RNN)
    ```
    """
    if isinstance(fn, eqx.nn.Sequential):
        return (type(fn), *map(model_key, fn.layers))
    if isinstance(fn, ft.partial):
        return model_key(fn.func)
    if isinstance(fn, types.MethodType):
        return (model_key(fn.__self__), fn.__func__)
    wrapped = getattr(fn, "__wrapped__", None)
    if wrapped is not None and wrapped is not fn:
        return (type(fn), model_key(wrapped))
    if isinstance(fn, types.FunctionType):
        return fn.__code__
    return type(fn)
