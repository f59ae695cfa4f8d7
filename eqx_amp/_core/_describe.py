"""How an error message names a user's value, and the tree predicates every layer
uses: one home each, so that every message describes a value the same way."""

from typing import Any

import equinox as eqx
import jax
import numpy as np


def describe(x: Any) -> str:
    """An array by its dtype and shape (never its values, which can be a whole
    model's), anything else by its type and repr (only its type when the repr is
    long)."""
    if isinstance(x, jax.Array | np.ndarray | np.generic):
        return f"an array of dtype {x.dtype} and shape {tuple(x.shape)}"
    text = repr(x)
    if len(text) > 80:
        return f"a {type(x).__name__}"
    return f"{type(x).__name__} {text}"


def first_line(error: Exception, limit: int = 200) -> str:
    """The start of an error message from JAX, which can print a whole model."""
    line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
    line = line.rstrip("(")  # JAX goes on to print the tree on the next lines.
    return line if len(line) <= limit else line[: limit - 3] + "..."


def is_module(node: Any) -> bool:
    return isinstance(node, eqx.Module)


def in_selected_modules(tree: Any, predicate: Any) -> tuple[bool, ...]:
    """One bool per leaf of `tree`: whether it is in a module `predicate` selects,
    asked from the outside in (a module it selects is selected whole)."""

    def picked(node: Any) -> bool:
        return is_module(node) and bool(predicate(node))

    return tuple(
        flag
        for node in jax.tree_util.tree_leaves(tree, is_leaf=picked)
        for flag in [picked(node)] * len(jax.tree_util.tree_leaves(node))
    )


def is_none(x: Any) -> bool:
    return x is None
