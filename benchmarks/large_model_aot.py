"""A large model on paper: the training step of a Llama-3-8B- or 70B-shaped model,
FSDP-sharded over several hosts of 8 H100s, compiled without a GPU.

    python benchmarks/large_model_aot.py --model 8b                 # 2 hosts x 8 H100
    python benchmarks/large_model_aot.py --model 70b                # 8 hosts x 8 H100
    python benchmarks/large_model_aot.py --model 8b --depth 4       # 4 of the 32 blocks

The model: token embedding, `depth` pre-norm decoder blocks (RMSNorm, causal
grouped-query attention by `jax.nn.dot_product_attention`, RMSNorm, SwiGLU MLP), a
final RMSNorm and an unbiased head; the blocks are stacked (one array per kind of
weight, a leading axis of `depth`) and run by `jax.lax.scan`, each under
`eqx.filter_checkpoint` (only the residual stream between blocks is kept for the
backward pass). No rotary embedding (elementwise work, the same in every row).

The step: loss, gradients (`filter_amp`, products in bfloat16, or fp8 with
`fp8=eqx_amp.fp8.TENSORWISE`), the optimizer update and its application, for four
ways of holding the training state (AdamW in each):

- `f32 Adam`: float32 weights, float32 moments (12 B/weight);
- `AMP, f32 master`: `BiModel`: float32 master, bfloat16 compute copy, float32
    moments (14 B/weight);
- `bf16 + Kahan, bf16 moments`: bfloat16 weights, `low_precision_moments(adamw,
    "bfloat16")` + `kahan_summation()` (8 B/weight);
- `bf16 + SR, 8-bit moments`: bfloat16 weights, `low_precision_moments(adamw,
    "8bit")` + `stochastic_rounding(key)` (4.03 B/weight).

Every floating array of the state (weights, moments, buffers, 8-bit codes and
their block scales) is split over all the devices along its first axis that divides
by their number (a stacked weight's layer axis excepted); the batch, one sequence
per device, along its first. The topology is `get_topology_desc`'s
`"<hosts>x1x8"` (`<partitions>x<hosts per partition>x<devices per host>`: each
host its own NVLink domain, as DGX H100s are). From the compiled program, per
device: `memory_analysis()`'s arguments (the state and the batch), temporaries and
their sum with the outputs not aliased to arguments, and the bytes each device
receives per step from each kind of collective by dtype (those inside the scans
counted once per layer).

What it cannot show: time, overlap of collectives with compute, and what the
autotuner picks (GEMMs are cuBLAS calls: Triton GEMMs off).
"""

import argparse
import collections
import dataclasses
import json
import math
import pathlib
import re
import sys
import time


_HERE = pathlib.Path(__file__).resolve().parent
GiB = 2**30
HBM_BYTES = 80e9  # an H100 SXM's memory (80 GB; about 79.6 GB usable)
STATES = (
    "f32_adam",
    "amp_f32_master",
    "bf16_kahan_bf16_moments",
    "bf16_sr_8bit_moments",
)
STATE_NAMES = {
    "f32_adam": "f32 Adam",
    "amp_f32_master": "AMP, f32 master",
    "bf16_kahan_bf16_moments": "bf16 + Kahan, bf16 moments",
    "bf16_sr_8bit_moments": "bf16 + SR, 8-bit moments",
}
PRODUCTS = ("bf16", "fp8")


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    vocab: int
    width: int
    depth: int
    heads: int
    kv_heads: int
    hidden: int
    seq: int
    hosts: int
    per_host: int = 8
    # "xla": `jax.nn.dot_product_attention`'s XLA implementation, which writes each
    # block's attention matrices; "cudnn": cuDNN's flash attention, which does not.
    attention: str = "xla"

    @property
    def devices(self) -> int:
        return self.hosts * self.per_host

    def describe(self) -> str:
        return (
            f"{self.depth} blocks, d_model {self.width}, {self.heads}/{self.kv_heads} "
            f"heads, SwiGLU {self.hidden}, vocab {self.vocab}, seq {self.seq}, "
            f"1 sequence per device, {self.hosts} hosts x {self.per_host} H100, "
            f"attention by {'cuDNN (flash)' if self.attention == 'cudnn' else 'XLA'}"
        )


