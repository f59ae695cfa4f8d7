"""Reading dtypes from traced programs: every assertion about precision in the test
suite goes through the jaxpr (or the compiled HLO), never through a docstring."""

import atexit
import importlib.util
import json
import os
import pathlib
import select
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from eqx_amp._core._platform import CPU_FORM_SCOPE


def _sub_jaxprs(value: Any) -> Iterator[Any]:
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def walk_eqns(
    jaxpr: Any, scope: str = "", *, cpu_forms: bool = False
) -> Iterator[tuple[Any, str]]:
    """Every equation of `jaxpr` and of all its sub-jaxprs, with the full named scope
    it runs under (sub-jaxprs only know the scope relative to their parent). The
    CPU forms of `lax.platform_dependent` choices (what only a CPU runs, beside the
    accelerators' program) are left out unless `cpu_forms`."""
    if hasattr(jaxpr, "jaxpr") and not hasattr(jaxpr, "eqns"):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        own = str(eqn.source_info.name_stack)
        full = "/".join(s for s in (scope, own) if s)
        if not cpu_forms and CPU_FORM_SCOPE in full.split("/"):
            continue
        yield eqn, full
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                yield from walk_eqns(sub, full, cpu_forms=cpu_forms)


def traced(fn, *args, **kwargs):
    """The jaxpr of `fn`; non-array arguments (modules' activations, ...) are static."""
    return eqx.filter_make_jaxpr(fn)(*args, **kwargs)[0]


def eqns_named(jaxpr, *names: str) -> list[tuple[Any, str]]:
    return [(e, s) for e, s in walk_eqns(jaxpr) if e.primitive.name in names]


def in_dtypes(eqn) -> list[np.dtype]:
    return [v.aval.dtype for v in eqn.invars if hasattr(v.aval, "dtype")]


def out_dtypes(eqn) -> list[np.dtype]:
    return [v.aval.dtype for v in eqn.outvars]


MATMULS = ("dot_general", "conv_general_dilated")
REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax")


def assert_matmuls_in(jaxpr, dtype, at_least: int = 1) -> None:
    found = eqns_named(jaxpr, *MATMULS)
    assert len(found) >= at_least, f"expected matmuls, found {len(found)}"
    for eqn, scope in found:
        assert in_dtypes(eqn) == [np.dtype(dtype)] * len(eqn.invars), (
            f"{eqn.primitive} under {scope!r} has inputs {in_dtypes(eqn)}"
        )


def assert_scope_in_float32(jaxpr, scope_name: str, at_least: int = 1) -> None:
    """Every reduction and rsqrt under `scope_name` reads and writes float32."""
    found = [
        (e, s)
        for e, s in walk_eqns(jaxpr)
        if scope_name in s and e.primitive.name in (*REDUCTIONS, "rsqrt")
    ]
    assert len(found) >= at_least, f"no reductions found under {scope_name!r}"
    for eqn, scope in found:
        dtypes = in_dtypes(eqn) + out_dtypes(eqn)
        # `jnp.issubdtype`: numpy does not count bfloat16 as floating.
        assert all(
            d == np.float32 for d in dtypes if jnp.issubdtype(d, jnp.floating)
        ), f"{eqn.primitive} under {scope!r} runs in {dtypes}"


def float_dtypes(tree) -> set[np.dtype]:
    return {
        leaf.dtype
        for leaf in jax.tree_util.tree_leaves(tree)
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)
    }


def run_on_eight_devices(script: str) -> dict:
    """Runs `tests/<script>` on 8 fake CPU devices and returns the JSON report it
    prints last."""
    root = pathlib.Path(__file__).resolve().parent.parent
    return _eight_devices().run({"path": str(root / "tests" / script)})


def run_script_on_eight_devices(source: str, promotion: str = "strict") -> dict:
    """Runs Python `source` on 8 fake CPU devices, with the given dtype promotion
    (strict by default; "standard" for user code with optax), and returns the dict it
    leaves in a variable named `report`."""
    return _eight_devices().run({"source": source, "promotion": promotion})


