"""One evaluator of jaxprs, for every pass eqx_amp makes over a traced program.

`evaluate` runs a jaxpr equation by equation and hands each equation to a `Hook`,
which may change the equation's inputs and params before it is bound (`autocast`
casts them by its rules), watch it (`precision_report` counts it), or check what it
produced (`find_nonfinite`). The evaluator recurses into every higher-order
primitive and re-binds it with all of its params, with a body that is evaluated
under the same hook:

- `jit` is bound with its original shardings, layouts, donation, mesh context,
  compiler options, name and inlining, and a body traced at the inputs' new types;
- `checkpoint` keeps its policy and `prevent_cse`, `shard_map` its mesh, specs,
  manual axes and checks, `scan` its length, direction and unrolling;
- `custom_jvp` / `custom_vjp` keep their derivative rules, which are themselves
  evaluated under the hook (the forward pass under differentiation follows it too);
- call primitives (`closed_call`) are inlined;
- loops and branches follow the rules of `_control_flow.py`.

Values flow through a program in whatever dtype their op produced, except at the
boundaries where JAX checks types, which keep the dtypes of the original program:
loop carries of `scan` and `while`, outputs of `cond` branches, the inputs and
outputs of `custom_jvp` / `custom_vjp` functions, operands of callbacks, bitcasts
and higher-order primitives the evaluator does not know (which run unchanged, with
a one-time warning).

A hook that runs eagerly (`Hook.eager`) gets control flow run in Python on concrete
values instead: each `scan` and `while` iteration and the `cond` branch taken, with
calls inlined, so that it sees every value the program computes.

A hook that makes values of its own (`Hook.makes_values`, telemetry) gets calls and
custom derivative rules inlined, and what it made in a `checkpoint`, `scan` or
`shard_map` body carried out as extra outputs (per iteration for `scan`, agreed
across devices for `shard_map`); what it made inside `while` and `cond` stays there.

Alongside each value the evaluator tracks its `Origin`: computed from constants
alone (literals, the jaxpr's constants, and what is computed from them only), from
parameters and constants (the arguments a caller marks as parameters), or from data.
"""

import contextlib
import contextvars
import functools as ft
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.custom_batching import custom_vmap

from .._core._cast import is_floating_array
from .._core._wrapper import user_stacklevel
from . import _compat as compat
from . import _control_flow as control_flow
from ._hook import (
    TRACED_DTYPE_PRIMITIVES,
    Frame,
    Hook,
    Origin,
    cast_to,
    combined,
    is_higher_order,
    leaf_origins,
    traced_dtypes,
)


def evaluate(
    closed: Any,
    args: Sequence[Any],
    hook: Hook,
    frame: Frame = Frame(),
    origins: Sequence[Origin] | None = None,
    const_origins: Sequence[Origin] | None = None,
) -> tuple[list, list[Origin]]:
    """Evaluates a (closed or open) jaxpr under `hook`. `origins` says what each
    argument is (data by default), `const_origins` what each of its constants is
    (constant by default). Returns the outputs and their origins."""
    outs, out_origins, _ = evaluate_making(
        closed, args, hook, frame, origins, const_origins
    )
    return outs, out_origins


