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

# Bodies whose inputs and outputs are the equation's operands and results as they
# are (a scan body sees slices, a `shard_map` body shards, a `cond` branch the
# operands after its index), so that a variable there holds the same value.
_SAME_VALUES = compat.present(
    compat.remat_p,
    compat.jit_p,
    compat.closed_call_p,
    compat.call_p,
    compat.eval_jaxpr_p,
    compat.custom_jvp_call_p,
    compat.custom_vjp_call_p,
)


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
    # The variable of the forward pass holding the same value, for one that a remat
    # body or an inlined call knows by another name, or that a rematerialised
    # equation recomputed; and what each equation of the forward pass computed,
    # keyed by what it computed it from (`_recipe`), for a rematerialised equation
    # to find its forward twin by.
    twin: dict = dataclasses.field(default_factory=dict)
    made_by: dict = dataclasses.field(default_factory=dict)
    made_at: dict = dataclasses.field(default_factory=dict)  # variable: its recipes

    def flow(
        self,
        eqn: Any,
        origins: list[Origin],
        recomputed: bool = False,
        transposed: bool = False,
    ) -> None:
        """A first-order equation's outputs inherit from its inputs: a parameter's
        path (if computed from it alone), the layer a tensor is an input or the
        gradient of, and the sites waiting for a product; a view of one tensor
        (reshaped, converted) also whether it was measured. A product makes a new
        tensor, named by the pass itself.

        A `recomputed` equation (the forward pass run again inside the backward
        pass) passes on parameter paths only: which layer a value is an input of is
        known once the forward pass has run, so a value that the forward pass
        computed before it knew (a ReLU's mask, computed from an activation then
        marked as the next layer's input) would take it when recomputed, and pass
        it to the gradients computed from it (`Naming.recompute` gives what its
        forward twin has)."""
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
        # A parameter times constants (a scale) is still that parameter.
        not_constant = [
            v
            for v, o in zip(eqn.invars, origins)
            if o != Origin.CONSTANT and not isinstance(v, compat.Literal)
        ]
        inherited = {
            "paths": unique(self.paths.get(v) for v in param_ins)
            if len(param_ins) == len(not_constant)
            else None,
        }
        pending: frozenset = frozenset()
        if not recomputed:
            inherited["feeds"] = (
                self._fed_in_backward(eqn, ins)
                if transposed
                else unique(self.feeds.get(v) for v in ins)
            )
            inherited["grads"] = unique(self.grads.get(v) for v in ins)
            pending = pending.union(*(self.pending.get(v, ()) for v in ins))
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

    def _fed_in_backward(self, eqn: Any, ins: list) -> Path | None:
        """The layer a value of the backward pass is an input of: that of its
        tensor-shaped inputs, if every one is an input of that layer (a forward
        activation quantised again, times its scale). One that is not is a
        gradient: tanh's and exp's derivatives multiply the output gradient by
        their forward output, the next layer's input, and the product is no input
        of it."""
        shape = eqn.outvars[0].aval.shape
        layers = {self.feeds.get(v) for v in ins if v.aval.shape == shape}
        return layers.pop() if len(layers) == 1 else None

    def remember(self, eqn: Any) -> None:
        """Keeps what a forward equation computed, for `recompute` to find."""
        recipe = self._recipe(eqn)
        if recipe is not None:
            self.made_by[recipe] = list(eqn.outvars)
            for v in eqn.outvars:
                self.made_at.setdefault(v, []).append(recipe)

    def recompute(self, eqn: Any) -> bool:
        """A rematerialised equation (`jax.checkpoint` recomputing the forward pass
        inside the backward pass): its results take what the forward equation it
        repeats knows about its own (the layer they are an input of, whether they
        were measured), as a backward product reads the recomputed values where it
        would read the forward ones. Whether that equation was found."""
        recipe = self._recipe(eqn)
        forward = None if recipe is None else self.made_by.get(recipe)
        if forward is None:
            for v in eqn.outvars:
                self.twin.pop(v, None)  # a shared body's, from another call
            return False
        for v in eqn.outvars:  # a shared body's, from another call
            for table in (self.feeds, self.grads, self.pending):
                table.pop(v, None)
        self._copy(forward, eqn.outvars, twin=True)
        return True

    def original(self, var: Any) -> Any:
        while var in self.twin:
            var = self.twin[var]
        return var

    def _recipe(self, eqn: Any) -> tuple | None:
        """The primitive, params and (forward) operands of a first-order equation, or
        None where its params cannot be compared."""
        ins = tuple(
            ("literal", repr(v.val))
            if isinstance(v, compat.Literal)
            else self.original(v)
            for v in eqn.invars
        )
        try:
            params = tuple(sorted(eqn.params.items()))
            hash(params)
        except TypeError:
            return None
        outs = tuple(str(v.aval) for v in eqn.outvars)
        return (eqn.primitive, params, ins, outs)

    def replicate(self, eqn: Any, invals: list) -> None:
        """Whether the outputs are the same on every device along an axis they are
        typed as varying along: made so by `pvary`, or computed from such values and
        values typed as the same."""
        if eqn.primitive.name == compat.PVARY_NAME:
            # One output per operand; an operand may be a literal (a constant).
            for var, out in zip(eqn.invars, eqn.outvars):
                same = frozenset()
                if not isinstance(var, compat.Literal):
                    same = self.replicated.get(var, frozenset())
                self.replicated[out] = frozenset(eqn.params["axes"]) | same
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
        same = eqn.primitive in _SAME_VALUES
        for body in compat.sub_jaxprs(eqn.params):
            jaxpr = compat.open_jaxpr(body)[0]
            self._forget(jaxpr)
            invars = jaxpr.invars
            self._copy(eqn.invars[len(eqn.invars) - len(invars) :], invars, twin=same)

    def _forget(self, jaxpr: Any) -> None:
        """What the pass learnt of a body's variables in an earlier call: one body
        may serve several calls (JAX shares an fp8 product's derivative rule between
        layers of the same shapes), and a layer's gradient must not take the name
        of the last layer that ran it."""
        made = [*jaxpr.invars, *(v for e in jaxpr.eqns for v in e.outvars)]
        for table in (
            self.paths, self.feeds, self.grads, self.pending, self.replicated,
            self.source,
        ):  # fmt: skip
            for var in made:
                table.pop(var, None)
        self.measured.difference_update(made)

    def out_of_bodies(self, eqn: Any) -> None:
        same = eqn.primitive in _SAME_VALUES
        for body in compat.sub_jaxprs(eqn.params):
            outvars = compat.open_jaxpr(body)[0].outvars
            self._copy(outvars, eqn.outvars, twin=False)
            if not same:
                continue
            pairs = [
                (src, dst)
                for src, dst in zip(outvars, eqn.outvars)
                if not isinstance(src, compat.Literal)
            ]
            # A recomputed body's results are twins of forward variables (and only
            # then have twins): so are the equation's.
            for src, dst in pairs:
                if src in self.twin:
                    self.twin[dst] = self.original(src)
            self._made_outside(pairs)

    def _made_outside(self, pairs: list) -> None:
        """What the forward pass computed in a body it knows, from now on, by the
        equation's results. Not the other way round: one body may serve several
        calls (JAX shares the jaxpr of `jax.nn.relu` between the layers calling
        it), and the body's variables keep only the last call's names."""
        for src, dst in pairs:
            for recipe in self.made_at.pop(src, ()):
                self.made_by[recipe] = [
                    dst if v is src else v for v in self.made_by[recipe]
                ]
                self.made_at.setdefault(dst, []).append(recipe)

    def _copy(self, sources: list, targets: list, twin: bool) -> None:
        for src, dst in zip(sources, targets):
            if isinstance(src, compat.Literal):
                continue
            original = self.original(src)
            if twin and original is not dst:
                self.twin[dst] = original
            tables = (self.paths, self.feeds, self.grads, self.pending, self.replicated)
            for table in tables:
                if src in table:
                    table[dst] = table[src]
            if src in self.measured:
                self.measured.add(dst)

    def mark_input(self, var: Any, layer: Path) -> None:
        """`var` and what it was computed from one-to-one are `layer`'s input, and so
        is the forward variable of the same value (`twin`), whose recomputation
        a backward product may read instead."""
        todo, seen = [var], set()
        while todo:
            var = todo.pop()
            if var is None or var in self.paths or var in seen:
                continue
            seen.add(var)
            self.feeds[var] = layer
            todo += [self.source.get(var), self.twin.get(var)]

    def input_of(self, var: Any) -> Path | None:
        """The layer `var`, or what it was computed from one to one, is an input of
        (a backward product's operand quantised from a recomputed input)."""
        seen = set()
        while var is not None and var not in seen:
            if var in self.feeds:
                return self.feeds[var]
            seen.add(var)
            var = self.source.get(var)
        return None

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
