"""Why a value is wide: the op that first made its data wide, for the advice of
`precision_report` to name the cause and not a layer that only passed the value on
(an `eqx.nn.MLP` given float32 noise)."""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax import lax

from .._core._cast import is_floating_array, is_half_dtype
from .._jaxpr import _compat as compat
from .._jaxpr._hook import Frame, is_higher_order


# (the value first made wide, "`op` at file:line" or "" for an input of the
# function, the named scope of that op or "" where no layer is the cause)
Cause = tuple[Any, str, str]


def is_wide(value: Any) -> bool:
    return is_floating_array(value) and not is_half_dtype(value.dtype)


def state_inputs(tree: Any) -> list[bool]:
    """Per input of the program traced from `tree`'s arrays and structs, whether an
    `eqx.nn.State` holds it: a layer's own state (SpectralNorm's), whose reader is
    the cause when it is wide, where a wide argument is its caller's doing."""
    is_state = lambda x: isinstance(x, eqx.nn.State)  # noqa: E731
    is_input = lambda x: eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    flags: list[bool] = []
    for node in jtu.tree_leaves(eqx.filter(tree, is_input), is_leaf=is_state):
        flags += [is_state(node)] * len(jtu.tree_leaves(node))
    return flags


class WideCauses:
    """Follows each wide value to its cause as a hook meets the equations.

    ```python
    causes = WideCauses(state_inputs((fn, args, kwargs)))
    causes.start(program_inputs)
    inherited = causes.entering(eqn, invals, frame)  # before evaluating `eqn`
    causes.made(eqn, outvals, frame, "`add` at model.py:3", inherited)
    causes.scope(value, frame)  # "eqx.nn.SpectralNorm", or "" for no layer
    ```
    """

    def __init__(self, state_flags: list[bool]):
        self._state_flags = state_flags
        self._is_state: dict[int, bool] = {}
        # id(wide value) -> its cause; the cause's value is kept alive with it, so
        # that no id is reused. A value computed from a wide one has that one's.
        self._cause: dict[int, Cause] = {}
        # id(higher-order equation) -> (it, the cause of its first wide input)
        self._entering: dict[int, tuple[Any, Cause | None]] = {}
        # ids of the values a cast widened (the first entry of their cause).
        self._promoted: set[int] = set()

    def start(self, inputs: Sequence[Any]) -> None:
        """Records which of the program's inputs `eqx.nn.State` holds."""
        self._is_state = {id(x): s for x, s in zip(inputs, self._state_flags)}

    def entering(self, eqn: Any, invals: list, frame: Frame) -> Cause | None:
        """The cause the outputs of `eqn` inherit from its inputs, if any."""
        causes = [self.of(v, frame) for v in invals if is_wide(v)]
        causes = [c for c in causes if c is not None]
        # A widening cast is usually JAX's promotion, made because the op reading
        # it meets another wide value, the cause: it is taken only where no other is.
        strong = [c for c in causes if id(c[0]) not in self._promoted]
        inherited = next(iter(strong or causes), None)
        if is_higher_order(eqn):
            self._entering[id(eqn)] = (eqn, inherited)
        return inherited

    def made(
        self, eqn: Any, outvals: list, frame: Frame, made_by: str, inherited: Any
    ) -> None:
        # A backward pass is wide where its forward pass was: its layers are not
        # the cause (the forward value's cause is).
        transposed = frame.transposed or compat.is_transposed(eqn)
        scope = "" if transposed else "/".join(frame.scopes)
        for value in outvals:
            if not is_wide(value) or id(value) in self._cause:
                continue
            if inherited is not None:
                self._cause[id(value)] = inherited
                continue
            self._cause[id(value)] = (value, made_by, scope)
            if eqn.primitive is lax.convert_element_type_p:
                self._promoted.add(id(value))

    def of(self, value: Any, frame: Frame) -> Cause | None:
        """The cause of `value`; `None` where the op reading it is the cause (a
        layer reading its own float32 state). The input of a loop body or call has
        the cause of what entered it; an argument, its caller."""
        if id(value) in self._cause:
            return self._cause[id(value)]
        if frame.caller is not None:
            return self._entering.get(id(frame.caller[1]), (None, None))[1]
        if self._is_state.get(id(value), False):
            return None
        return (value, "", "")

    def scope(self, value: Any, frame: Frame) -> str:
        """The named scope of the cause of `value`, read by an op in `frame`."""
        cause = self.of(value, frame)
        if cause is None:  # read here first: made wide by the op reading it
            return "/".join(frame.scopes)
        return cause[2]
