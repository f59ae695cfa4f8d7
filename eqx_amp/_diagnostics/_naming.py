"""How telemetry names what it measures: a parameter leaf's path flows along what is
computed from it alone (`Naming`), and a scan over stacked layers puts each layer's
index after its stack (`index_position`)."""

import dataclasses
from collections.abc import Iterable
from typing import Any

import jax.tree_util as jtu

from .._jaxpr import _compat as compat
from .._jaxpr._hook import MATMUL_PRIMITIVES, Origin


Path = tuple[str, ...]  # rendered key entries: ("model", ".blocks", "[3]", ".weight")


def unique(values: Iterable[Any]) -> Any:
    distinct = set(values) - {None}
    return distinct.pop() if len(distinct) == 1 else None


@dataclasses.dataclass
class Naming:
    """What the pass knows about the program's variables, across all its jaxprs."""

    paths: dict = dataclasses.field(default_factory=dict)  # parameter leaf's path
    feeds: dict = dataclasses.field(default_factory=dict)  # layer it is an input of
    grads: dict = dataclasses.field(default_factory=dict)  # layer it is the grad of
    pending: dict = dataclasses.field(default_factory=dict)  # sites awaiting a layer
    source: dict = dataclasses.field(default_factory=dict)  # its one-input producer
    # Axes it is typed as varying along, yet the same on every device: a replicated
    # weight that `shard_map` made varying (`pvary`) to meet a batch shard.
    replicated: dict = dataclasses.field(default_factory=dict)
    measured: set = dataclasses.field(default_factory=set)

    def flow(self, eqn: Any, origins: list[Origin]) -> None:
        """A first-order equation's outputs inherit from its inputs: a parameter's
        path (if computed from it alone), the layer a tensor is an input or the
        gradient of, and the sites waiting for a product; a view of one tensor
        (reshaped, converted) also whether it was measured. A product makes a new
        tensor, named by the pass itself."""
        if eqn.primitive in MATMUL_PRIMITIVES:
            return
        ins = [
            v for v, o in zip(eqn.invars, origins) if not isinstance(v, compat.Literal)
        ]
        param_ins = [
            v
            for v, o in zip(eqn.invars, origins)
            if o == Origin.PARAMS and not isinstance(v, compat.Literal)
        ]
        inherited = {
            "paths": unique(self.paths.get(v) for v in param_ins)
            if len(param_ins) == len(ins)
            else None,
            "feeds": unique(self.feeds.get(v) for v in ins),
            "grads": unique(self.grads.get(v) for v in ins),
        }
        pending = frozenset().union(*(self.pending.get(v, ()) for v in ins))
        for out in eqn.outvars:
            for table, value in inherited.items():
                if value is not None:
                    getattr(self, table)[out] = value
            if pending:
                self.pending[out] = pending
            if len(ins) == 1:
                self.source[out] = ins[0]
                if ins[0] in self.measured:
                    self.measured.add(out)

    def replicate(self, eqn: Any, invals: list) -> None:
        """Whether the outputs are the same on every device along an axis they are
        typed as varying along: made so by `pvary`, or computed from such values and
        values typed as the same."""
        if eqn.primitive.name == "pvary":  # JAX names the primitive in no public API
            (var,) = eqn.invars
            axes = frozenset(eqn.params["axes"]) | self.replicated.get(var, frozenset())
            self.replicated[eqn.outvars[0]] = axes
            return
        ins = [
            (self.replicated.get(v, frozenset()), compat.varying_axes(x))
            for v, x in zip(eqn.invars, invals)
            if not isinstance(v, compat.Literal)
        ]
        candidates = frozenset().union(*(same for same, _ in ins))
        same = {a for a in candidates if all(a in s or a not in v for s, v in ins)}
        if same:
            for out in eqn.outvars:
                self.replicated[out] = frozenset(same)

    def into_bodies(self, eqn: Any) -> None:
        """A higher-order equation's operands, as its bodies' inputs (which are the
        last of its operands: `cond` and `while` put others first)."""
        for body in compat.sub_jaxprs(eqn.params):
            invars = compat.open_jaxpr(body)[0].invars
            self._copy(eqn.invars[len(eqn.invars) - len(invars) :], invars)

    def out_of_bodies(self, eqn: Any) -> None:
        for body in compat.sub_jaxprs(eqn.params):
            outvars = compat.open_jaxpr(body)[0].outvars
            self._copy(outvars, eqn.outvars)

    def _copy(self, sources: list, targets: list) -> None:
        for src, dst in zip(sources, targets):
            if isinstance(src, compat.Literal):
                continue
            tables = (self.paths, self.feeds, self.grads, self.pending, self.replicated)
            for table in tables:
                if src in table:
                    table[dst] = table[src]
            if src in self.measured:
                self.measured.add(dst)

    def mark_input(self, var: Any, layer: Path) -> None:
        """`var` and what it was computed from one-to-one are `layer`'s input."""
        while var is not None and var not in self.paths:
            self.feeds[var] = layer
            var = self.source.get(var)

    def layer_of(self, var: Any) -> Path | None:
        path = self.paths.get(var)
        return None if path is None else path[:-1]  # the leaf's module


def _common_prefix(paths: Iterable[Path]) -> int:
    """How many leading entries the stacked parameters' paths share (`model.blocks`
    of `model.blocks.attn.qkv.weight` and `model.blocks.mlp.weight`); for one path,
    those of its module."""
    paths = list(paths)
    if len(paths) < 2:
        return len(paths[0]) - 1 if paths else -1
    n = 0
    while all(len(p) > n and p[n] == paths[0][n] for p in paths):
        n += 1
    return n


def index_position(layer: Path, scanned: frozenset[Path], leaves: set[Path]) -> int:
    """Where in `layer`'s path the index of a scan over the parameters at `scanned`
    goes: after the stack the layer belongs to (`model.blocks[3].attn.qkv`), out of
    the parameter leaves `leaves`. A scan over `(m.enc, m.dec)` has two stacks,
    whose paths share only the argument's name: each layer's index goes after the
    shallowest part of its path (below that name) whose leaves are all scanned,
    `m.enc[3]`, or else after the prefix the scanned leaves under that part share."""
    if not scanned:
        return len(layer)  # a scan over data only (time steps): the index goes last
    start = max(_common_prefix(scanned), 2)
    for n in range(start, len(layer) + 1):
        under = {p for p in leaves if p[:n] == layer[:n]}
        if under and under <= scanned:
            return n
    head = layer[:start]
    ours = [p for p in scanned if p[: len(head)] == head]
    return min(_common_prefix(ours), len(layer)) if ours else len(layer)


def keyed_paths(tree: Any, name: str, views: Iterable[Any] = ()) -> list[Path]:
    """The path of each leaf of `tree`, under the argument `name`; a leaf that is
    also a leaf of one of `views` (the model a wrapper holds) by its path there."""
    by_id = {
        id(leaf): path
        for view in views
        for path, leaf in jtu.tree_leaves_with_path(view)
    }
    return [
        (name, *(jtu.keystr((k,)) for k in by_id.get(id(leaf), path)))
        for path, leaf in jtu.tree_leaves_with_path(tree)
    ]