def evaluate_making(
    closed: Any,
    args: Sequence[Any],
    hook: Hook,
    frame: Frame = Frame(),
    origins: Sequence[Origin] | None = None,
    const_origins: Sequence[Origin] | None = None,
) -> tuple[list, list[Origin], list]:
    """`evaluate`, also returning what the hook made in the jaxpr (`Hook.made`)."""
    compat.require_known_internals()
    jaxpr, consts = compat.open_jaxpr(closed)
    env: dict[Any, Any] = {}
    origin_env: dict[Any, Origin] = {}

    def read(atom):
        if isinstance(atom, compat.Literal):
            return atom.val, Origin.CONSTANT
        return env[atom], origin_env[atom]

    env.update(zip(jaxpr.constvars, consts))
    if const_origins is None:
        const_origins = [Origin.CONSTANT] * len(jaxpr.constvars)
    origin_env.update(zip(jaxpr.constvars, const_origins))
    env.update(zip(jaxpr.invars, args))
    arg_origins = [Origin.DATA] * len(args) if origins is None else list(origins)
    origin_env.update(zip(jaxpr.invars, arg_origins))
    jaxpr_hook = hook.enter_jaxpr(frame)
    for eqn in jaxpr.eqns:
        invals, in_origins = (
            map(list, zip(*map(read, eqn.invars))) if eqn.invars else ([], [])
        )
        eqn_frame = frame.enter(eqn)
        out_origins = [combined(in_origins)] * len(eqn.outvars)

        def evaluate_eqn(
            vals,
            params=None,
            *,
            eqn=eqn,
            eqn_frame=eqn_frame,
            in_origins=in_origins,
            out_origins=out_origins,
        ):
            outs, origins_made, made = _evaluate_equation(
                eqn, vals, in_origins, eqn_frame, hook, params
            )
            out_origins[:] = origins_made
            if made:
                jaxpr_hook.adopt(made, eqn)
            return outs

        with compat.equation_context(eqn), compat.unknown_internals(eqn):
            outvals = jaxpr_hook.equation(
                eqn, invals, in_origins, eqn_frame, evaluate_eqn
            )
        env.update(zip(eqn.outvars, outvals))
        origin_env.update(zip(eqn.outvars, out_origins))
    outs, out_origins = zip(*map(read, jaxpr.outvars)) if jaxpr.outvars else ((), ())
    return list(outs), list(out_origins), jaxpr_hook.made()


def evaluate_function(
    fn: Callable,
    args: Sequence[Any],
    hook: Hook,
    frame: Frame = Frame(),
    *,
    params_are: Callable[[Any], bool] | None = None,
    param_arrays: Sequence[Any] | None = None,
    prepare: Callable[[Any, list, list], None] | None = None,
) -> Any:
    """Traces `fn(*args)` and evaluates it under `hook`. Non-array arguments and
    outputs pass through statically; array outputs come back in the dtypes `fn`
    returns (as the same types: a constant output is a `jax.Array` too).
    `params_are(node)` marks the subtrees of `args` whose arrays are parameters;
    `param_arrays` (instead) are the parameters themselves, found wherever they
    appear: in `args`, or closed over by a function (a constant of the program).
    `prepare(jaxpr, values, origins)` is called once the program is traced, with
    its open jaxpr and the values and origins of its constants and then its
    inputs, before any of it is evaluated."""
    dynamic, static = eqx.partition(list(args), eqx.is_array)
    leaves, treedef = jtu.tree_flatten(dynamic)
    origins = None if params_are is None else leaf_origins(dynamic, params_are)
    param_ids = None if param_arrays is None else {id(a) for a in param_arrays}
    if param_ids is not None:
        origins = [Origin.PARAMS if id(x) in param_ids else Origin.DATA for x in leaves]
    static_out = []

    def flat_fn(*leaves):
        out = fn(*eqx.combine(jtu.tree_unflatten(treedef, leaves), static))
        dynamic_out, static_part = eqx.partition(out, eqx.is_array)
        static_out.append(static_part)
        return dynamic_out

    closed, out_shapes = jax.make_jaxpr(flat_fn, return_shape=True)(*leaves)
    flat_shapes, out_treedef = jtu.tree_flatten(out_shapes)
    const_origins = None
    if param_ids is not None:
        const_origins = [
            Origin.PARAMS if id(c) in param_ids else Origin.CONSTANT
            for c in compat.open_jaxpr(closed)[1]
        ]
    if prepare is not None:
        jaxpr, consts = compat.open_jaxpr(closed)
        prepare(
            jaxpr,
            [*consts, *leaves],
            [
                *(const_origins or [Origin.CONSTANT] * len(consts)),
                *(origins or [Origin.DATA] * len(leaves)),
            ],
        )
    outs, _ = evaluate(closed, leaves, hook, frame, origins, const_origins)
    outs = [jnp.asarray(v) for v in cast_to(outs, [s.dtype for s in flat_shapes])]
    return eqx.combine(jtu.tree_unflatten(out_treedef, outs), static_out[0])