SHAPES = {
    "8b": LlamaShape(128256, 4096, 32, 32, 8, 14336, 4096, hosts=2),
    "70b": LlamaShape(128256, 8192, 80, 64, 8, 28672, 4096, hosts=8),
    # What the slow test compiles: seconds, not minutes. Its 8 layers divide by its 8
    # devices, so a split along the layer axis would be taken (and is tested against).
    "test": LlamaShape(512, 256, 8, 4, 2, 512, 128, hosts=2, per_host=4),
}


def build_model(shape: LlamaShape, key, batch_sharding=None):
    """The Llama-shaped model (its blocks stacked), called on a batch of token
    sequences; built by the caller under `eqx.filter_eval_shape` for shapes only.
    `batch_sharding` (a `NamedSharding` splitting the batch): the residual stream's
    sharding between blocks."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import jax.random as jr

    class Attention(eqx.Module):
        query: eqx.nn.Linear
        key: eqx.nn.Linear
        value: eqx.nn.Linear
        output: eqx.nn.Linear
        heads: int = eqx.field(static=True)
        kv_heads: int = eqx.field(static=True)

        def __init__(self, width, heads, kv_heads, *, key):
            k1, k2, k3, k4 = jr.split(key, 4)
            head = width // heads
            self.query = eqx.nn.Linear(width, width, use_bias=False, key=k1)
            self.key = eqx.nn.Linear(width, kv_heads * head, use_bias=False, key=k2)
            self.value = eqx.nn.Linear(width, kv_heads * head, use_bias=False, key=k3)
            self.output = eqx.nn.Linear(width, width, use_bias=False, key=k4)
            self.heads, self.kv_heads = heads, kv_heads

        def __call__(self, x):
            seq, width = x.shape
            head = width // self.heads
            q = jax.vmap(self.query)(x).reshape(seq, self.heads, head)
            k = jax.vmap(self.key)(x).reshape(seq, self.kv_heads, head)
            v = jax.vmap(self.value)(x).reshape(seq, self.kv_heads, head)
            if shape.attention == "cudnn":
                # cuDNN takes half precision only: a float32 step's q, k, v go in
                # as bfloat16, as a model written for it casts them.
                q, k, v = (a.astype(jnp.bfloat16) for a in (q, k, v))
            out = jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation=shape.attention
            ).astype(x.dtype)
            return jax.vmap(self.output)(out.reshape(seq, width))

    class Block(eqx.Module):
        norm1: eqx.nn.RMSNorm
        attention: Attention
        norm2: eqx.nn.RMSNorm
        gate: eqx.nn.Linear
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3, k4 = jr.split(key, 4)
            w, h = shape.width, shape.hidden
            self.norm1 = eqx.nn.RMSNorm(w)
            self.attention = Attention(w, shape.heads, shape.kv_heads, key=k1)
            self.norm2 = eqx.nn.RMSNorm(w)
            self.gate = eqx.nn.Linear(w, h, use_bias=False, key=k2)
            self.up = eqx.nn.Linear(w, h, use_bias=False, key=k3)
            self.down = eqx.nn.Linear(h, w, use_bias=False, key=k4)

        def __call__(self, x):
            x = x + self.attention(jax.vmap(self.norm1)(x))
            y = jax.vmap(self.norm2)(x)
            swiglu = jax.nn.silu(jax.vmap(self.gate)(y)) * jax.vmap(self.up)(y)
            return x + jax.vmap(self.down)(swiglu)

    def run_block(block, x):
        return jax.vmap(block)(x)

    def _split_batch(x):
        if batch_sharding is None:
            return x
        return jax.lax.with_sharding_constraint(x, batch_sharding)

    class Llama(eqx.Module):
        embed: eqx.nn.Embedding
        blocks: Block  # stacked: every array has a leading axis of `depth`
        norm: eqx.nn.RMSNorm
        head: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3 = jr.split(key, 3)
            self.embed = eqx.nn.Embedding(shape.vocab, shape.width, key=k1)
            self.blocks = eqx.filter_vmap(Block)(jr.split(k2, shape.depth))
            self.norm = eqx.nn.RMSNorm(shape.width)
            self.head = eqx.nn.Linear(shape.width, shape.vocab, use_bias=False, key=k3)

        def __call__(self, tokens):
            # A batch of sequences: the scan runs over the batch's residual stream,
            # kept split along the batch between blocks. Without that constraint
            # XLA's partitioner follows the weights' split (along their features)
            # and all-gathers the whole batch's activations at every product,
            # 4x the bytes of gathering the weights.
            x = jax.vmap(jax.vmap(self.embed))(tokens)
            dynamic, static = eqx.partition(self.blocks, eqx.is_array)

            def body(x, layer):
                block = eqx.combine(layer, static)
                x = eqx.filter_checkpoint(run_block)(block, x)
                return _split_batch(x), None

            x, _ = jax.lax.scan(body, _split_batch(x), dynamic)
            return jax.vmap(jax.vmap(self.head))(jax.vmap(jax.vmap(self.norm))(x))

    return Llama(key)


def _cross_entropy(logits, labels):
    import jax.numpy as jnp
    import optax

    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_step(state_kind: str, products: str):
    """`(start, step)`: `start(model)` -> the state held between steps, `step(state,
    tokens, labels)` -> (new state, loss)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import jax.random as jr
    import optax

    import eqx_amp

    fp8 = eqx_amp.fp8.TENSORWISE if products == "fp8" else None
    adamw = optax.adamw(1e-4)

    def trainable(model):
        return eqx.filter(model, eqx.is_inexact_array)

    def forward(model, policy):
        return eqx_amp.filter_amp(model, policy=policy, fp8=fp8)

    if state_kind == "amp_f32_master":

        def loss_fn(bm, tokens, labels):
            return _cross_entropy(forward(bm.compute, bm.policy)(tokens), labels)

        def start(model):
            bm = eqx_amp.BiModel(model, policy="mixed_bfloat16", fp8=fp8)
            return bm, adamw.init(trainable(bm.master))

        def step(state, tokens, labels):
            bm, opt_state = state
            (loss, grads), _, _ = eqx_amp.filter_value_and_grad(loss_fn)(
                bm, tokens, labels, loss_scale=eqx_amp.NoOpLossScale()
            )
            updates, opt_state = adamw.update(grads, opt_state, trainable(bm.master))
            return (bm.apply_updates(updates), opt_state), loss

        return start, step

    if state_kind == "f32_adam":
        dtype, optimizer, policy = jnp.float32, adamw, "mixed_bfloat16"
    elif state_kind == "bf16_kahan_bf16_moments":
        dtype, policy = jnp.bfloat16, "p=bf16,c=bf16,o=f32"
        optimizer = optax.chain(
            eqx_amp.optim.low_precision_moments(adamw, "bfloat16"),
            eqx_amp.optim.kahan_summation(),
        )
    elif state_kind == "bf16_sr_8bit_moments":
        dtype, policy = jnp.bfloat16, "p=bf16,c=bf16,o=f32"
        optimizer = optax.chain(
            eqx_amp.optim.low_precision_moments(adamw, "8bit"),
            eqx_amp.optim.stochastic_rounding(jr.key(0)),
        )
    else:
        raise ValueError(f"unknown state {state_kind!r}; expected one of {STATES}")

    def start(model):
        model = eqx_amp.cast_tree(model, dtype)
        return model, optimizer.init(trainable(model))

    def step(state, tokens, labels):
        model, opt_state = state
        loss, grads = eqx.filter_value_and_grad(
            lambda m: _cross_entropy(forward(m, policy)(tokens), labels)
        )(model)
        updates, opt_state = optimizer.update(grads, opt_state, trainable(model))
        return (eqx_amp.optim.apply_updates(model, updates), opt_state), loss

    del jax
    return start, step


