"""The base of the callables eqx_amp returns."""

import abc
import inspect
import os
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jaxtyping


class FunctionWrapper(eqx.Module):
    """Like Equinox's own transform wrappers, the callables eqx_amp returns are
    `eqx.Module`s (so they are pytrees: the wrapped module's arrays stay visible to
    `eqx.filter_jit` and `eqx.filter_grad`), report what they wrap as `__wrapped__`
    (for `eqx.module_update_wrapper`), and bind as methods when stored on a class."""

    fn: eqx.AbstractVar[Callable]

    @abc.abstractmethod
    def __call__(self, /, *args: Any, **kwargs: Any) -> Any: ...

    @property
    def __wrapped__(self) -> Callable:
        return self.fn

    def __get__(self, instance, owner):
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


# Frames in these directories are library code: a warning about the user's program
# points past them, at the user's own line.
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(str(module.__file__))) + os.sep
    for module in (jax, eqx, jaxtyping)
) + (os.path.dirname(os.path.abspath(__file__)) + os.sep,)


def user_stacklevel() -> int:
    """The `stacklevel` for a `warnings.warn` made by the function calling this one
    that points at the innermost line of user code: the first frame outside
    eqx_amp, JAX and Equinox. A call traced by `jax.jit` or `jax.vmap` runs below
    their frames, where a fixed stacklevel would name a line of JAX."""
    frame = inspect.currentframe()
    # Level 1 is the function calling this one; warnings count from there.
    frame = frame.f_back.f_back if frame and frame.f_back else None
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame = frame.f_back
        level += 1
    return level if frame is not None else 2
