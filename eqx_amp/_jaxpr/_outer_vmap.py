"""A `jax.vmap` applied outside `filter_amp`, `autocast` or `BiModel`: JAX batches
the bodies of the higher-order primitives they traced (a `checkpoint`, a `scan`, a
`jit`) after the wrapper's pass, which traced those bodies one example at a time."""

from collections.abc import Sequence
from typing import Any

from . import _compat as compat
from ._hook import Origin, is_higher_order


def batched_after_tracing(eqn: Any, invals: Sequence[Any], origins) -> bool:
    """Whether `eqn` is a higher-order primitive holding parameters that a `jax.vmap`
    outside will batch: what the pass made of its body was traced per example."""
    return (
        is_higher_order(eqn)
        and Origin.PARAMS in origins
        and any(map(compat.is_batched, invals))
    )
