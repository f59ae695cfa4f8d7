"""The base of the callables eqx_amp returns."""

import abc
from collections.abc import Callable
from typing import Any

import equinox as eqx


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