# The device count must be set before JAX is imported, so 8-device code runs in
# another interpreter. One such interpreter per test process serves every script (each
# in a fresh namespace) instead of one interpreter, one JAX import and cold caches per
# script.
_WORKER = r"""
import contextlib, io, json, sys, traceback
import jax
import jax.numpy as jnp
import jax.random as jr
protocol = sys.stdout
sys.stdout = sys.stderr
defaults = {name: getattr(jax.config, name) for name in (
    "jax_numpy_dtype_promotion", "jax_numpy_rank_promotion", "jax_enable_x64")}
for line in sys.stdin:
    request = json.loads(line)
    for name, value in defaults.items():
        jax.config.update(name, value)
    jax.config.update("jax_numpy_dtype_promotion", request.get("promotion", "strict"))
    path = request.get("path")
    # Sources are snippets that may use `jax` without importing it, as the
    # one-interpreter-per-script runner let them (it prepended the import).
    source = open(path).read() if path else "import jax\n" + request["source"]
    namespace = {"__name__": "__main__", "__file__": path or "<eight devices>"}
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(source, path or "<eight devices>", "exec"), namespace)
        if path:
            report = json.loads(printed.getvalue().strip().splitlines()[-1])
        else:
            report = namespace["report"]
        reply = {"report": report}
    except BaseException:
        reply = {"error": traceback.format_exc() + printed.getvalue()[-2000:]}
    protocol.write(json.dumps(reply) + "\n")
    protocol.flush()
"""


class _EightDevices:
    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        root = pathlib.Path(__file__).resolve().parent.parent
        env = dict(os.environ)
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        ).strip()
        env["JAX_PLATFORMS"] = "cpu"
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(root), env.get("PYTHONPATH")])
        )
        return subprocess.Popen(
            [sys.executable, "-c", _WORKER],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def run(self, request: dict, timeout: float = 600) -> dict:
        if self._process is None or self._process.poll() is not None:
            self._process = self._start()
        process = self._process
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(json.dumps(request) + "\n")
        process.stdin.flush()
        ready, _, _ = select.select([process.stdout], [], [], timeout)
        line = process.stdout.readline() if ready else ""
        if not line:
            process.kill()
            self._process = None
            raise AssertionError("the 8-device interpreter died or timed out")
        reply = json.loads(line)
        assert "error" not in reply, reply.get("error")
        return reply["report"]

    def close(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process = None


_WORKER_PROCESS = _EightDevices()
atexit.register(_WORKER_PROCESS.close)


def _eight_devices() -> _EightDevices:
    return _WORKER_PROCESS


def run_repo_script(relative: str, *args: str, timeout: int = 900) -> str:
    """Runs a script of this repository on CPU, with the checkout's `eqx_amp` first
    on the path, and returns what it printed (failing with its stderr)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(root), os.environ.get("PYTHONPATH")])
        ),
    }
    result = subprocess.run(
        [sys.executable, str(root / relative), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def check_first_order_and_retracing(product, key) -> None:
    """A by-hand fp8 product `product(x, w)` of 32 x 32 operands: its jitted gradient
    runs, its second derivative is refused, `jit` gives the eager values, and a new
    shape retraces to that shape's product."""
    k1, k2, k3 = jr.split(key, 3)
    x, w = jr.normal(k1, (32, 32)), jr.normal(k2, (32, 32))

    def loss(w):
        return jnp.sum(product(x, w) ** 2)

    jax.jit(jax.grad(loss))(w)
    with pytest.raises(NotImplementedError, match="first-order derivatives only"):
        jax.jit(jax.hessian(loss))(w)
    np.testing.assert_array_equal(product(x, w), jax.jit(product)(x, w))
    wide, ones = jr.normal(k3, (64, 32)), jnp.ones((8, 64))
    np.testing.assert_array_equal(jax.jit(product)(ones, wide), product(ones, wide))


def halves_its_loss_with_an_optax_chain(model, forward, key, steps: int = 60) -> bool:
    """Whether `steps` steps of a clipped Adam (`optax.chain`) halve the mean squared
    error of `forward(model, x)` (an fp8 road's output) on a fixed regression of
    64-wide inputs onto 32 outputs."""
    import optax

    x = jr.normal(key, (64, 64))
    y = jnp.tanh(x[:, :32] * 2)
    optimiser = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(3e-3))
    state = optimiser.init(eqx.filter(model, eqx.is_array))

    def loss(model):
        return jnp.mean((forward(model, x).astype(jnp.float32) - y) ** 2)

    @eqx.filter_jit
    def step(model, state):
        value, grads = eqx.filter_value_and_grad(loss)(model)
        # optax.adam's bias correction raises a float32 to an int32 power.
        with jax.numpy_dtype_promotion("standard"):
            updates, state = optimiser.update(grads, state, model)
        return eqx.apply_updates(model, updates), state, value

    first = None
    for _ in range(steps):
        model, state, value = step(model, state)
        first = value if first is None else first
    return float(value) < 0.5 * float(first)


def rel_error(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-12))


def assert_tree_close(a, b, tol):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.dtype == y.dtype
        assert rel_error(x, y) < tol


