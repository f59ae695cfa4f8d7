"""A character-level GPT trained with FSDP and tensor parallelism, in mixed precision.

The devices form a 2-D `jax.sharding.Mesh`, `data` x `model` (8 simulated CPU
devices as 4 x 2 where there is no accelerator; every device of every host
otherwise). JAX's own engine does the parallelism: `jax.jit` over `NamedSharding`s.

- FSDP over `data`: every weight is split over the `data` axis and gathered when a
  layer needs it; the batch is split over `data` too.
- Megatron-style tensor parallelism over `model`: the attention's query, key and value
  projections and the MLP's first projection are split by output, the attention's output projection and
  the MLP's second projection by input, so each block needs one reduction of its
  activations per pass.
- The blocks are stacked and run by `jax.lax.scan` under `eqx.filter_checkpoint`:
  only one block's gathered weights (and its saved activations) exist at a time,
  which is what keeps FSDP's memory per device low.

Mixed precision is one wrapper: `eqx_amp.filter_amp(eqx.filter_vmap(model),
policy=policy)`. The
weights are cast *before* XLA gathers them, so the all-gathers move half the bytes,
and `policy.reduce_dtype` chooses the dtype the gradients are summed across devices
in (`--reduce-dtype float32`: as PyTorch FSDP's `reduce_dtype`). With `--dtype
float16` the loss is scaled: `eqx_amp.loss_scaling` around the optimizer and
`eqx_amp.scaled_value_and_grad` in place of `eqx.filter_value_and_grad`.

The same model, from the same initial weights and on the same batches, is trained in
float32 and in mixed precision; the table at the end gives the final losses, the
time per step and the memory XLA allocates per device.

    python examples/fsdp.py
    python examples/fsdp.py --dtype float16 --reduce-dtype float32 --steps 300
    python examples/fsdp.py --mesh 8x1          # FSDP only
    python examples/fsdp.py --fp8               # and in fp8: `filter_amp(..., fp8=)`

With `--fp8` a third run multiplies in fp8 (`filter_amp(..., fp8=
eqx_amp.fp8.TENSORWISE)`, bfloat16 elsewhere): XLA's partitioner then all-gathers the
weights already quantised to fp8 (each with its whole weight's scale), half
bfloat16's bytes, and the weight gradients are reduced in bfloat16.

On several hosts, run the same command on each with `--multi-host`: it calls
`jax.distributed.initialize()`, which finds the coordinator in the cluster's
environment (SLURM, Open MPI, Cloud TPU), or, where `JAX_PROCESS_ID` is set, passes it
`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID`. Each host then
feeds its own rows of every batch, and process 0 prints the table. On one machine,
as 2 processes of 4 CPU devices each (the same 4 x 2 mesh):

    python -m eqx_amp.tools.launch_local 2 --cpu-devices 4 -- \
        python examples/fsdp.py --multi-host
"""

import argparse
import os
import sys


if "--multi-host" not in sys.argv and "xla_force_host_platform_device_count" not in (
    os.environ.get("XLA_FLAGS", "")
):
    # Must be set before JAX is imported; it only affects the CPU backend.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import functools as ft  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import jax.tree_util as jtu  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _reporting import compiled_memory, fmt_bytes, progress, step_bytes  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from jaxtyping import Array, Float, Int  # noqa: E402

import eqx_amp  # noqa: E402


DATA, MODEL = "data", "model"
FP8 = eqx_amp.fp8.TENSORWISE
TEXT = pathlib.Path(__file__).resolve().parent / "data" / "alice29.txt"


