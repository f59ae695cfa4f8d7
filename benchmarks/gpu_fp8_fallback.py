"""Which fp8 products a GPU runs wrongly, and why: the hostile fp8 cases that failed
on an H100 (`tests/test_fp8_hostile.py`), each compiled and run under XLA's
defaults and under flags that switch one suspect off; prints the non-finite
outputs, the error against float64 and the dots of the optimised HLO (kept under
`--hlo`), then the weight gradients of a layer quantised once per call against
once per product, which differed there (RESULTS.md, "Second H100 lease").
On a CPU every line shows finite outputs and a difference of 0.

    python benchmarks/gpu_fp8_fallback.py [--hlo DIR]
"""

import os
import subprocess
import sys


FLAGS = {
    "default": "",
    "no-excess-precision": "--xla_allow_excess_precision=false",
    "no-triton-gemm": "--xla_gpu_enable_triton_gemm=false",
}

CHILD = r"""
import re, sys, numpy as np, jax, jax.numpy as jnp, jax.random as jr
sys.path.insert(0, ".")
import eqx_amp
hlo_dir = sys.argv[1]
MATMUL = (((1,), (0,)), ((), ()))
SHAPES = {
    "batch": ((2, 3, 5), (2, 5, 4), (((2,), (1,)), ((0,), (0,)))),
    "rhs-t-batch-last": ((3, 5, 2), (4, 5, 2), (((1,), (1,)), ((2,), (2,)))),
    "mm": ((5, 12), (12, 7), MATMUL),
    "mm16": ((16, 48), (48, 32), MATMUL),
}
k1, k2, k3 = jr.split(jr.key(0), 3)
def case(shape, scales):
    ls, rs, dims = SHAPES[shape]
    a, b = jr.normal(k1, ls) * scales[0], jr.normal(k2, rs) * scales[1]
    out = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dims), a, b).shape
    return a, b, jr.normal(k3, out) * scales[2], dims
CASES = {
    "batch": ("batch", (1, 1, 1)),
    "rhs-t-batch-last": ("rhs-t-batch-last", (1, 1, 1)),
    "mm-ordinary": ("mm", (1, 1, 1)),
    "mm-small-operands": ("mm", (1e-18, 1e-18, 1)),
    "mm-huge-times-tiny": ("mm", (1e36, 1e-36, 1)),
    "mm16-ordinary": ("mm16", (1, 1, 1)),
    "mm16-small-operands": ("mm16", (1e-18, 1e-18, 1)),
}
for name, (shape, scales) in CASES.items():
    a, b, g, dims = case(shape, scales)
    for scaling in ("tensorwise", "rowwise"):
        def both(a, b, g):
            f = lambda a, b: eqx_amp.fp8.dot_general(a, b, dims, scaling=scaling, out_dtype=jnp.float32)
            y, pb = jax.vjp(f, a, b)
            return (y, *pb(g))
        fn = jax.jit(both)
        text = fn.lower(a, b, g).compile().as_text()
        with open(f"{hlo_dir}/{name}-{scaling}.txt", "w") as f:
            f.write(text)
        got = [np.asarray(v, np.float64) for v in fn(a, b, g)]
        a64, b64, g64 = (np.asarray(v, np.float64) for v in (a, b, g))
        ref = jax.jit(lambda a, b, g: (lambda y, pb: (y, *pb(g)))(*jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dims, precision="highest"), a, b)))
        want = [np.asarray(v, np.float64) for v in ref(a, b, g)]
        parts = []
        for label, x, w in zip(("y", "da", "db"), got, want):
            bad = int((~np.isfinite(x)).sum())
            err = float(np.max(np.abs(np.nan_to_num(x) - w) / (np.max(np.abs(w)) or 1.0)))
            parts.append(f"{label}: {bad} nonfinite, err {err:.2e}")
        dots = sorted(set(re.findall(r"(custom_call_target=\"[^\"]+\"|[a-z0-9]+\[[0-9,]*\][^ ]* dot\(|f16\[[0-9,]*\]\{[0-9,]*\} (?:dot|convert)\()", text)))
        f16 = len(re.findall(r"f16\[", text))
        print(f"{name:22s} {scaling:10s} | " + "; ".join(parts) + f" | f16 arrays {f16} | " + ", ".join(d.split("=")[-1] for d in dots), flush=True)

# A weight quantised once per call against once per product (a checkpointed layer):
# on an H100 the weight gradients of `filter_amp` and `BiModel` differed by up to
# 18% between the two programs (`tests/test_fp8_hostile.py::
# test_weights_quantised_once_match_quantising_at_each_product`), which a CPU
# computes bit for bit alike.
import equinox as eqx
class Checkpointed(eqx.Module):
    layer: eqx.nn.Linear
    def __call__(self, x):
        return eqx.filter_checkpoint(self.layer)(x)
linear = eqx.nn.Linear(48, 32, key=jr.key(30))
x = jr.normal(jr.key(31), (16, 48))
for road in ("filter_amp", "autocast", "bimodel"):
    fp8 = eqx_amp.fp8.TENSORWISE
    def wrap(model):
        if road == "filter_amp":
            return eqx_amp.filter_amp(model, fp8=fp8)
        if road == "autocast":
            return eqx_amp.autocast(model, rules={jax.lax.dot_general_p: fp8})
        return eqx_amp.BiModel(model, fp8=fp8)
    def loss(model, x):
        return jnp.sum(wrap(eqx.filter_vmap(model))(x).astype(jnp.float32) ** 2)
    grads = []
    for name, model in (("once", linear), ("each", Checkpointed(linear))):
        params, static = eqx.partition(model, eqx.is_array)
        step = jax.jit(lambda p, x: eqx.filter_grad(loss)(eqx.combine(p, static), x))
        with open(f"{hlo_dir}/weights-{road}-{name}.txt", "w") as f:
            f.write(step.lower(params, x).compile().as_text())
        g = step(params, x)
        grads.append(np.asarray(g.weight if name == "once" else g.layer.weight, np.float64))
    diff = np.max(np.abs(grads[0] - grads[1]) / (np.abs(grads[1]) + 1e-30))
    print(f"weights quantised once vs at each product, {road:10s}: max rel diff {diff:.2e}", flush=True)
"""


def main() -> int:
    hlo = (
        sys.argv[sys.argv.index("--hlo") + 1] if "--hlo" in sys.argv else "/tmp/fp8-hlo"
    )
    for label, flags in FLAGS.items():
        out = os.path.join(hlo, label)
        os.makedirs(out, exist_ok=True)
        env = dict(os.environ, XLA_FLAGS=flags, PYTHONUNBUFFERED="1")
        print(f"== XLA_FLAGS={flags or '(none)'}", flush=True)
        try:
            subprocess.run([sys.executable, "-c", CHILD, out], env=env, timeout=40)
        except subprocess.TimeoutExpired:
            print("   (timed out)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