def topology_devices(hosts: int, per_host: int = 8) -> list:
    """`hosts` x `per_host` deviceless H100s: `get_topology_desc`'s topology string
    is `<partitions>x<hosts per partition>x<devices per host>`; one host per
    partition (each its own NVLink domain). Each device knows its host
    (`process_index`)."""
    import os

    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    from h100_aot import TARGET
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda",
        topology_name="h100",
        target_config=TARGET.read_text(),
        topology=f"{hosts}x1x{per_host}",
    )
    devices = list(topology.devices)
    assert sorted({d.process_index for d in devices}) == list(range(hosts))
    return devices


def fsdp_spec(path: str, leaf, n: int):
    """The partition of one array of the state (at `path`): along its first axis
    that divides by `n` (a stacked block weight's layer axis excepted), replicated
    if none does or if it is not floating (PRNG keys, step counters) and too small
    to matter."""
    from jax.sharding import PartitionSpec

    start = 1 if "blocks" in path else 0
    for axis in range(start, leaf.ndim):
        if leaf.shape[axis] % n == 0 and leaf.shape[axis] >= n:
            return PartitionSpec(*([None] * axis), "fsdp")
    return PartitionSpec()


def _keystr(path) -> str:
    import jax.tree_util as jtu

    return jtu.keystr(path)