def global_rel_error(a, b):
    """Relative error of two gradient trees as one vector: leaves whose true gradient
    is zero (a conv bias under BatchNorm) hold only rounding noise, which a per-leaf
    relative error would magnify without bound."""
    flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(t)])  # noqa: E731
    return rel_error(flat(a), flat(b))


def ops_in(jaxpr, name):
    return [in_dtypes(e) for e, _ in eqns_named(jaxpr, name)]


def benchmark_row(rows: list[dict], **where) -> dict:
    """The one row of `benchmarks/sharded.py --json` whose fields match `where`."""
    (found,) = [r for r in rows if all(r[k] == v for k, v in where.items())]
    return found


def collective_bytes(row: dict, group: str, dtypes=None) -> int:
    """Bytes of one group of a row's collectives, of `dtypes` (all when None)."""
    by_dtype = row["collectives"].get(group, {})
    return sum(b for d, b in by_dtype.items() if dtypes is None or d in dtypes)


# GPU compiles without a GPU (benchmarks/h100_aot.py, b200_aot.py) need the CUDA
# plugin, which `.ci/run` installs in an environment of its own.
needs_cuda_plugin = pytest.mark.skipif(
    importlib.util.find_spec("jax_cuda12_plugin") is None,
    reason='the CUDA plugin is not installed (pip install "jax[cuda12]==<jax>")',
)
BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def result_of_compile_script(script: str, *args: str, timeout: int = 1800) -> Any:
    """What `script` prints after `RESULT` (JSON), run as `python -c script
    <benchmarks folder> *args` in a fresh interpreter: the CUDA plugin must learn
    that there is no GPU before JAX starts its backends, which pytest's process
    has done."""
    run = subprocess.run(
        [sys.executable, "-c", script, str(BENCHMARKS), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    (line,) = [x for x in run.stdout.splitlines() if x.startswith("RESULT")]
    return json.loads(line[len("RESULT") :])


class ScannedLinears(eqx.Module):
    """`eqx.nn.Linear` layers stacked along a leading axis (`eqx.filter_vmap` of
    their constructor) and run one after another by `lax.scan`, each followed by
    `tanh`. `batched`: each layer is `jax.vmap`ped over the input's leading axis
    (a batch); otherwise it reads one example."""

    blocks: eqx.nn.Linear
    batched: bool = eqx.field(static=True, default=False)

    def __call__(self, x):
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def body(h, block):
            layer = eqx.combine(block, static)
            return jnp.tanh(jax.vmap(layer)(h) if self.batched else layer(h)), None

        return jax.lax.scan(body, x, dynamic)[0]


def scanned_linears(n: int, width: int, batched: bool = False) -> ScannedLinears:
    """`n` layers of `width` features, from fixed keys."""
    keys = jr.split(jr.key(0), n)
    blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(width, width, key=k))(keys)
    return ScannedLinears(blocks, batched)


def fp8_roads(rule) -> dict:
    """The three ways a model meets an fp8 `rule`: `filter_amp(fp8=)`,
    `BiModel(fp8=)` and `autocast`'s rule for `dot_general`."""
    import eqx_amp

    return {
        "filter_amp": lambda m: eqx_amp.filter_amp(m, fp8=rule),
        "bimodel": lambda m: eqx_amp.BiModel(m, fp8=rule),
        "autocast": lambda m: eqx_amp.autocast(m, rules={jax.lax.dot_general_p: rule}),
    }


# `(road, vmap)` pairs for a per-example model: each road under `jax.vmap`, and
# `filter_amp` around an `eqx.filter_vmap` of it.
ROAD_VMAPS = [
    *((road, "jax.vmap") for road in ("autocast", "bimodel", "filter_amp")),
    ("filter_amp", "eqx.filter_vmap inside"),
]


def batched_on_road(roads: dict, road: str, vmap: str):
    """`forward(model, x)`: the per-example `model` on a batch, wrapped by `road`
    outside a `jax.vmap`, or around an `eqx.filter_vmap` of it."""

    def forward(model, x):
        if vmap == "jax.vmap":
            return jax.vmap(roads[road](model))(x)
        return roads[road](eqx.filter_vmap(model))(x)

    return forward


def run_example(name: str, *args: str) -> str:
    """What `examples/<name> <args>` prints, run in a CPU-only interpreter with the
    checkout's `eqx_amp` first on its path (installed or not); fails the test if it
    exits with an error."""
    root = pathlib.Path(__file__).resolve().parent.parent
    pythonpath = [str(root), os.environ.get("PYTHONPATH", "")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in pythonpath if p),
        "JAX_PLATFORMS": "cpu",
    }
    result = subprocess.run(
        [sys.executable, str(root / "examples" / name), *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout
