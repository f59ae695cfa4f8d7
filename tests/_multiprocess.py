"""One process of a multi-process run, for `tests/test_multiprocess.py`.

Started N times by `eqx_amp.tools.launch_local` (every process the same script, as on
N hosts); runs the checks named on its command line and prints one line per check,
`REPORT {"check": ..., ...}`, with what that process measured. The test compares the
processes with each other and with one process holding all the devices.

    python -m eqx_amp.tools.launch_local 2 --cpu-devices 4 -- \\
        python tests/_multiprocess.py fsdp scaling global
"""

import hashlib
import json
import os
import pathlib
import sys


ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import jax  # noqa: E402


jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    os.environ["JAX_COORDINATOR_ADDRESS"],
    num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
    process_id=int(os.environ["JAX_PROCESS_ID"]),
)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import jax.tree_util as jtu  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import eqx_amp  # noqa: E402


AUTO = jax.sharding.AxisType.Auto
BF16 = eqx_amp.get_policy("mixed_bfloat16")
F16 = eqx_amp.get_policy("p=f32,c=f16,o=f32,reduce=f32")


def report(check: str, **values) -> None:
    print("REPORT " + json.dumps({"check": check, **values}), flush=True)


#
# Global arrays from values every process holds, and back.
#


def place(tree, shardings):
    """Puts each array of `tree` (the same value on every process) onto its
    sharding; typed PRNG keys through their data, which `device_put` refuses."""

    def put(x, sharding):
        if sharding is None or not eqx.is_array(x):
            return x
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jr.wrap_key_data(jax.device_put(jr.key_data(x), sharding))
        # From the host: a device array could be aliased, and donated by the step.
        return jax.device_put(np.asarray(x), sharding)

    return jtu.tree_map(put, tree, shardings, is_leaf=lambda x: x is None)


def on_mesh(tree, mesh):
    """The arrays of `tree` on one device (a fresh optimizer state's step count, a
    loss scale) replicated over `mesh`, where the step puts them: its first call then
    sees the shardings of the later ones, and it compiles once."""
    replicated = NamedSharding(mesh, P())

    def put(x):
        if eqx.is_array(x) and not isinstance(x.sharding, NamedSharding):
            return place(x, replicated)
        return x

    return jtu.tree_map(put, tree)


def host(x) -> np.ndarray:
    """The whole value of a global array, on every process (a collective)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jr.key_data(x)
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def digest(tree) -> str:
    """A hash of the bits, dtypes and shapes of every array of `tree` (a collective:
    the arrays are gathered in one call, one compilation, not one per leaf)."""
    leaves = jtu.tree_leaves(eqx.filter(tree, eqx.is_array))
    leaves = [
        jr.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        for x in leaves
    ]
    spread = [i for i, x in enumerate(leaves) if not x.is_fully_addressable]
    values = [np.asarray(x) if x.is_fully_addressable else None for x in leaves]
    if spread:
        gathered = multihost_utils.process_allgather(
            [leaves[i] for i in spread], tiled=True
        )
        for i, value in zip(spread, gathered):
            values[i] = np.asarray(value)
    h = hashlib.sha256()
    for value in values:
        h.update(f"{value.dtype}{value.shape}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()[:16]


def shardings_of(tree):
    return jtu.tree_map(
        lambda x: x.sharding if eqx.is_array(x) else None,
        eqx.filter(tree, eqx.is_array),
    )


def local_rows(x: np.ndarray, n_rows: int | None = None):
    """This process's rows of a global batch: what a host reads from its own
    loader. `n_rows` overrides the count (a bad set-up)."""
    per = x.shape[0] // jax.process_count()
    start = jax.process_index() * per
    return x[start : start + (per if n_rows is None else n_rows)]


def put_batch(sharding, *arrays):
    return tuple(
        jax.make_array_from_process_local_data(sharding, local_rows(np.asarray(a)))
        for a in arrays
    )


#
# The FSDP + tensor-parallel step of examples/fsdp.py, on every road.
#


def fsdp_check():
    import fsdp  # examples/fsdp.py

    mesh = jax.make_mesh((4, 2), (fsdp.DATA, fsdp.MODEL), axis_types=(AUTO, AUTO))
    batch_sharding = NamedSharding(mesh, P(fsdp.DATA, None))
    vocab, block, batch = 32, 8, 8
    rng = np.random.default_rng(0)
    data = [
        (rng.integers(0, vocab, (batch, block)), rng.integers(0, vocab, (batch, block)))
        for _ in range(3)
    ]
    model = fsdp.GPT(vocab, 16, 2, 1, block, key=jr.key(0))

    def run(name, policy, *, fp8=None, road="filter_amp"):
        params, static = eqx.partition(model, eqx.is_array)
        shardings = fsdp.shard_like_specs(params, mesh)
        params = place(params, shardings)
        optimizer = optax.adamw(1e-2)
        if policy.compute_dtype == jnp.float16:
            optimizer = eqx_amp.loss_scaling(optimizer)
        if road == "bimodel":
            # Built from the sharded weights: the compute copy takes their shardings.
            # It holds the batched model, as `filter_amp` wraps it in the example.
            bimodel = eqx.filter_vmap(eqx.combine(params, static))
            bimodel = eqx_amp.BiModel(bimodel, policy=policy)
            params, static = eqx.partition(bimodel, eqx.is_array)
            shardings = shardings_of(bimodel)
            opt_state = optimizer.init(eqx.filter(bimodel.master, eqx.is_inexact_array))
        else:
            opt_state = optimizer.init(params)
        opt_state = on_mesh(opt_state, mesh)
        opt_shardings = shardings_of(opt_state)
        if road == "filter_amp":
            step = fsdp.make_step(policy, optimizer, shardings, fp8, opt_shardings)
        else:
            step = other_road_step(
                road, policy, optimizer, (shardings, opt_shardings), static
            )
        losses = []
        for inputs, targets in data:
            params, opt_state, loss = step(
                params, opt_state, static, *put_batch(batch_sharding, inputs, targets)
            )
            losses.append(float(loss))
        kept = all(
            p.sharding.is_equivalent_to(s, p.ndim)
            for p, s in zip(jtu.tree_leaves(params), jtu.tree_leaves(shardings))
        )
        report(
            "fsdp",
            road=name,
            losses=losses,
            params=digest(params),
            opt_state=digest(opt_state),
            kept=kept,
        )

    def other_road_step(road, policy, optimizer, shardings, static):
        # `static` is closed over: a BiModel's (it holds `filter_vmap`'s wrapper) is
        # not hashable, so it cannot be a static argument.
        def step(params, opt_state, inputs, targets):
            if road == "autocast":

                def loss_fn(params):
                    model = eqx.filter_vmap(eqx.combine(params, static))
                    logits = eqx_amp.autocast(model, policy=policy)(inputs)
                    return fsdp.cross_entropy(logits, targets)

                loss, grads = eqx.filter_value_and_grad(loss_fn)(params)
                updates, opt_state = optimizer.update(grads, opt_state, params)
                params = eqx.apply_updates(params, updates)
            else:
                bimodel = eqx.combine(params, static)

                def bimodel_loss(bimodel):
                    return fsdp.cross_entropy(bimodel(inputs), targets)

                (loss, grads), _, _ = eqx_amp.filter_value_and_grad(bimodel_loss)(
                    bimodel, loss_scale=eqx_amp.NoOpLossScale()
                )
                master = eqx.filter(bimodel.master, eqx.is_inexact_array)
                updates, opt_state = optimizer.update(grads, opt_state, master)
                params = eqx.filter(bimodel.apply_updates(updates), eqx.is_array)
            params, opt_state = jax.lax.with_sharding_constraint(
                (params, opt_state), shardings
            )
            return params, opt_state, loss

        jitted = jax.jit(step, donate_argnums=(0, 1))
        return lambda params, opt_state, _, *batch: jitted(params, opt_state, *batch)

    run("filter_amp bf16", BF16)
    run("autocast bf16", BF16, road="autocast")
    run("BiModel bf16", BF16, road="bimodel")
    run("fp8 tensorwise", BF16, fp8=eqx_amp.fp8.TENSORWISE)
    run("filter_amp f16 + loss scaling", F16)


#
# Loss scaling: an overflow in one process's rows only.
#


def data_mesh():
    return jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AUTO,))


def regression_batches(steps, poisoned):
    """Global batches of 64 rows; at step `poisoned` the targets of the last 16 rows
    (the last process's, in 2 or 4 processes) are 1e4: float16's scaled gradient
    overflows there, and only there."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(steps):
        x = rng.normal(size=(64, 8)).astype(np.float32)
        y = np.sin(x).sum(axis=1, keepdims=True).astype(np.float32)
        if i == poisoned:
            y[-16:] = 1e4
        out.append((x, y))
    return out


def scaling_check():
    mesh = data_mesh()
    rows = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())
    model = eqx.nn.MLP(8, 1, 32, 1, key=jr.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    batches = regression_batches(4, poisoned=1)

    def mse(model, x, y):
        pred = eqx_amp.filter_amp(eqx.filter_vmap(model), policy="mixed_float16")(x)
        return jnp.mean((pred - y) ** 2)

    # The short form under jit: the global gradient overflows, so every process
    # skips, and the loss scale in the optimizer state backs off.
    optimizer = eqx_amp.loss_scaling(
        optax.sgd(0.1), eqx_amp.DynamicLossScale(2.0**15, period=100)
    )
    jit_params = place(params, jtu.tree_map(lambda _: replicated, params))
    opt_state = on_mesh(optimizer.init(jit_params), mesh)

    @jax.jit
    def jit_step(params, opt_state, x, y):
        grad_fn = eqx_amp.scaled_value_and_grad(
            lambda p: mse(eqx.combine(p, static), x, y)
        )
        (loss, grads), opt_state = grad_fn(params, opt_state=opt_state)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state, loss

    finite, scales, losses = [], [], []
    for x, y in batches:
        jit_params, opt_state, loss = jit_step(
            jit_params, opt_state, *put_batch(rows, x, y)
        )
        finite.append(bool(opt_state.last_finite))
        scales.append(float(opt_state.loss_scale.loss_scale))
        losses.append(float(loss))
    report(
        "scaling",
        road="jit, loss_scaling",
        finite=finite,
        scales=scales,
        losses=losses,
        params=digest(jit_params),
        skipped=int(opt_state.total_notfinite),
    )

    # The explicit form under shard_map: `axis_name` agrees on the step across every
    # device of every process; with `redo_on_nan` the step is recomputed instead.
    for redo in (0, 3):
        grad_fn = eqx_amp.filter_value_and_grad(
            lambda m, x, y: jax.lax.pmean(mse(m, x, y), "data"),
            axis_name="data",
            redo_on_nan=redo,
        )

        def step(params, scale, x, y):
            model = eqx.combine(params, static)
            (loss, grads), scale, ok = grad_fn(model, x, y, loss_scale=scale)
            new = eqx.apply_updates(model, jtu.tree_map(lambda g: -1e-3 * g, grads))
            model = eqx_amp.select_tree(ok, new, model)
            # Each device's own verdict and scale, to see that they all agree.
            mine = (ok[None], scale.loss_scale[None])
            return eqx.filter(model, eqx.is_array), scale, loss, mine

        sharded = jax.jit(
            jax.shard_map(
                step,
                mesh=mesh,
                in_specs=(P(), P(), P("data"), P("data")),
                out_specs=(P(), P(), P(), P("data")),
            )
        )
        sm_params = place(params, jtu.tree_map(lambda _: replicated, params))
        scale = on_mesh(
            eqx_amp.DynamicLossScale(2.0**15, period=100, factor=2**6), mesh
        )
        finite, scales, losses, devices_agree = [], [], [], []
        for x, y in batches:
            sm_params, scale, loss, (oks, per_device) = sharded(
                sm_params, scale, *put_batch(rows, x, y)
            )
            local_oks = [bool(s.data[0]) for s in oks.addressable_shards]
            local_scales = [float(s.data[0]) for s in per_device.addressable_shards]
            devices_agree.append(
                len(set(local_oks)) == 1
                and local_scales == [float(scale.loss_scale)] * len(local_scales)
            )
            finite.append(local_oks[0])
            scales.append(float(scale.loss_scale))
            losses.append(float(loss))
        report(
            "scaling",
            road=f"shard_map, redo_on_nan={redo}",
            finite=finite,
            scales=scales,
            losses=losses,
            params=digest(sm_params),
            devices_agree=devices_agree,
        )


#
# Values that must be global: gathered weights, reduced gradients, telemetry.
#


def global_check():
    mesh = data_mesh()
    n = jax.device_count()
    rows = NamedSharding(mesh, P("data"))
    model = eqx.nn.MLP(32, 16, 32, 1, key=jr.key(1))
    params, static = eqx.partition(model, eqx.is_array)
    specs = jtu.tree_map(lambda x: P("data") if x.shape[0] % n == 0 else P(), params)
    shards = place(params, jtu.tree_map(lambda s: NamedSharding(mesh, s), specs))
    rng = np.random.default_rng(1)
    x_host = rng.normal(size=(64, 32)).astype(np.float32)
    x_host[-1, 0] = 100.0  # the largest input: in the last process's rows
    (x,) = put_batch(rows, x_host)

    def local_loss(shards, x, policy, fp8):
        gathered = eqx_amp.sharding.gather_params(
            shards, "data", specs=specs, policy=policy, fp8=fp8
        )
        model = eqx.filter_vmap(eqx.combine(gathered, static))
        out = eqx_amp.filter_amp(model, policy=policy, fp8=fp8)(x)
        return jax.lax.pmean(jnp.mean(out.astype(jnp.float32) ** 2), "data")

    # Reference: the whole model and batch on this process's first device.
    def whole_loss(params, x):
        return jnp.mean(jax.vmap(eqx.combine(params, static))(x) ** 2)

    local = jax.local_devices()[0]
    whole = jax.device_put((params, x_host), local)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(whole_loss))(*whole)
    ref_grads = [np.asarray(g) for g in jtu.tree_leaves(ref_grads)]

    def rel_error(grads):
        return max(
            float(np.linalg.norm(host(g) - r) / np.linalg.norm(r))
            for g, r in zip(jtu.tree_leaves(grads), ref_grads)
        )

    for name, policy, fp8 in (
        ("gather_params bf16, reduce f32", BF16.with_reduce_dtype(jnp.float32), None),
        ("gather_params fp8", BF16, eqx_amp.fp8.TENSORWISE),
    ):
        grads_fn = jax.jit(
            jax.shard_map(
                jax.value_and_grad(lambda s, x: local_loss(s, x, policy, fp8)),
                mesh=mesh,
                in_specs=(specs, P("data")),
                out_specs=(P(), specs),
            )
        )
        loss, grads = grads_fn(shards, x)
        report(
            "global",
            road=name,
            loss=float(loss),
            ref_loss=float(ref_loss),
            grads=digest(grads),
            grad_error=rel_error(grads),
        )

    # GSPMD under jit: `reduce_dtype` chooses the dtype the gradients are summed in.
    for reduce in ("compute", "float32"):
        policy = BF16 if reduce == "compute" else BF16.with_reduce_dtype(jnp.float32)

        def loss_fn(params, x):
            model = eqx.filter_vmap(eqx.combine(params, static))
            out = eqx_amp.filter_amp(model, policy=policy)(x)
            return jnp.mean(out.astype(jnp.float32) ** 2)

        loss, grads = jax.jit(jax.value_and_grad(loss_fn))(shards, x)
        report(
            "global",
            road=f"jit, reduce {reduce}",
            loss=float(loss),
            grads=digest(grads),
            grad_error=rel_error(grads),
            dtypes=sorted({str(g.dtype) for g in jtu.tree_leaves(grads)}),
        )

    # The eager diagnostics, on a model and batch spread over every process: the
    # overflow is in the last process's rows, yet every process names it.
    sharded_model = eqx.filter_vmap(eqx.combine(shards, static))
    bad = eqx_amp.find_nonfinite(
        lambda m, x: eqx_amp.filter_amp(m, policy=F16)(x * 1000.0), sharded_model, x
    )
    found = eqx_amp.precision_report(eqx_amp.filter_amp(sharded_model, policy=BF16), x)
    report(
        "global",
        road="eager diagnostics",
        primitive=None if bad is None else bad.primitive,
        input_ranges=None if bad is None else bad.input_ranges,
        output_dtype=None if bad is None else bad.output_dtype,
        low_precision_share=found.low_precision_share,
    )

    # Telemetry: the amax of the input into the first product and of its weight are
    # maxima over every process's share.
    def step(model, x):
        def loss_fn(model):
            out = eqx_amp.filter_amp(eqx.filter_vmap(model), policy=BF16)(x)
            return jnp.mean(out.astype(jnp.float32) ** 2)

        return eqx.filter_grad(loss_fn)(model)

    measured = eqx.filter_jit(eqx_amp.diagnostics.telemetry(step))
    _, stats = measured(eqx.combine(shards, static), x)
    amax = {(r.layer, r.role): float(r.amax) for r in stats.rows()}
    report(
        "global",
        road="telemetry",
        activation=amax["model.layers[0]", "activation"],
        weight=amax["model.layers[0]", "weight"],
        true_weight=float(np.abs(np.asarray(model.layers[0].weight)).max()),
        true_activation=float(np.abs(x_host).max()),
    )


#
# Checkpoints: orbax from every process; resumed here, or on another process count.
#

CUT, STEPS = 3, 5


def checkpoint_recipes():
    """name -> (init(key) -> state, step(state, x, y) -> state, data(i) -> (x, y)):
    a BiModel with the loss scale in its optimizer state (float16), a bfloat16
    model with Kahan summation and bfloat16 moments, and one with stochastic
    rounding and 8-bit moments."""
    import tests.test_orbax as orbax_tests
    from tests.optim_helpers import mse_loss, regression_data, small_mlp  # noqa: I001
    from tests.test_training_state import _recipes, _runnable

    recipe = orbax_tests.RECIPES["loss_scaling"]

    def orbax_step(state, x, y):
        multiplier = jnp.where(x[0, 0] > 100.0, 1e38, 1.0).astype(jnp.float32)
        return recipe.step(state, x, y, multiplier)[0]

    def orbax_data(i):
        x, y = orbax_tests.batch(i)
        x = np.array(x)
        if orbax_tests.MULTIPLIERS[i] > 1:
            x[0, 0] = 1000.0  # this step's loss overflows: it is skipped
        return x, np.asarray(y)

    recipes = {"BiModel + loss scale": (recipe.init, orbax_step, orbax_data)}
    x = regression_data(jr.key(1))[0]
    y = jr.normal(jr.key(2), (64, 8))
    for name in ("kahan + bf16 moments", "sr + 8-bit moments"):
        start, update = _recipes()[name]

        def step(state, x, y, update=update):
            held, opt_state = state
            grads = eqx.filter_grad(mse_loss)(_runnable(held), x, y)
            return update(held, opt_state, grads)

        def init(key, start=start):
            return start(small_mlp(key, out=8))

        recipes[name] = (init, step, lambda i: (np.asarray(x), np.asarray(y)))
    return recipes


def shard_state(state, mesh):
    n = mesh.devices.size

    def sharding(x):
        if not eqx.is_array(x):
            return None
        split = x.ndim > 0 and x.shape[0] % n == 0
        return NamedSharding(mesh, P("data") if split else P())

    arrays, static = eqx.partition(state, eqx.is_array)
    shardings = jtu.tree_map(sharding, arrays)
    return eqx.combine(place(arrays, shardings), static), shardings


def checkpoint_check():
    """Saves at step CUT (and records the uninterrupted run), or with
    `CHECKPOINT_MODE=restore`, restores what a run with another process count
    saved and resumes it."""
    import orbax.checkpoint as ocp

    directory = pathlib.Path(os.environ["CHECKPOINT_DIR"])
    restore_only = os.environ.get("CHECKPOINT_MODE") == "restore"
    mesh = data_mesh()
    rows = NamedSharding(mesh, P("data"))
    with jax.numpy_dtype_promotion("standard"):
        for name, (init, step, data) in checkpoint_recipes().items():
            path = directory / name.replace(" ", "_").replace("+", "and")
            _, shardings = shard_state(init(jr.key(0)), mesh)

            @eqx.filter_jit
            def jitted(state, x, y, step=step, shardings=shardings):
                return eqx.filter_shard(step(state, x, y), shardings)

            def train(state, start, stop, data=data, jitted=jitted):
                for i in range(start, stop):
                    x, y = data(i)
                    state = jitted(state, *(place(a, rows) for a in (x, y)))
                return state

            values = {}
            if not restore_only:
                state, _ = shard_state(init(jr.key(0)), mesh)
                first = train(state, 0, CUT)
                with ocp.CheckpointManager(path) as manager:
                    manager.save(
                        CUT, args=ocp.args.StandardSave(eqx.filter(first, eqx.is_array))
                    )
                    manager.wait_until_finished()
                values["saved"] = digest(first)
                values["uninterrupted"] = digest(train(first, CUT, STEPS))
            # Other weights: everything restored must come from the files.
            like, _ = shard_state(init(jr.key(99)), mesh)
            arrays, static = eqx.partition(like, eqx.is_array)
            abstract = jtu.tree_map(ocp.utils.to_shape_dtype_struct, arrays)
            with ocp.CheckpointManager(path) as manager:
                restored = manager.restore(
                    manager.latest_step(), args=ocp.args.StandardRestore(abstract)
                )
            restored = eqx.combine(restored, static)
            kept = all(
                a.sharding.is_equivalent_to(b.sharding, a.ndim)
                for a, b in zip(
                    jtu.tree_leaves(eqx.filter(restored, eqx.is_array)),
                    jtu.tree_leaves(arrays),
                )
            )
            report(
                "checkpoint",
                road=name,
                restored=digest(restored),
                resumed=digest(train(restored, CUT, STEPS)),
                shardings_kept=kept,
                **values,
            )


#
# Bad set-ups: what JAX does, and the checks the multi-device guide gives for them.
#


def attempt(fn):
    try:
        return {"value": fn()}
    except Exception as e:  # what each process saw is the report
        return {"error": type(e).__name__, "message": str(e)[:300]}


def bad_check():
    import hashlib

    first = jax.process_index() == 0
    # A mesh of process 0's devices only: the other processes hold no part of it.
    partial = jax.sharding.Mesh(np.array(jax.local_devices(process_index=0)), ("data",))
    rows = NamedSharding(partial, P("data"))
    report(
        "bad",
        road="mesh of one process's devices",
        put=attempt(
            lambda: jax.make_array_from_process_local_data(rows, np.ones((2, 3))).shape
        ),
        covers=set(partial.devices.flat) == set(jax.devices()),
    )
    # A mesh of each process's own devices: no error, each trains alone.
    own = jax.sharding.Mesh(np.array(jax.local_devices()), ("data",))
    x = jax.device_put(
        np.full(2, jax.process_index(), np.float32), NamedSharding(own, P("data"))
    )
    report(
        "bad",
        road="mesh of each process's own devices",
        sum=float(jax.jit(jnp.sum)(x)),
        covers=set(own.devices.flat) == set(jax.devices()),
    )
    # Local batches of different sizes (process 0 has 2 rows, the others 4).
    mesh = data_mesh()
    rows = NamedSharding(mesh, P("data"))
    local = np.ones((2 if first else 4, 3), np.float32)
    global_shape = (4 * jax.process_count(), 3)
    report(
        "bad",
        road="local batches of different sizes",
        inferred=attempt(
            lambda: list(jax.make_array_from_process_local_data(rows, local).shape)
        ),
        with_global_shape=attempt(
            lambda: list(
                jax.make_array_from_process_local_data(rows, local, global_shape).shape
            )
        ),
    )
    # A different policy on process 0: the guide's check, one small collective.
    policy = eqx_amp.get_policy("mixed_float16" if first else "mixed_bfloat16")

    def check_same_policy(policy):
        digest = hashlib.sha256(str(policy).encode()).digest()
        multihost_utils.assert_equal(
            np.frombuffer(digest, np.uint32), f"not every process runs {policy}"
        )
        return True

    report(
        "bad",
        road="a different policy on one process",
        mismatch=attempt(lambda: check_same_policy(policy)),
        same=attempt(lambda: check_same_policy(BF16)),
    )


CHECKS = {
    "fsdp": fsdp_check,
    "scaling": scaling_check,
    "global": global_check,
    "checkpoint": checkpoint_check,
    "bad": bad_check,
}

if __name__ == "__main__":
    import time

    for check in sys.argv[1:]:
        start = time.perf_counter()
        CHECKS[check]()
        print(f"{check}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