def batched_like(
    bind: Callable,
    op: Callable,
    hook: Hook,
    origins: Sequence[Origin] | None = None,
) -> Callable:
    """`op`, a derivative rule around the one-output `bind`, for operands traced by
    `jax.vmap`: batched, it is `bind` batched by JAX's own rule (which folds the
    batch axis into a matmul) and evaluated under `hook`, which wraps it again. A
    custom_vjp batched as it stands would compute per-example weight gradients and
    per-example scales. (`custom_vmap` cannot be differentiated unbatched, so only
    operands that are batched get this.)"""

    @custom_vmap
    def batchable(*operands):
        return op(*operands)

    @batchable.def_vmap
    def batched(axis_size, in_batched, *operands):
        in_axes = [0 if b else None for b in in_batched]
        closed = jax.make_jaxpr(jax.vmap(bind, in_axes, axis_size=axis_size))(*operands)
        (out,), _ = evaluate(closed, operands, hook, origins=origins)
        return out, True

    return batchable


#
# Equations.
#


def _evaluate_equation(eqn, invals, in_origins, frame, hook, params):
    rule = _HIGHER_ORDER.get(eqn.primitive)
    if rule is not None:
        if params is not None:
            raise ValueError(
                f"The params of the higher-order primitive `{eqn.primitive}` cannot "
                "be replaced; its body is evaluated under the hook instead."
            )
        # A rule returns what the hook made in the bodies as a third element.
        outs, out_origins, *made = rule(eqn, invals, in_origins, frame, hook)
        return list(outs), list(out_origins), made[0] if made else []
    if is_higher_order(eqn):
        _warn_unknown_higher_order(str(eqn.primitive))
        return *_opaque(eqn, invals, in_origins), []
    if eqn.primitive in TRACED_DTYPE_PRIMITIVES:
        return *_opaque(eqn, invals, in_origins), []
    if params is not None and "update_jaxpr" in params:
        floating = [v for v in invals if is_floating_array(v)]
        if floating:
            params = compat.retype_update_jaxpr(params, floating[0].dtype)
    outs = compat.bind(eqn, invals, params)
    return outs, [combined(in_origins)] * len(outs), []


def _opaque(eqn, invals, in_origins):
    """Runs an equation at the dtypes it was traced with."""
    outs = compat.bind(eqn, cast_to(invals, traced_dtypes(eqn.invars)))
    return outs, [combined(in_origins)] * len(outs)


@ft.cache
def _warn_unknown_higher_order(name: str) -> None:
    warnings.warn(
        f"eqx_amp does not know the higher-order primitive `{name}`: it is run "
        "unchanged, at the dtypes it was traced with, and the ops inside it are not "
        "cast or inspected.",
        stacklevel=user_stacklevel(),
    )


def _body(closed, hook, frame, in_origins):
    """A function evaluating `closed` under `hook`, for a public transformation or a
    re-bound primitive to trace; it records the origins of the outputs, and returns
    them with what the hook made."""
    out_origins: list[Origin] = []

    def body(*args):
        outs, origins, made = evaluate_making(closed, args, hook, frame, in_origins)
        out_origins[:] = origins
        return outs, made

    return body, out_origins


def _inline(param: str) -> Callable:
    def rule(eqn, invals, in_origins, frame, hook):
        return evaluate_making(
            eqn.params[param], invals, hook, frame.call(eqn), in_origins
        )

    return rule


_inlined = contextvars.ContextVar("eqx_amp_inlining_calls", default=False)


@contextlib.contextmanager
def inlining_calls() -> Iterator[None]:
    """Within it, the passes inline `jit` calls rather than trace their bodies as
    programs of their own: for hooks whose equations read values of the enclosing
    trace (delayed fp8 scales), which such a program would hold as constants."""
    token = _inlined.set(True)
    try:
        yield
    finally:
        _inlined.reset(token)


def _jit(eqn, invals, in_origins, frame, hook):
    if hook.eager or hook.makes_values or _inlined.get():
        return _inline("jaxpr")(eqn, invals, in_origins, frame, hook)
    body, out_origins = _body(eqn.params["jaxpr"], hook, frame.call(eqn), in_origins)

    def outputs(*args):  # A hook that makes values has this call inlined.
        return body(*args)[0]

    outputs.__name__ = eqn.params.get("name", "jit")
    # Traced at the types the inputs have now (dtype, sharding, varying axes).
    jaxpr = jax.make_jaxpr(outputs)(*invals)
    return compat.bind_jit(eqn.params, jaxpr, invals), out_origins


