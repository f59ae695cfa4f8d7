"""Mapped-axis names, as every function that takes an `axis_name` checks them."""

import contextlib
from collections.abc import Hashable
from typing import Any


def check_axis_name(axis_name: Any) -> None:
    try:
        hash(axis_name)
    except TypeError:
        raise TypeError(
            "`axis_name` must be the (hashable) name of a mapped axis, such as "
            f"'data', or None, but got {axis_name!r}."
        ) from None


@contextlib.contextmanager
def unbound_axis_name_error(axis_name: Hashable):
    """Names the argument when a collective is given an axis that is not mapped."""
    try:
        yield
    except NameError as e:
        raise NameError(
            f"`axis_name={axis_name!r}` is not the name of an axis mapped here. Call "
            "this inside `jax.shard_map`, `jax.pmap` or `jax.vmap` with that axis "
            f"name, or pass `axis_name=None`. (JAX: {e})"
        ) from None
