"""The rules for loops and branches (`scan`, `while`, `cond`), apart from the
evaluator (`_evaluate.py`) that dispatches to them. Each takes the evaluator as
`run` (`evaluate_making`), since its bodies are evaluated by the same dispatch.

Loop carries and branch outputs keep the dtypes of the original program (JAX checks
them); a hook that runs eagerly gets each iteration and the branch taken run in
Python on concrete values."""

import functools as ft
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _compat as compat
from ._hook import Origin, cast_to, traced_dtypes


# `evaluate_making(closed, args, hook, frame, origins) -> (outs, origins, made)`.
Run = Callable[..., tuple[list, list[Origin], list]]


def scan(run: Run, eqn, invals, in_origins, frame, hook):
    num_consts, num_carry = compat.scan_counts(eqn.params)
    length, reverse = eqn.params["length"], eqn.params["reverse"]
    consts = invals[:num_consts]
    carry_dtypes = traced_dtypes(eqn.invars[num_consts : num_consts + num_carry])
    init = cast_to(invals[num_consts : num_consts + num_carry], carry_dtypes)
    xs = invals[num_consts + num_carry :]
    # Carries are data: whether they come from parameters could change per iteration.
    body_origins = [
        *in_origins[:num_consts],
        *[Origin.DATA] * num_carry,
        *in_origins[num_consts + num_carry :],
    ]
    body_frame = frame.call(eqn, length)
    ys_origins: list[Origin] = []

    def step(carry, x):
        outs, origins, made = run(
            eqn.params["jaxpr"], [*consts, *carry, *x], hook, body_frame, body_origins
        )
        ys_origins[:] = origins[num_carry:]
        # What the hook made leaves as more ys: one entry per iteration.
        return cast_to(outs[:num_carry], carry_dtypes), (outs[num_carry:], made)

    if hook.eager:
        carry, ys = init, []
        for i in reversed(range(length)) if reverse else range(length):
            carry, (y, _) = step(carry, [x[i] for x in xs])
            ys.append(y)
        if reverse:
            ys.reverse()
        ys_avals = [v.aval for v in eqn.outvars[num_carry:]]
        ys = [
            jnp.stack([y[k] for y in ys]) if ys else jnp.zeros(a.shape, a.dtype)
            for k, a in enumerate(ys_avals)
        ]
        return [*carry, *ys], [Origin.DATA] * num_carry + (
            ys_origins or [Origin.DATA] * len(ys)
        )
    kwargs = {"_split_transpose": True} if eqn.params.get("_split_transpose") else {}
    carry, (ys, made) = lax.scan(
        step,
        init,
        xs,
        length=length,
        reverse=reverse,
        unroll=eqn.params["unroll"],
        **kwargs,
    )
    return [*carry, *ys], [Origin.DATA] * num_carry + ys_origins, made


def while_loop(run: Run, eqn, invals, in_origins, frame, hook):
    cond_nconsts = eqn.params["cond_nconsts"]
    body_nconsts = eqn.params["body_nconsts"]
    cond_consts = invals[:cond_nconsts]
    body_consts = invals[cond_nconsts : cond_nconsts + body_nconsts]
    carry_vars = eqn.invars[cond_nconsts + body_nconsts :]
    carry_dtypes = traced_dtypes(carry_vars)
    init = cast_to(invals[cond_nconsts + body_nconsts :], carry_dtypes)
    carry_origins = [Origin.DATA] * len(carry_vars)
    body_frame = frame.call(eqn)

    def cond_fun(carry):
        origins = [*in_origins[:cond_nconsts], *carry_origins]
        return run(
            eqn.params["cond_jaxpr"], [*cond_consts, *carry], hook, body_frame, origins
        )[0][0]

    def body_fun(carry):
        origins = [
            *in_origins[cond_nconsts : cond_nconsts + body_nconsts],
            *carry_origins,
        ]
        outs, *_ = run(
            eqn.params["body_jaxpr"], [*body_consts, *carry], hook, body_frame, origins
        )
        return cast_to(outs, carry_dtypes)

    if hook.eager:
        carry = init
        while bool(cond_fun(carry)):
            carry = body_fun(carry)
        return carry, carry_origins
    return lax.while_loop(cond_fun, body_fun, init), carry_origins


def cond(run: Run, eqn, invals, in_origins, frame, hook):
    index, *operands = invals
    out_dtypes = traced_dtypes(eqn.outvars)
    body_frame = frame.call(eqn)
    out_origins = [Origin.DATA] * len(eqn.outvars)

    def branch(closed, *ops):
        outs, *_ = run(closed, ops, hook, body_frame, in_origins[1:])
        return cast_to(outs, out_dtypes)

    branches = eqn.params["branches"]
    if hook.eager:
        chosen = branches[int(np.clip(int(index), 0, len(branches) - 1))]
        return branch(chosen, *operands), out_origins
    platforms = compat.branch_platforms(eqn.params)
    if platforms is not None:
        # A switch would lower every branch for every platform (a cuDNN-only one
        # fails on a CPU): the choice stays with the platform.
        per_platform, default = {}, None
        for names, closed in zip(platforms, branches):
            if names is None:
                default = ft.partial(branch, closed)
            else:
                per_platform.update(dict.fromkeys(names, ft.partial(branch, closed)))
        return lax.platform_dependent(
            *operands, default=default, **per_platform
        ), out_origins
    return lax.switch(
        index, [ft.partial(branch, b) for b in branches], *operands
    ), out_origins