def _checkpoint(eqn, invals, in_origins, frame, hook):
    if hook.eager:
        return _inline("jaxpr")(eqn, invals, in_origins, frame, hook)
    body, out_origins = _body(eqn.params["jaxpr"], hook, frame.call(eqn), in_origins)
    outs, made = jax.checkpoint(
        body, prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"]
    )(*invals)
    return outs, out_origins, made


def _shard_map(eqn, invals, in_origins, frame, hook):
    if hook.eager:
        # Per-device programs need their mesh: run it as it was traced.
        return _opaque(eqn, invals, in_origins)
    body_frame = frame.call(eqn)
    params = compat.shard_map_params(eqn.params)
    axis_names = params["axis_names"]
    out_origins: list[Origin] = []

    def body(*args):
        outs, origins, made = evaluate_making(
            eqn.params["jaxpr"], args, hook, body_frame, in_origins
        )
        out_origins[:] = origins
        return tuple(outs), hook.across(made, axis_names)

    # What the hook made leaves the body replicated (`P()` covers all of it).
    params["out_specs"] = (tuple(params["out_specs"]), jax.P())
    outs, made = jax.shard_map(body, **params)(*invals)
    return list(outs), out_origins, made


def _custom_jvp(eqn, invals, in_origins, frame, hook):
    body_frame = frame.call(eqn)
    if hook.eager or hook.makes_values:
        return evaluate_making(
            eqn.params["call_jaxpr"], invals, hook, body_frame, in_origins
        )
    params = compat.bind_params(eqn)
    fun, jvp = params.pop("subfuns")
    call_jaxpr = eqn.params["call_jaxpr"]
    original = traced_dtypes(eqn.invars)
    out_origins = [combined(in_origins)] * len(eqn.outvars)
    if params.get("symbolic_zeros"):
        # Such rules receive zeros as objects and cannot be re-traced at other
        # dtypes: call them at the dtypes they were written for.
        out_dtypes = traced_dtypes(eqn.outvars)

        def fun_at_traced_dtypes(*args):
            return cast_to(evaluate(call_jaxpr, args, hook, body_frame)[0], out_dtypes)

        outs = eqn.primitive.bind(
            *cast_to(invals, original),
            subfuns=(compat.wrap_like(fun_at_traced_dtypes, fun), jvp),
            **params,
        )
        return outs, out_origins

    def new_fun(*args):
        return evaluate(call_jaxpr, args, hook, body_frame, in_origins)[0]

    def new_jvp(*primals_and_tangents):
        # The user's rule is traced once, at the dtypes it was written for, and then
        # evaluated under the hook at the dtypes that arrive, so values flow through
        # it (a bfloat16 activation stays bfloat16 through `jax.nn.relu`).
        n = len(primals_and_tangents) // 2
        rule, primal_dtypes = _jvp_rule(eqn, jvp, new_fun, primals_and_tangents[:n])
        outs, _ = evaluate(rule, primals_and_tangents, hook, body_frame)
        half = len(outs) // 2
        return cast_to(outs[:half], primal_dtypes) + cast_to(outs[half:], primal_dtypes)

    outs = eqn.primitive.bind(
        *invals,
        subfuns=(compat.wrap_like(new_fun, fun), compat.wrap_like(new_jvp, jvp)),
        **params,
    )
    return outs, out_origins


# A jvp rule traced at its written dtypes, and the primal output dtypes at the dtypes
# that arrive, per (equation, arriving types): JAX may call a rule more than once,
# and each call would otherwise re-run the user's Python and re-trace the primal.
_jvp_rules: "dict[tuple, tuple[Any, Any, list[np.dtype]]]" = {}


