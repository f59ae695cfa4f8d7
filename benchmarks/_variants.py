"""The variants: one training step of a `Task`, in float32, by hand, with eqx_amp and
with the peer libraries, each written the way its own documentation recommends.

A variant's `build(task)` returns a `Built`: a pure Python step
`step(state, batch) -> (state, loss)` (the runner partitions `state` into arrays and
static parts and `jax.jit`s it), the initial state, the function whose saved
residuals are measured (`loss_of(diff_args)`, with the arguments the variant
differentiates), and how to get the float32 master model out of a state. `build` is
called afresh for every trace-time measurement, so no cache is shared between two
measurements.

Every variant uses `optax.adam` with the same learning rate, sees the same batches in
the same order and starts from the same float32 weights.
"""

import dataclasses
import functools as ft
import importlib
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from _models import Task, cross_entropy, replace_norms
from jaxtyping import PyTree

import eqx_amp


@dataclasses.dataclass
class Built:
    step: Callable[[PyTree, tuple], tuple[PyTree, jax.Array]]
    state: PyTree
    # The differentiated function and its arguments, for the saved-residual count.
    loss_of: Callable[[PyTree], jax.Array]
    diff_args: PyTree
    # The float32 model a state holds (evaluated in float32 for the final loss).
    master: Callable[[PyTree], eqx.Module]


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    family: str  # "baseline", "eqx_amp" or "peer"
    dtype: str  # compute dtype: "f32", "bf16", "f16"
    scaling: str  # how the loss is scaled and non-finite steps handled
    build: Callable[[Task], Built]
    requires: str | None = None  # the peer's import name
    package: str | None = None  # the peer's PyPI name

    def unavailable(self) -> str | None:
        """Why this variant cannot run here (a missing package), or None."""
        if self.requires is None:
            return None
        try:
            importlib.import_module(self.requires)
        except Exception as e:  # noqa: BLE001 - any import failure is reported
            return f"not installed: pip install {self.package} ({_first_line(e)})"
        return None


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text.strip().splitlines()[0]


def _params(model: PyTree) -> PyTree:
    return eqx.filter(model, eqx.is_inexact_array)


def _loss_of_params(loss_fn: Callable, model: eqx.Module, batch: tuple):
    """`loss_fn` as a function of the floating leaves of `model` only."""
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss_of(p):
        return loss_fn(eqx.combine(p, static), *batch)

    return loss_of, params


def _plain_step(task: Task, loss_fn: Callable) -> Built:
    """`eqx.filter_value_and_grad` of `loss_fn` and an optax update: the float32
    training loop, and every bfloat16 variant that needs no loss scaling."""
    optimizer = task.optimizer

    def step(state, batch):
        model, opt_state = state
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, _params(model))
        return (eqx.apply_updates(model, updates), opt_state), loss

    state = (task.model, optimizer.init(_params(task.model)))
    loss_of, diff_args = _loss_of_params(loss_fn, task.model, task.batch(0))
    return Built(step, state, loss_of, diff_args, master=lambda s: s[0])


def _scaled_step(task: Task, loss_fn: Callable) -> Built:
    """eqx_amp's float16 loop: `eqx_amp.filter_value_and_grad` with a
    `DynamicLossScale`, non-finite steps skipped by `eqx_amp.select_tree`."""
    optimizer = task.optimizer
    grad_fn = eqx_amp.filter_value_and_grad(loss_fn)

    def step(state, batch):
        model, opt_state, loss_scale = state
        (loss, grads), loss_scale, finite = grad_fn(
            model, *batch, loss_scale=loss_scale
        )
        updates, new_opt_state = optimizer.update(grads, opt_state, _params(model))
        new_model = eqx.apply_updates(model, updates)
        model, opt_state = eqx_amp.select_tree(
            finite, (new_model, new_opt_state), (model, opt_state)
        )
        return (model, opt_state, loss_scale), loss

    state = (
        task.model,
        optimizer.init(_params(task.model)),
        eqx_amp.DynamicLossScale(2.0**15),
    )
    loss_of, diff_args = _loss_of_params(loss_fn, task.model, task.batch(0))
    return Built(step, state, loss_of, diff_args, master=lambda s: s[0])


_HALF = {"bf16": jnp.bfloat16, "f16": jnp.float16}
_POLICY = {"bf16": "mixed_bfloat16", "f16": "mixed_float16"}


#
# Baselines.
#


def fp32(task: Task) -> Built:
    def loss_fn(model, x, y):
        return cross_entropy(jax.vmap(model)(x), y)

    return _plain_step(task, loss_fn)


