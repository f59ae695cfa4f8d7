"""What a pass over a jaxpr is made of: the `Hook` called at each equation, the `Frame`
an equation runs in, the `Origin` of each value, and the casts the passes share. The
evaluator (`_evaluate.py`) drives a hook through a program."""

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax.tree_util as jtu
import numpy as np
from jax import lax

from .._core._cast import is_floating_array, is_floating_dtype
from . import _compat as compat


# The ops whose FLOPs mixed precision is about.
MATMUL_PRIMITIVES = compat.present(
    lax.dot_general_p, lax.conv_general_dilated_p, compat.ragged_dot_general_p
)
# Ops whose meaning depends on their operands' exact dtypes, run at the dtypes they
# were traced with: callbacks (Python code traced at those dtypes) and bitcasts
# (which reinterpret bits: a bfloat16 operand would give other bits and shape).
TRACED_DTYPE_PRIMITIVES = compat.CALLBACK_PRIMITIVES | {lax.bitcast_convert_type_p}


class Origin(enum.IntEnum):
    """What a value was computed from. A value computed from several others has the
    lowest of their origins: parameters times data is data."""

    DATA = 0
    PARAMS = 1  # parameters, possibly with constants
    CONSTANT = 2


def combined(origins: Sequence[Origin]) -> Origin:
    return min(origins, default=Origin.CONSTANT)


@dataclasses.dataclass(frozen=True)
class Frame:
    """Where an equation runs: the named scopes around it (a sub-jaxpr records only
    its own), how many times it runs per run of the whole program (a `scan` body
    `length` times; a `while` body is counted once), whether it belongs to a
    backward pass the program takes itself, and the call it runs inside."""

    scopes: tuple[str, ...] = ()
    repeats: int = 1
    transposed: bool = False
    caller: "tuple[Frame, Any] | None" = None  # (frame, equation) of the call

    def enter(self, eqn: Any) -> "Frame":
        return Frame(
            self.scopes + compat.scope_names(eqn),
            self.repeats,
            self.transposed or compat.is_transposed(eqn),
            self.caller,
        )

    def call(self, eqn: Any, repeats: int = 1) -> "Frame":
        """The frame of a sub-jaxpr of `eqn` (this frame being `eqn`'s own)."""
        return dataclasses.replace(
            self, repeats=self.repeats * repeats, caller=(self, eqn)
        )

    def source(self, eqn: Any) -> str:
        """The user source line of `eqn`, or of the call it runs inside: ops in
        library sub-jaxprs (`jnp.var` is a `jit`) have no user frame of their own."""
        line = compat.source_line(eqn)
        if line != compat.UNKNOWN_SOURCE or self.caller is None:
            return line
        frame, call_eqn = self.caller
        return frame.source(call_eqn)


Evaluate = Callable[..., list]


class Hook:
    """What a pass over a jaxpr does at each equation. The default evaluates the
    program unchanged."""

    # Run control flow in Python on concrete values (see the module docstring).
    eager: ClassVar[bool] = False

    def enter_jaxpr(self, frame: Frame) -> "Hook":
        """The hook for one jaxpr (the whole program or a sub-jaxpr), for a pass that
        keeps state per jaxpr."""
        del frame
        return self

    # Whether the hook makes values of its own that leave the program (see `made`).
    # Such a pass inlines calls and custom derivative rules (its program is not
    # differentiated again) and threads what it made out of every other body.
    makes_values: ClassVar[bool] = False

    def made(self) -> list:
        """What this jaxpr's hook made, to leave the jaxpr as extra outputs: a list
        of pytrees of arrays (each returned in order, none by default)."""
        return []

    def adopt(self, made: list, eqn: Any) -> None:
        """Takes what a sub-jaxpr of `eqn` made, as values of this jaxpr: a `scan`
        body's with a leading axis, one entry per iteration."""
        del made, eqn

    def across(self, made: list, axis_names: frozenset) -> list:
        """What a `shard_map` body made, made the same on every device of the mapped
        `axis_names` (it leaves the body replicated)."""
        del axis_names
        return made

    def equation(
        self,
        eqn: Any,
        invals: list,
        origins: list[Origin],
        frame: Frame,
        evaluate: Evaluate,
    ) -> list:
        """The outputs of `eqn`. `evaluate(invals, params=None)` runs it the
        evaluator's way: it binds a first-order primitive (with `params` in place
        of the equation's own, if given) and recurses into a higher-order one."""
        del eqn, origins, frame
        return evaluate(invals)


def is_higher_order(eqn: Any) -> bool:
    return bool(next(compat.sub_jaxprs(eqn.params), None)) and (
        "update_jaxpr" not in eqn.params  # scatters: a combiner, not a sub-program
    )


def cast_to(values: Sequence[Any], dtypes: Sequence[np.dtype]) -> list[Any]:
    """Casts floating values to the given floating dtypes (others pass through)."""
    return [
        lax.convert_element_type(v, d)
        if is_floating_array(v) and is_floating_dtype(d) and v.dtype != d
        else v
        for v, d in zip(values, dtypes)
    ]


def traced_dtypes(atoms: Sequence[Any]) -> list[np.dtype]:
    return [a.aval.dtype for a in atoms]


def leaf_origins(tree: Any, params_are: Callable[[Any], bool]) -> list[Origin]:
    """One origin per leaf of `tree`: `PARAMS` inside the subtrees `params_are`
    selects, `DATA` elsewhere."""
    origins = []
    for node in jtu.tree_leaves(tree, is_leaf=params_are):
        origin = Origin.PARAMS if params_are(node) else Origin.DATA
        origins += [origin] * len(jtu.tree_leaves(node))
    return origins