def _jvp_rule(eqn, jvp, new_fun, primals) -> tuple[Any, list[np.dtype]]:
    arriving = tuple(
        (x.shape, jnp.result_type(x), compat.varying_axes(x)) for x in primals
    )
    key = (id(eqn), arriving)
    cached = _jvp_rules.get(key)
    if cached is not None and cached[0] is eqn:
        return cached[1], cached[2]
    original = traced_dtypes(eqn.invars)
    written_for = [
        compat.abstract_like(x, d if is_floating_array(x) else x.dtype)
        for x, d in zip(primals, original)
    ] * 2
    rule = jax.make_jaxpr(ft.partial(compat.call_wrapped, jvp))(*written_for)
    primal_dtypes = [s.dtype for s in jax.eval_shape(new_fun, *primals)]
    if len(_jvp_rules) > 4096:
        _jvp_rules.clear()
    # The equation is kept with its entry, so its id cannot be reused meanwhile.
    _jvp_rules[key] = (eqn, rule, primal_dtypes)
    return rule, primal_dtypes


def _custom_vjp(eqn, invals, in_origins, frame, hook):
    body_frame = frame.call(eqn)
    if hook.eager or hook.makes_values:
        return evaluate_making(
            eqn.params["call_jaxpr"], invals, hook, body_frame, in_origins
        )
    params = compat.bind_params(eqn)
    fun, fwd, bwd = params.pop("subfuns")
    call_jaxpr = eqn.params["call_jaxpr"]
    out_dtypes = traced_dtypes(eqn.outvars)

    def new_fun(*args):
        return cast_to(evaluate(call_jaxpr, args, hook, body_frame)[0], out_dtypes)

    def new_fwd(*args):
        # The residuals come back in the dtypes the user's forward rule gives them,
        # so their backward rule sees exactly what it was written for.
        return evaluate_function(
            ft.partial(compat.call_wrapped, fwd), args, hook, body_frame
        )

    outs = eqn.primitive.bind(
        *cast_to(invals, traced_dtypes(eqn.invars)),
        subfuns=(compat.wrap_like(new_fun, fun), compat.wrap_like(new_fwd, fwd), bwd),
        **params,
    )
    return outs, [combined(in_origins)] * len(outs)


def _with_bodies_under_hook(eqn, invals, in_origins, frame, hook):
    """A higher-order primitive whose params the evaluator does not rebuild one by
    one: each sub-jaxpr is re-traced to evaluate under the hook with the same input
    and output types as before (casting at its edges), so every other param stays
    valid, and the primitive is bound with its operands at their traced dtypes."""
    if hook.eager:
        return _opaque(eqn, invals, in_origins)
    body_frame = frame.call(eqn)

    def under_hook(closed):
        jaxpr, _ = compat.open_jaxpr(closed)
        in_types = [v.aval for v in jaxpr.invars]
        out_dtypes = traced_dtypes(jaxpr.outvars)

        def body(*args):
            return cast_to(evaluate(closed, args, hook, body_frame)[0], out_dtypes)

        new = jax.make_jaxpr(body)(*in_types)
        # Closed in, closed out; an open jaxpr (jax 0.10) stays open.
        return new if closed is not jaxpr else new.jaxpr

    params = compat.replace_jaxprs(eqn.params, under_hook)
    outs = compat.bind(eqn, cast_to(invals, traced_dtypes(eqn.invars)), params)
    return outs, [combined(in_origins)] * len(outs)


_HIGHER_ORDER: dict[Any, Callable] = {
    compat.jit_p: _jit,
    compat.closed_call_p: _inline("call_jaxpr"),
    compat.remat_p: _checkpoint,
    compat.scan_p: ft.partial(control_flow.scan, evaluate_making),
    compat.while_p: ft.partial(control_flow.while_loop, evaluate_making),
    compat.cond_p: ft.partial(control_flow.cond, evaluate_making),
    compat.shard_map_p: _shard_map,
    compat.custom_jvp_call_p: _custom_jvp,
    compat.custom_vjp_call_p: _custom_vjp,
}
if compat.call_p is not None:
    _HIGHER_ORDER[compat.call_p] = _inline("call_jaxpr")
if compat.linear_solve_p is not None:
    _HIGHER_ORDER[compat.linear_solve_p] = _with_bodies_under_hook
if compat.eval_jaxpr_p is not None:
    _HIGHER_ORDER[compat.eval_jaxpr_p] = _inline("jaxpr")