class _Float32Norm(eqx.Module):
    """A normalisation layer run in float32: input cast up, output cast back."""

    norm: eqx.Module

    def __call__(self, x, *args, **kwargs):
        return self.norm(x.astype(jnp.float32), *args, **kwargs).astype(x.dtype)


def hand_cast(model: eqx.Module, dtype) -> eqx.Module:
    """The ideal, by hand: norm layers wrapped to run in float32 (`eqx.tree_at`),
    every other floating parameter cast to `dtype` (`eqx.partition`/`combine`)."""
    model = replace_norms(model, _Float32Norm)
    is_kept = lambda x: isinstance(x, _Float32Norm)  # noqa: E731
    kept, rest = eqx.partition(model, is_kept, is_leaf=is_kept)
    rest = jtu.tree_map(
        lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, rest
    )
    return eqx.combine(kept, rest, is_leaf=is_kept)


def hand(dtype: str):
    half = _HALF[dtype]

    def build(task: Task) -> Built:
        def loss_fn(model, x, y):
            if jnp.issubdtype(x.dtype, jnp.floating):
                x = x.astype(half)
            return cross_entropy(jax.vmap(hand_cast(model, half))(x), y)

        return _plain_step(task, loss_fn)

    return build


#
# eqx_amp.
#


def wrapped(wrap: Callable):
    """A variant that calls `jax.vmap(wrap(model, policy=...))` inside the loss:
    `eqx_amp.filter_amp` or `eqx_amp.autocast`."""

    def variant(dtype: str):
        def build(task: Task) -> Built:
            def loss_fn(model, x, y):
                forward = wrap(model, policy=_POLICY[dtype])
                return cross_entropy(jax.vmap(forward)(x), y)

            return (_plain_step if dtype == "bf16" else _scaled_step)(task, loss_fn)

        return build

    return variant


filter_amp = wrapped(eqx_amp.filter_amp)
autocast = wrapped(eqx_amp.autocast)
# fp8 matmuls (current scaling), everything else as autocast in bfloat16.
autocast_fp8 = wrapped(
    ft.partial(eqx_amp.autocast, rules={jax.lax.dot_general_p: eqx_amp.fp8.TENSORWISE})
)
# As `autocast_fp8`, with attention's batched products (q.k and the probabilities
# times v, which read no parameter) in fp8 too.
autocast_fp8_attention = wrapped(
    ft.partial(
        eqx_amp.autocast,
        rules={
            jax.lax.dot_general_p: eqx_amp.fp8.TENSORWISE.with_activation_products()
        },
    )
)
# Rowwise matmuls; convolutions in fp8 too (an fp8 convolution is scaled tensorwise).
autocast_fp8_rowwise = wrapped(
    ft.partial(
        eqx_amp.autocast,
        rules={
            jax.lax.dot_general_p: eqx_amp.fp8.ROWWISE,
            jax.lax.conv_general_dilated_p: eqx_amp.fp8.ROWWISE,
        },
    )
)
# The same, where an fp8 GEMM pays for rowwise quantisation (an H100 estimate).
autocast_fp8_rowwise_paying = wrapped(
    ft.partial(
        eqx_amp.autocast,
        rules={
            jax.lax.dot_general_p: eqx_amp.fp8.ROWWISE.where_it_pays(),
            jax.lax.conv_general_dilated_p: eqx_amp.fp8.ROWWISE.where_it_pays(),
        },
    )
)
# The matmuls and convolutions that read the model's parameters, in fp8.
filter_amp_fp8 = wrapped(ft.partial(eqx_amp.filter_amp, fp8=eqx_amp.fp8.TENSORWISE))
# Those whose fp8 GEMMs pay for their quantisation (an H100 estimate from the shapes).
filter_amp_fp8_paying = wrapped(
    ft.partial(eqx_amp.filter_amp, fp8=eqx_amp.fp8.TENSORWISE.where_it_pays())
)