def sharded_specs(tree, mesh, n: int, named: dict[int, str]):
    """`tree`'s arrays as `jax.ShapeDtypeStruct`s sharded by `fsdp_spec`, each at
    its path in `tree` or, if there, at its path `named` by `id` (`_model_paths`)."""
    import jax
    from jax.sharding import NamedSharding

    def one(path, x):
        path = named.get(id(x), _keystr(path))
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, fsdp_spec(path, x, n))
        )

    return jax.tree_util.tree_map_with_path(one, tree)


def _model_paths(tree) -> dict[int, str]:
    """The path in the model of each array of a `BiModel`'s compute copy in `tree`
    (whole: not `eqx.partition`ed, whose `None`s would misalign the copy), by `id`:
    the `BiModel` stores that copy as a flat tuple beside the master, whose paths
    would not say which arrays are stacked block weights (split along their layer
    axis, each device would hold whole layers, and XLA gathers the activations
    instead of the weights)."""
    import jax.tree_util as jtu

    import eqx_amp

    def is_bimodel(x):
        return isinstance(x, eqx_amp.BiModel)

    named = {}
    for node in jtu.tree_leaves(tree, is_leaf=is_bimodel):
        if is_bimodel(node):
            for path, leaf in jtu.tree_flatten_with_path(node.compute)[0]:
                named[id(leaf)] = jtu.keystr(path)
    return named


def per_device_bytes(specs) -> int:
    """Bytes of `specs`' arrays one device holds (each array over its shards)."""
    import jax

    total = 0
    for s in jax.tree.leaves(specs):
        shards = math.prod(
            s.sharding.mesh.shape[a] for a in s.sharding.spec if a is not None
        )
        total += s.size * s.dtype.itemsize // shards
    return total