#
# Model: pre-norm blocks, stacked for `lax.scan`.
#


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    query: eqx.nn.Linear
    key: eqx.nn.Linear
    value: eqx.nn.Linear
    proj: eqx.nn.Linear
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, dim: int, heads: int, *, key):
        kq, kk, kv, k2, k3, k4 = jr.split(key, 6)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.query = eqx.nn.Linear(dim, dim, key=kq)
        self.key = eqx.nn.Linear(dim, dim, key=kk)
        self.value = eqx.nn.Linear(dim, dim, key=kv)
        self.proj = eqx.nn.Linear(dim, dim, key=k2)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.up = eqx.nn.Linear(dim, 4 * dim, key=k3)
        self.down = eqx.nn.Linear(4 * dim, dim, key=k4)
        self.heads = heads

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        seq, dim = x.shape
        h = jax.vmap(self.norm1)(x)
        q, k, v = (
            jax.vmap(layer)(h).reshape(seq, self.heads, dim // self.heads)
            for layer in (self.query, self.key, self.value)
        )
        logits = jnp.einsum("thd,shd->hts", q, k) / np.sqrt(dim // self.heads)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        # Softmax in float32 whatever the compute dtype: it is cheap and touchy.
        logits = jnp.where(causal, logits.astype(jnp.float32), -jnp.inf)
        weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        attended = jnp.einsum("hts,shd->thd", weights, v).reshape(seq, dim)
        x = x + jax.vmap(self.proj)(attended)
        hidden = jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.norm2)(x)))
        return x + jax.vmap(self.down)(hidden)


class GPT(eqx.Module):
    embedding: eqx.nn.Embedding
    positions: Float[Array, "block dim"]
    blocks: Block  # every array has a leading layer axis
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(
        self, vocab: int, dim: int, heads: int, layers: int, block: int, *, key
    ):
        k1, k2, k3, k4 = jr.split(key, 4)
        self.embedding = eqx.nn.Embedding(vocab, dim, key=k1)
        self.positions = 0.02 * jr.normal(k2, (block, dim))
        self.blocks = eqx.filter_vmap(lambda k: Block(dim, heads, key=k))(
            jr.split(k3, layers)
        )
        self.norm = eqx.nn.LayerNorm(dim)
        self.head = eqx.nn.Linear(dim, vocab, use_bias=False, key=k4)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = jax.vmap(self.embedding)(tokens) + self.positions[: tokens.shape[0]]
        arrays, static = eqx.partition(self.blocks, eqx.is_array)

        # Rematerialised: the backward pass recomputes (and so regathers) one block
        # at a time instead of keeping every block's gathered weights alive.
        @eqx.filter_checkpoint
        def run_block(x, block_arrays):
            return eqx.combine(block_arrays, static)(x), None

        x, _ = jax.lax.scan(run_block, x, arrays)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


#
# Where everything lives.
#


_BY_OUTPUT = ("query", "key", "value", "up")  # column parallel: split the outputs
_BY_INPUT = ("proj", "down")  # row parallel: split the input features


def param_spec(path: str, leaf: Array) -> P:
    """FSDP over `data` on one dimension, tensor parallelism over `model` on the
    other (a Linear's weight is `(out, in)`; the stacked blocks add a layer axis)."""
    stacked = (None,) if path.startswith(".blocks.") else ()
    layer = next((n for n in _BY_OUTPUT + _BY_INPUT if f".{n}." in path), None)
    if layer in _BY_OUTPUT:
        return (
            P(*stacked, MODEL, DATA) if path.endswith("weight") else P(*stacked, MODEL)
        )
    if layer in _BY_INPUT:
        return P(*stacked, DATA, MODEL) if path.endswith("weight") else P()
    if leaf.ndim - len(stacked) == 2:  # embedding, positions, head: rows x width
        return P(*stacked, DATA, MODEL)
    return P()  # layer norms: small, replicated


def shard_like_specs(tree, mesh):
    return jtu.tree_map_with_path(
        lambda path, leaf: (
            NamedSharding(mesh, param_spec(jtu.keystr(path), leaf))
            if eqx.is_array(leaf)
            else None
        ),
        tree,
    )


#
# Training.
#


def cross_entropy(logits, targets):
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def forward(policy, params, static, inputs, fp8=None):
    """The logits of a batch; `policy=None` is float32. `filter_amp` wraps the
    batched model (not the other way round): the blocks are scanned and
    rematerialised, and a `jax.vmap` outside `filter_amp` would batch those
    bodies after eqx_amp traced them, which a `reduce_dtype` cannot see into."""
    model = eqx.filter_vmap(eqx.combine(params, static))
    if policy is not None:
        model = eqx_amp.filter_amp(model, policy=policy, fp8=fp8)
    return model(inputs)


