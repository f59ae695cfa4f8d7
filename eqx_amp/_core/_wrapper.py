"""The base of the callables eqx_amp returns."""

import abc
import functools as ft
import inspect
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, Self, TypeVar, overload

import equinox as eqx
import jax
import jaxtyping


_P = ParamSpec("_P")
_T = TypeVar("_T")
_BoundP = ParamSpec("_BoundP")


class FunctionWrapper(eqx.Module, Generic[_P, _T]):
    """Like Equinox's own transform wrappers, the callables eqx_amp returns are
    `eqx.Module`s (so they are pytrees: the wrapped module's arrays stay visible to
    `eqx.filter_jit` and `eqx.filter_grad`), report what they wrap as `__wrapped__`
    (for `eqx.module_update_wrapper`), and bind as methods when stored on a class.

    Generic in the wrapped callable's parameters and result, so that a type checker
    sees a wrapper called as what it wraps (`filter_amp(model)(x)` has the type of
    `model(x)`), and not as the wrapped class (`filter_amp(model).layers` is an
    error: the wrapper has no such attribute)."""

    fn: eqx.AbstractVar[Callable[_P, _T]]

    @abc.abstractmethod
    def __call__(self, /, *args: _P.args, **kwargs: _P.kwargs) -> _T: ...

    @property
    def __wrapped__(self) -> Callable[_P, _T]:
        return self.fn

    @overload
    def __get__(self, instance: None, owner: Any) -> Self: ...

    @overload
    def __get__(
        self: "FunctionWrapper[Concatenate[Any, _BoundP], _T]",
        instance: object,
        owner: Any,
    ) -> Callable[_BoundP, _T]: ...

    @overload
    def __get__(self, instance: object, owner: Any) -> Callable[..., _T]: ...

    def __get__(self, instance: object, owner: Any) -> Any:
        del owner
        if instance is None:
            return self
        return eqx.Partial(self, instance)


def check_callable(fn: Any, transform: str) -> None:
    """Fails where a transform is applied, not where its result is first called."""
    if not callable(fn):
        raise TypeError(
            f"`{transform}` takes a callable (a function or an `eqx.Module`), but got "
            f"{type(fn).__name__}."
        )


_PACKAGE = __name__.partition(".")[0]
# Frames in these directories are library code: a warning about the user's program
# points past them, at the user's own line.
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(str(module.__file__))) + os.sep
    for module in (jax, eqx, jaxtyping)
) + (os.path.dirname(os.path.abspath(str(sys.modules[_PACKAGE].__file__))) + os.sep,)


def user_stacklevel() -> int:
    """The `stacklevel` for a `warnings.warn` made by the function calling this one
    that points at the innermost line of user code: the first frame outside
    eqx_amp, JAX and Equinox. A call traced by `jax.jit` or `jax.vmap` runs below
    their frames, where a fixed stacklevel would name a line of JAX. Add one per call
    between the caller and `warnings.warn`, none where the caller warns itself:

    ```python
    warnings.warn(message, stacklevel=user_stacklevel())
    warn_of_overflow(paths, dtype, ..., stacklevel=user_stacklevel() + 1)
    ```
    """
    frame = inspect.currentframe()
    # Level 1 is the function calling this one; warnings count from there.
    frame = frame.f_back.f_back if frame and frame.f_back else None
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame = frame.f_back
        level += 1
    return level if frame is not None else 2


@ft.cache
def warn_once(message: str) -> None:
    """Warns `message` at the user's line, once per process (a warning made while a
    program is traced, which may be traced again)."""
    warnings.warn(message, stacklevel=user_stacklevel())
