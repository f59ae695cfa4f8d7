"""Equinox's norm layers hand back the dtype their input arrived in, under
`autocast` too."""

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._core._cast import is_floating_array, widest_dtype
from .._core._filters import LAYERS_RETURNING_INPUT_DTYPE_SCOPES
from .._jaxpr import _compat as compat
from .._jaxpr._hook import Frame


class _LayerCall:
    """One call of a layer that hands back its input's dtype: the dtypes of the data
    that entered it."""

    def __init__(self):
        self.entered: list[np.dtype] = []

    def return_dtype(self) -> np.dtype | None:
        return widest_dtype(self.entered)


# Marks an equation that neither belongs to a layer call nor reads one's outputs as
# an outsider: a backward-pass equation, which must see the forward values as the
# layer computed them.
UNINVOLVED: Any = object()


class LayerCalls:
    """Restores the `out.astype(orig_dtype)` with which Equinox's LayerNorm, RMSNorm
    and GroupNorm end. In the traced float32 program that cast is the identity, so
    it is not in the jaxpr; without it a norm computed in float32 under its `FULL`
    scope would hand float32 to the ops after it (a ReLU would then save float32
    activations where the same model cast by hand saves bfloat16).

    A run of equations of one jaxpr under one such scope is one call of the layer. A
    value made in a call and read by a forward-pass equation outside it is cast to
    the dtype of the data that entered the call, as the layer itself does when given
    that data. Parameters do not count as entering data, and a call that no data
    entered returns what it computed."""

    def __init__(self, frame: Frame):
        self._active = not frame.transposed and not any(
            scope in LAYERS_RETURNING_INPUT_DTYPE_SCOPES for scope in frame.scopes
        )
        self._open: tuple[tuple[str, ...], _LayerCall] | None = None
        self._made_in: dict[Any, _LayerCall] = {}

    def call_of(self, eqn: Any, frame: Frame) -> _LayerCall | None:
        """The layer call `eqn` belongs to, `None` outside any, or `UNINVOLVED`."""
        if not self._active or frame.transposed:
            self._open = None
            return UNINVOLVED
        scopes = compat.scope_names(eqn)
        for depth, scope in enumerate(scopes):
            if scope in LAYERS_RETURNING_INPUT_DTYPE_SCOPES:
                key = scopes[: depth + 1]
                if self._open is None or self._open[0] != key:
                    self._open = (key, _LayerCall())
                return self._open[1]
        self._open = None
        return None

    def read(
        self,
        atoms: Sequence[Any],
        values: list,
        from_params: Sequence[bool],
        call: _LayerCall | None,
        cast: Callable,
    ) -> list:
        """`values` as `eqn` reads them: outputs of another layer call cast to what
        that call returns; records the data entering `call`."""
        if call is UNINVOLVED:
            return values
        out = []
        for atom, value, is_param in zip(atoms, values, from_params):
            made_in = (
                None if isinstance(atom, compat.Literal) else self._made_in.get(atom)
            )
            if made_in is not None and made_in is not call:
                value = cast(value, made_in.return_dtype())
            if (
                call is not None
                and made_in is not call
                and not is_param
                and is_floating_array(value)
            ):
                call.entered.append(value.dtype)
            out.append(value)
        return out

    def made(self, atoms: Sequence[Any], call: _LayerCall | None) -> None:
        if call is not None and call is not UNINVOLVED:
            self._made_in.update((atom, call) for atom in atoms)