def compile_step(shape: LlamaShape, state_kind: str, products: str, devices):
    """The step compiled for `devices`, with what it holds and moves per device."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import jax.random as jr
    import numpy as np
    from h100_aot import NO_TRITON_GEMM

    start, step = make_step(state_kind, products)
    n = len(devices)
    mesh = jax.sharding.Mesh(np.array(devices), ("fsdp",))
    with jax.numpy_dtype_promotion("standard"):
        split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
        state = eqx.filter_eval_shape(
            lambda: start(build_model(shape, jr.key(0), split))
        )
        dynamic, static = eqx.partition(state, _is_shaped)

        def flat_step(dynamic, tokens, labels):
            new_state, loss = step(eqx.combine(dynamic, static), tokens, labels)
            return eqx.filter(new_state, eqx.is_array), loss

        state_specs = sharded_specs(dynamic, mesh, n, _model_paths(state))
        token = jax.ShapeDtypeStruct(
            (n, shape.seq),
            jnp.int32,
            sharding=jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec("fsdp")
            ),
        )
        began = time.perf_counter()
        lowered = jax.jit(flat_step, donate_argnums=0).lower(state_specs, token, token)
        compiled = lowered.compile(compiler_options=NO_TRITON_GEMM)
    compile_s = time.perf_counter() - began
    memory = compiled.memory_analysis()
    weights = sum(
        x.size for x in jax.tree.leaves(eqx.filter(_weights_of(state), _is_floating))
    )
    held = per_device_bytes(state_specs)
    text = compiled.as_text()
    return {
        "model": shape.describe(),
        "state": state_kind,
        "products": products,
        "devices": n,
        "weights": weights,
        "state_bytes_per_weight": per_device_bytes_total(state_specs) / weights,
        "state_bytes_per_device": held,
        # The tokens and the labels, one sequence of each per device.
        "batch_bytes_per_device": 2 * shape.seq * 4,
        "argument_bytes": memory.argument_size_in_bytes,
        "output_bytes": memory.output_size_in_bytes,
        "alias_bytes": memory.alias_size_in_bytes,
        "temp_bytes": memory.temp_size_in_bytes,
        "total_bytes": memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes,
        "collectives": collectives_per_step(text),
        "attention": shape.attention,
        # cuDNN's flash attention, forward and backward (each block's, once: the
        # scan body is compiled once).
        "fused_attention_calls": text.count('custom_call_target="__cudnn$fmha'),
        "compile_s": compile_s,
    }


def per_device_bytes_total(specs) -> int:
    """Bytes of `specs`' arrays over all devices (each array once)."""
    import jax

    return sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(specs))


def _weights_of(state):
    import eqx_amp

    held = state[0]
    return held.master if isinstance(held, eqx_amp.BiModel) else held


def _is_shaped(x) -> bool:
    import equinox as eqx
    import jax

    return isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x)


def _is_floating(x) -> bool:
    import jax.numpy as jnp

    return _is_shaped(x) and jnp.issubdtype(x.dtype, jnp.inexact)


_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
# A loop: `%while.41 = (<its type>) while(%tuple), condition=%c, body=%b, ...`.
_WHILE = re.compile(r"\swhile\(.*?\bbody=%([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLED = re.compile(
    r"(?:calls|to_apply|body|condition|true_computation|false_computation)"
    r"=%([\w.\-]+)"
)


def collectives_per_step(text: str) -> dict[str, int]:
    """Bytes each device receives from the collectives of a compiled program, by
    kind and dtype (`"all-gather bf16"`), and how many run (`"all-gather count"`),
    per step: a loop's body (the scan over the blocks) counted as many times as its
    known trip count, what it calls as often as it runs. The results of each
    collective are counted (an async start holds its operands too, which
    `_gpu_hlo.collectives` counts for a reduce-scatter: its whole input)."""
    import _gpu_hlo

    computations: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            computations[current] = [line]
        elif current is not None:
            computations[current].append(line)
    # What each computation calls, and how many times per run of it.
    calls = collections.defaultdict(list)
    for name, lines in computations.items():
        for line in lines[1:]:
            loop = _WHILE.search(line)
            trip = _TRIP.search(line)
            for called in _CALLED.findall(line):
                times = (
                    int(trip.group(1))
                    if loop and trip and called == loop.group(1)
                    else 1
                )
                calls[name].append((called, times))
    called_anywhere = {c for v in calls.values() for c, _ in v}
    runs = collections.Counter()
    todo = [(c, 1) for c in computations if c not in called_anywhere]
    while todo:
        name, times = todo.pop()
        runs[name] += times
        todo.extend((c, times * t) for c, t in calls[name])
    found = collections.Counter()
    for name, times in runs.items():
        body = "\n".join(computations[name])
        for inst in _gpu_hlo.parse(body).values():
            kind = inst.op.removesuffix("-start")
            if kind not in _COLLECTIVES or inst.op.endswith("-done"):
                continue
            found[f"{kind} count"] += times
            for dtype, nbytes in _results(inst.op, inst.type):
                found[f"{kind} {dtype}"] += nbytes * times
    return dict(sorted(found.items()))


_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")