def make_step(
    policy: eqx_amp.Policy | None, optimizer, shardings, fp8=None, opt_shardings=None
):
    """One training step. `policy=None` is the float32 baseline. `opt_shardings`
    keeps the optimizer state where it started too (else XLA chooses)."""
    scaled = policy is not None and policy.compute_dtype == jnp.float16

    def loss_fn(params, static, inputs, targets):
        return cross_entropy(forward(policy, params, static, inputs, fp8), targets)

    def step(params, opt_state, static, inputs, targets):
        if scaled:
            grad_fn = eqx_amp.scaled_value_and_grad(loss_fn)
            (loss, grads), opt_state = grad_fn(
                params, static, inputs, targets, opt_state=opt_state
            )
        else:
            loss, grads = eqx.filter_value_and_grad(loss_fn)(
                params, static, inputs, targets
            )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = eqx.apply_updates(params, updates)
        # The updated weights stay where they were.
        params = jax.lax.with_sharding_constraint(params, shardings)
        if opt_shardings is not None:
            opt_state = jax.lax.with_sharding_constraint(opt_state, opt_shardings)
        return params, opt_state, loss

    return jax.jit(step, static_argnums=2, donate_argnums=(0, 1))


def batches(ids: np.ndarray, n: int, batch: int, block: int, seed: int):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        starts = rng.integers(0, len(ids) - block - 1, size=batch)
        windows = np.stack([ids[s : s + block + 1] for s in starts])
        yield windows[:, :-1], windows[:, 1:]


def put_batch(inputs, targets, sharding):
    """Each host hands over its own rows of the global batch (on one host: all)."""
    per_host = inputs.shape[0] // jax.process_count()
    rows = slice(jax.process_index() * per_host, (jax.process_index() + 1) * per_host)
    return tuple(
        jax.make_array_from_process_local_data(sharding, np.asarray(a[rows]))
        for a in (inputs, targets)
    )


def train(name, policy, args, mesh, vocab, train_ids, val_ids, fp8=None):
    model = GPT(
        vocab, args.dim, args.heads, args.layers, args.block, key=jr.key(args.seed)
    )
    params, static = eqx.partition(model, eqx.is_array)
    shardings = shard_like_specs(params, mesh)
    params = jax.device_put(params, shardings)
    optimizer = optax.adamw(args.learning_rate)
    if policy is not None and policy.compute_dtype == jnp.float16:
        optimizer = eqx_amp.loss_scaling(optimizer)
    opt_state = optimizer.init(params)
    # The step count (and loss scale) start on one device: replicated, and the whole
    # state kept where it starts, every step sees the same shardings and the step
    # compiles once.
    replicated = NamedSharding(mesh, P())
    opt_state = jtu.tree_map(
        lambda x: (
            x
            if isinstance(x.sharding, NamedSharding)
            else jax.device_put(x, replicated)
        ),
        opt_state,
    )
    opt_shardings = jtu.tree_map(lambda x: x.sharding, opt_state)
    batch_sharding = NamedSharding(mesh, P(DATA, None))
    step = make_step(policy, optimizer, shardings, fp8, opt_shardings)

    first = put_batch(
        *next(batches(train_ids, 1, args.batch, args.block, 0)), batch_sharding
    )
    compiled = step.lower(params, opt_state, static, *first).compile()
    memory = step_bytes(compiled_memory(compiled))

    losses, times = [], []
    data = batches(train_ids, args.steps, args.batch, args.block, args.seed)
    if jax.process_index() == 0:  # one progress bar, not one per process
        data = progress(data, args.steps, name)
    for inputs, targets in data:
        start = time.perf_counter()
        params, opt_state, loss = step(
            params, opt_state, static, *put_batch(inputs, targets, batch_sharding)
        )
        losses.append(float(loss))
        times.append(time.perf_counter() - start)

    @ft.partial(jax.jit, static_argnums=1)
    def val_loss(params, static, inputs, targets):
        return cross_entropy(forward(policy, params, static, inputs, fp8), targets)

    val = [
        float(val_loss(params, static, *put_batch(i, t, batch_sharding)))
        for i, t in batches(val_ids, 4, args.batch, args.block, seed=1)
    ]
    kept = all(
        p.sharding.is_equivalent_to(s, p.ndim)
        for p, s in zip(jtu.tree_leaves(params), jtu.tree_leaves(shardings))
    )
    return {
        "train": float(np.mean(losses[-10:])),
        "val": float(np.mean(val)),
        "step": float(np.median(times[1:] or times)),
        "memory": memory,
        "kept": kept,
        "finite": all(np.isfinite(losses)),
    }


def initialize_distributed():
    env = os.environ
    if "JAX_PROCESS_ID" in env:
        # Set by hand or by `python -m eqx_amp.tools.launch_local`: jax 0.10's
        # `initialize()` reads the address from the environment, but not the process
        # count or id.
        jax.distributed.initialize(
            env["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(env["JAX_NUM_PROCESSES"]),
            process_id=int(env["JAX_PROCESS_ID"]),
        )
    else:
        jax.distributed.initialize()  # SLURM, Open MPI, Cloud TPU: JAX finds them


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--mesh", default="4x2", help="DATAxMODEL devices, e.g. 8x1")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument(
        "--reduce-dtype",
        choices=["compute", "float32"],
        default="compute",
        help="the dtype gradients are summed across devices in",
    )
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--multi-host", action="store_true")
    parser.add_argument(
        "--fp8", action="store_true", help="also train with fp8 matmuls (bfloat16)"
    )
    args = parser.parse_args(argv)
    if args.fp8 and (args.dtype, args.reduce_dtype) != ("bfloat16", "compute"):
        sys.exit("--fp8 runs with --dtype bfloat16 and --reduce-dtype compute.")
    if args.multi_host:
        initialize_distributed()

    n_data, n_model = (int(n) for n in args.mesh.split("x"))
    devices = jax.devices()
    if n_data * n_model != len(devices):
        sys.exit(
            f"--mesh {args.mesh} needs {n_data * n_model} devices; there are {len(devices)}."
        )
    mesh = jax.make_mesh(
        (n_data, n_model), (DATA, MODEL), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
    text = TEXT.read_text(encoding="utf-8")
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], dtype=np.int32)
    split = len(ids) * 9 // 10
    # A vocabulary padded so the table splits evenly over the data axis.
    vocab = -(-len(chars) // (8 * n_data)) * 8 * n_data

    policy = eqx_amp.get_policy(f"params=float32,compute={args.dtype},output=float32")
    if args.reduce_dtype == "float32":
        policy = policy.with_reduce_dtype(jnp.float32)
    runs = {
        "fp32": train("fp32", None, args, mesh, vocab, ids[:split], ids[split:]),
        "amp": train("amp", policy, args, mesh, vocab, ids[:split], ids[split:]),
    }
    if args.fp8:
        runs["fp8"] = train(
            "fp8", policy, args, mesh, vocab, ids[:split], ids[split:], FP8
        )
    # Every process holds the same replicated losses; one prints them.
    say = print if jax.process_index() == 0 else lambda *args: None
    n = jax.process_count()
    processes = f" in {n} processes" if n > 1 else ""
    say(
        f"\n{len(devices)} x {devices[0].device_kind} as {n_data} data x {n_model} "
        f"model{processes}; policy {policy}"
    )
    say(
        "| variant | final train loss | val loss | time/step | memory/device | shardings kept |"
    )
    say("|---|---|---|---|---|---|")
    for name, r in runs.items():
        say(
            f"| {name} | {r['train']:.4f} | {r['val']:.4f} | {r['step'] * 1e3:.1f} ms | "
            f"{fmt_bytes(r['memory'])} | {r['kept']} |"
        )
    fp32, amp = runs["fp32"], runs["amp"]
    if fp32["memory"] and amp["memory"]:
        say(
            f"amp/fp32: memory {amp['memory'] / fp32['memory']:.2f}x, "
            f"time {amp['step'] / fp32['step']:.2f}x, "
            f"val loss {amp['val'] - fp32['val']:+.4f}"
        )
    if "fp8" in runs:
        fp8 = runs["fp8"]
        say(
            f"fp8/amp: val loss {fp8['val'] / amp['val'] - 1:+.2%}, "
            f"train loss {fp8['train'] / amp['train'] - 1:+.2%}"
        )
    if not all(r["finite"] for r in runs.values()):
        sys.exit("a loss was not finite")


if __name__ == "__main__":
    main()