def filter_amp_fp8_delayed(
    weights: bool, history: int = 16, rule=None, scales_in_gemm: bool = False
):
    """`filter_amp(eqx.filter_vmap(model), fp8=TENSORWISE)` with delayed scaling
    (`eqx_amp.fp8.DelayedScaling`, Transformer Engine's recipe): each activation's
    and output gradient's scale (and with `weights`, each weight's) from the largest
    of its last `history` amaxes, kept in the training state, this step's amaxes
    taken in the pass that quantises each tensor; with `scales_in_gemm`, a GPU's
    forward GEMMs apply the scales. The state starts uncalibrated (scales of 1):
    the compiled step is the same, and the benchmarks compile models too large to
    run on a CPU."""

    def build(task: Task) -> Built:
        optimizer = task.optimizer

        def forward(model, x):
            amp = eqx_amp.filter_amp(
                eqx.filter_vmap(model), policy="mixed_bfloat16",
                fp8=rule or eqx_amp.fp8.TENSORWISE,
            )  # fmt: skip
            return amp(x)

        def loss_fn(model, x, y):
            return cross_entropy(forward(model, x), y)

        def scaled_loss(diff, x, y):
            model, scaling = diff
            with eqx_amp.fp8.delayed(scaling):
                return loss_fn(model, x, y)

        def step(state, batch):
            model, opt_state, scaling = state
            loss, (grads, observed) = eqx.filter_value_and_grad(scaled_loss)(
                (model, scaling), *batch
            )
            updates, opt_state = optimizer.update(grads, opt_state, _params(model))
            scaling = scaling.update(observed)
            return (eqx.apply_updates(model, updates), opt_state, scaling), loss

        scaling = eqx_amp.fp8.DelayedScaling.init(
            loss_fn, task.model, *task.batch(0), history=history, weights=weights,
            calibrate=False, scales_in_gemm=scales_in_gemm,
        )  # fmt: skip
        state = (task.model, optimizer.init(_params(task.model)), scaling)
        loss_of, diff_args = _loss_of_params(loss_fn, task.model, task.batch(0))
        return Built(step, state, loss_of, diff_args, master=lambda s: s[0])

    return build


def bimodel(dtype: str, fp8=None):
    def build(task: Task) -> Built:
        optimizer = task.optimizer

        def loss_fn(bm, x, y):
            return cross_entropy(jax.vmap(bm)(x), y)

        def step(state, batch):
            bm, opt_state, loss_scale = state
            (loss, grads), loss_scale, finite = eqx_amp.filter_value_and_grad(loss_fn)(
                bm, *batch, loss_scale=loss_scale
            )
            updates, new_opt_state = optimizer.update(
                grads, opt_state, _params(bm.master)
            )
            new_bm = bm.apply_updates(updates)
            if dtype == "f16":
                new_bm, new_opt_state = eqx_amp.select_tree(
                    finite, (new_bm, new_opt_state), (bm, opt_state)
                )
            return (new_bm, new_opt_state, loss_scale), loss

        bm = eqx_amp.BiModel(task.model, policy=_POLICY[dtype], fp8=fp8)
        loss_scale = (
            eqx_amp.NoOpLossScale()
            if dtype == "bf16"
            else eqx_amp.DynamicLossScale(2.0**15)
        )
        state = (bm, optimizer.init(_params(bm.master)), loss_scale)
        # Differentiated with respect to the compute copy, as `value_and_grad` does.
        c_params, c_static = eqx.partition(bm.compute, eqx.is_inexact_array)
        batch = task.batch(0)

        def loss_of(c):
            return loss_fn(bm.with_compute(eqx.combine(c, c_static)), *batch)

        return Built(step, state, loss_of, c_params, master=lambda s: s[0].master)

    return build


#
# Peers, each as its own README recommends.
#


def jmp_variant(dtype: str):
    """jmp (google-deepmind/jmp): a `Policy` casts parameters and inputs to the
    compute dtype inside the loss and the output back; the README keeps
    normalisation layers in float32 with a per-module policy (Haiku's
    `set_policy(hk.BatchNorm, ...)`), here a wrapper module. bfloat16 uses
    `NoOpLossScale`, and the README skips non-finite steps only for a dynamic scale.
    """

    def build(task: Task) -> Built:
        import jmp

        policy = jmp.get_policy(
            f"params=float32,compute={_jmp_name(dtype)},output=float32"
        )
        norm_policy = jmp.get_policy(
            f"params=float32,compute=float32,output={_jmp_name(dtype)}"
        )

        class NormWithPolicy(eqx.Module):
            norm: eqx.Module

            def __call__(self, x, *args, **kwargs):
                norm = norm_policy.cast_to_compute(self.norm)
                out = norm(norm_policy.cast_to_compute(x), *args, **kwargs)
                return norm_policy.cast_to_output(out)

        is_norm = lambda x: isinstance(x, NormWithPolicy)  # noqa: E731
        optimizer = task.optimizer
        loss_scale = (
            jmp.NoOpLossScale()
            if dtype == "bf16"
            else jmp.DynamicLossScale(jnp.asarray(2.0**15, jnp.float32))
        )

        def loss_fn(model, x, y, loss_scale):
            model = replace_norms(model, NormWithPolicy)
            norms, rest = eqx.partition(model, is_norm, is_leaf=is_norm)
            model = eqx.combine(norms, policy.cast_to_compute(rest), is_leaf=is_norm)
            logits = policy.cast_to_output(jax.vmap(model)(policy.cast_to_compute(x)))
            return loss_scale.scale(cross_entropy(logits, y))

        def step(state, batch):
            model, opt_state, loss_scale = state
            loss, grads = eqx.filter_value_and_grad(loss_fn)(
                model, *batch, loss_scale=loss_scale
            )
            grads = policy.cast_to_param(grads)
            grads = loss_scale.unscale(grads)
            loss = loss_scale.unscale(loss)
            params = _params(model)
            updates, new_opt_state = optimizer.update(grads, opt_state, params)
            new_params = eqx.apply_updates(params, updates)
            if isinstance(loss_scale, jmp.DynamicLossScale):
                finite = jmp.all_finite(grads)
                loss_scale = loss_scale.adjust(finite)
                new_params = jmp.select_tree(finite, new_params, params)
                new_opt_state = jmp.select_tree(finite, new_opt_state, opt_state)
            model = eqx.combine(new_params, model)
            return (model, new_opt_state, loss_scale), loss

        state = (task.model, optimizer.init(_params(task.model)), loss_scale)
        loss_of, diff_args = _loss_of_params(
            ft.partial(loss_fn, loss_scale=loss_scale), task.model, task.batch(0)
        )
        return Built(step, state, loss_of, diff_args, master=lambda s: s[0])

    return build


def _jmp_name(dtype: str) -> str:
    return {"bf16": "bfloat16", "f16": "float16"}[dtype]


def mpx_variant(dtype: str):
    """mpx (mixed-precision-for-JAX): `mpx.filter_value_and_grad` with a
    `DynamicLossScaling` casts the whole model and the batch to half precision and
    scales the loss; `mpx.optimizer_update` skips non-finite steps. The README has
    the user force norm layers and the loss mean to float32 with
    `mpx.force_full_precision`."""

    def build(task: Task) -> Built:
        import mpx

        half = _HALF[dtype]

        class FullPrecisionNorm(eqx.Module):
            norm: eqx.Module

            def __call__(self, x, *args, **kwargs):
                return mpx.force_full_precision(self.norm, x.dtype)(x, *args, **kwargs)

        def loss_fn(model, x, y):
            model = replace_norms(model, FullPrecisionNorm)
            logits = jax.vmap(model)(x)
            return mpx.force_full_precision(cross_entropy, jnp.float32)(logits, y)

        optimizer = task.optimizer

        def step(state, batch):
            # mpx keeps its half dtype in a module global; set it where it is read,
            # at trace time.
            mpx.set_half_precision_datatype(half)
            model, opt_state, scaling = state
            loss, scaling, finite, grads = mpx.filter_value_and_grad(
                loss_fn, scaling=scaling
            )(model, *batch)
            model, opt_state = mpx.optimizer_update(
                model, optimizer, opt_state, grads, finite
            )
            return (model, opt_state, scaling), loss

        scaling = mpx.DynamicLossScaling(
            loss_scaling=jnp.asarray(65504.0, jnp.float32),
            min_loss_scaling=jnp.ones((), jnp.float32),
            period=2000,
        )
        state = (task.model, optimizer.init(_params(task.model)), scaling)
        # mpx differentiates with respect to the half-precision copy it makes.
        mpx.set_half_precision_datatype(half)
        half_model = mpx.cast_to_half_precision(task.model)
        x, y = task.batch(0)
        loss_of, diff_args = _loss_of_params(
            loss_fn, half_model, (mpx.cast_to_half_precision(x), y)
        )
        return Built(step, state, loss_of, diff_args, master=lambda s: s[0])

    return build


def jaxamp_variant(dtype: str):
    """jaxamp: `jaxamp.amp(loss_fn, compute_dtype=...)` (its jaxpr interpreter, default
    policy) under `jaxamp.dynamic_scale_value_and_grad` with a `DynamicScalerState`,
    as in its README."""

    def build(task: Task) -> Built:
        import jaxamp

        def loss_fn(model, x, y):
            return cross_entropy(jax.vmap(model)(x), y)

        amp_loss = jaxamp.amp(loss_fn, compute_dtype=_HALF[dtype])
        grad_fn = jaxamp.dynamic_scale_value_and_grad(amp_loss)
        optimizer = task.optimizer

        def step(state, batch):
            model, opt_state, scaler = state
            scaler, (loss, grads) = grad_fn(model, *batch, dynamic_scaler_state=scaler)
            updates, opt_state = optimizer.update(grads, opt_state, _params(model))
            return (eqx.apply_updates(model, updates), opt_state, scaler), loss

        state = (
            task.model,
            optimizer.init(_params(task.model)),
            jaxamp.DynamicScalerState(),
        )
        loss_of, diff_args = _loss_of_params(amp_loss, task.model, task.batch(0))
        return Built(step, state, loss_of, diff_args, master=lambda s: s[0])

    return build


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in [
        Variant("fp32", "baseline", "f32", "none", fp32),
        Variant("hand_bf16", "baseline", "bf16", "none", hand("bf16")),
        Variant("filter_amp_bf16", "eqx_amp", "bf16", "none", filter_amp("bf16")),
        Variant("autocast_bf16", "eqx_amp", "bf16", "none", autocast("bf16")),
        Variant("bimodel_bf16", "eqx_amp", "bf16", "no-op", bimodel("bf16")),
        Variant("filter_amp_f16", "eqx_amp", "f16", "dynamic+skip", filter_amp("f16")),
        Variant("autocast_f16", "eqx_amp", "f16", "dynamic+skip", autocast("f16")),
        Variant("bimodel_f16", "eqx_amp", "f16", "dynamic+skip", bimodel("f16")),
        Variant("autocast_fp8", "eqx_amp", "fp8", "none", autocast_fp8("bf16")),
        Variant(
            "autocast_fp8_rowwise", "eqx_amp", "fp8", "none",
            autocast_fp8_rowwise("bf16"),
        ),
        Variant(
            "autocast_fp8_rowwise_paying", "eqx_amp", "fp8", "none",
            autocast_fp8_rowwise_paying("bf16"),
        ),
        Variant(
            "autocast_fp8_attention", "eqx_amp", "fp8", "none",
            autocast_fp8_attention("bf16"),
        ),
        Variant("filter_amp_fp8", "eqx_amp", "fp8", "none", filter_amp_fp8("bf16")),
        Variant(
            "filter_amp_fp8_paying", "eqx_amp", "fp8", "none",
            filter_amp_fp8_paying("bf16"),
        ),
        Variant(
            "filter_amp_fp8_delayed", "eqx_amp", "fp8", "none",
            filter_amp_fp8_delayed(weights=False),
        ),
        Variant(
            "filter_amp_fp8_delayed_weights", "eqx_amp", "fp8", "none",
            filter_amp_fp8_delayed(weights=True),
        ),
        Variant(
            "filter_amp_fp8_delayed_gemm", "eqx_amp", "fp8", "none",
            filter_amp_fp8_delayed(weights=True, scales_in_gemm=True),
        ),
        Variant(
            "bimodel_fp8", "eqx_amp", "fp8", "no-op",
            bimodel("bf16", fp8=eqx_amp.fp8.TENSORWISE),
        ),
        Variant(
            "jmp_bf16", "peer", "bf16", "no-op", jmp_variant("bf16"),
            requires="jmp", package="jmp",
        ),
        Variant(
            "mpx_bf16", "peer", "bf16", "dynamic+skip", mpx_variant("bf16"),
            requires="mpx", package="mixed-precision-for-JAX",
        ),
        Variant(
            "jaxamp_bf16", "peer", "bf16", "dynamic+redo", jaxamp_variant("bf16"),
            requires="jaxamp", package="jaxamp",
        ),
    ]
}  # fmt: skip

# The fp8 roads beyond `autocast_fp8` run in `--variants all` and the H100 compile
# (`--preset h100-aot`); a CPU has no fp8 GEMM to time them on.
MORE_FP8 = (
    "autocast_fp8_rowwise", "autocast_fp8_rowwise_paying", "autocast_fp8_attention",
    "filter_amp_fp8",
    "filter_amp_fp8_paying", "bimodel_fp8", "filter_amp_fp8_delayed",
    "filter_amp_fp8_delayed_weights", "filter_amp_fp8_delayed_gemm",
)  # fmt: skip
DEFAULT_VARIANTS = tuple(n for n in VARIANTS if n not in MORE_FP8)
EQX_AMP_ONLY = tuple(
    n
    for n, v in VARIANTS.items()
    if v.family in ("baseline", "eqx_amp") and n not in MORE_FP8
)