def _results(op: str, type_: str) -> list[tuple[str, int]]:
    """(dtype, bytes) of each result of a collective: an async start's type is
    `((operands), results)` or `(operand, result)`; a synchronous one's its
    results."""
    if op.endswith("-start") and type_.startswith("(("):
        depth = 0
        for i, char in enumerate(type_):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 1 and char == ")":
                type_ = type_[i + 1 :]
                break
    arrays = [
        (dtype, math.prod(int(d) for d in dims.split(",") if d))
        for dtype, dims in _ARRAY.findall(type_)
    ]
    if (
        op.endswith("-start")
        and not type_.startswith("((")
        and op != "all-reduce-start"
    ):
        arrays = arrays[len(arrays) // 2 :]
    return [(dtype, n * _itemsize(dtype)) for dtype, n in arrays]


def _itemsize(dtype: str) -> int:
    if dtype.startswith("f8"):
        return 1
    if dtype == "pred":
        return 1
    digits = re.search(r"(\d+)$", dtype)
    return int(digits.group(1)) // 8 if digits else 0


def _collective_text(c: dict) -> str:
    by_dtype = collections.Counter()
    for key, value in c.items():
        if not key.endswith(" count"):
            by_dtype[key.split()[1]] += value
    return ", ".join(f"{d} {v / GiB:.2f}" for d, v in sorted(by_dtype.items())) or "-"


def _kinds_text(c: dict) -> str:
    by_kind = collections.Counter()
    for key, value in c.items():
        if not key.endswith(" count"):
            by_kind[key.split()[0]] += value
    return ", ".join(f"{k} {v / GiB:.2f}" for k, v in sorted(by_kind.items()))


def markdown(rows: list[dict]) -> str:
    lines = [
        "| state | products | state B/weight | arguments GiB | temporaries GiB | "
        "total GiB | fits 80 GB | collectives GiB by dtype | by kind |",
        "|---|---|---:|---:|---:|---:|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {STATE_NAMES[r['state']]} | {r['products']} | "
            f"{r['state_bytes_per_weight']:.2f} | {r['argument_bytes'] / GiB:.2f} | "
            f"{r['temp_bytes'] / GiB:.2f} | {r['total_bytes'] / GiB:.2f} | "
            f"{'yes' if r['total_bytes'] <= HBM_BYTES else '**no**'} | "
            f"{_collective_text(r['collectives'])} | "
            f"{_kinds_text(r['collectives'])} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--depth", type=int, default=0,
                        help="compile this many blocks instead of the model's")  # fmt: skip
    parser.add_argument("--hosts", type=int, default=0,
                        help="hosts of 8 H100s instead of the model's")  # fmt: skip
    parser.add_argument("--states", default=",".join(STATES))
    parser.add_argument("--products", default=",".join(PRODUCTS))
    parser.add_argument("--attention", choices=("xla", "cudnn"), default="xla",
                        help="cudnn: flash attention (no attention matrices)")  # fmt: skip
    parser.add_argument("--json", help="append each row, as a JSON line, here")
    args = parser.parse_args(argv)
    import h100_aot

    missing = h100_aot.plugin_missing()
    if missing:
        print(f"large_model_aot: {missing}", file=sys.stderr)
        return 2
    shape = SHAPES[args.model]
    if args.depth:
        shape = dataclasses.replace(shape, depth=args.depth)
    if args.hosts:
        shape = dataclasses.replace(shape, hosts=args.hosts)
    shape = dataclasses.replace(shape, attention=args.attention)
    devices = topology_devices(shape.hosts, shape.per_host)
    print(f"Llama-shaped: {shape.describe()}", flush=True)
    rows = []
    for products in args.products.split(","):
        for state_kind in args.states.split(","):
            row = compile_step(shape, state_kind, products, devices)
            rows.append(row)
            print(
                f"{state_kind} {products}: {row['weights'] / 1e9:.2f}B weights, "
                f"arguments {row['argument_bytes'] / GiB:.2f} GiB, temporaries "
                f"{row['temp_bytes'] / GiB:.2f} GiB, compiled in "
                f"{row['compile_s']:.0f} s",
                flush=True,
            )
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print("\n" + markdown(rows))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(_HERE))
    sys.path.insert(1, str(_HERE.parent))
    sys.exit(main())
