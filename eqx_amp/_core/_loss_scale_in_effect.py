"""The factor a loss is multiplied by while eqx_amp's loss-scaled gradient functions
trace it. Delayed fp8 scaling (`_fp8._delayed`) keeps its output-gradient scales in
units of the unscaled loss, so that a loss scale that grows or shrinks does not make
them stale."""

import contextlib
import contextvars
from collections.abc import Iterator

from jaxtyping import Array


_factor: contextvars.ContextVar[Array | None] = contextvars.ContextVar(
    "eqx_amp_loss_scale_in_effect", default=None
)


@contextlib.contextmanager
def loss_scaled_by(factor: Array) -> Iterator[None]:
    token = _factor.set(factor)
    try:
        yield
    finally:
        _factor.reset(token)


def loss_scale_in_effect() -> Array | None:
    """The float32 factor of the loss being traced (None outside a loss-scaled
    gradient function)."""
    return _factor.get()
