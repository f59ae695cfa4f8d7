"""What XLA's optimised GPU HLO runs: its products and kernels, read from the text.

`products(text)` finds every matmul and convolution of a compiled GPU program:

- cuBLAS calls (`__cublas$lt$matmul`, `__cublas$gemm`) and cuBLASLt's fp8 GEMM
  (`__cublas$lt$matmul$f8`), with the dtypes of their operands;
- cuDNN convolutions (`__cudnn$convForward`, `...BackwardInput`, `...BackwardFilter`,
  `...ForwardGraph`: the fused graph that fp8 convolutions run as);
- Triton GEMM fusions (XLA's choice when it cannot autotune), with the dtypes their
  dots read: for a dot that reads a conversion, the dtype converted from (a Triton
  dot of conversions from fp8 multiplies fp8 values in a wider type).

Each product keeps the JAX `op_name` it came from, which holds the named scopes: an
eqx_amp fp8 product is under `eqx_amp.fp8` (and one an fp8 rule left out of fp8 under
`eqx_amp.fp8_skipped: <why>`). `kernels(text)` counts the fusions launched and the
converts. Only the text is read: no GPU, no plugin.
"""

import collections
import dataclasses
import math
import re


FP8_SKIPPED_SCOPE = "eqx_amp.fp8_skipped"
FP8_TYPES = ("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz", "f8e5m2fnuz")

_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*")
_OPERAND = re.compile(r"%([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FUSION_KIND = re.compile(r'"kind":"(__[\w]+)"')
# eqx_amp's fp8 scope in an op_name (`vmap(eqx_amp.fp8)/dot_general`), not the skipped one.
_IN_FP8_SCOPE = re.compile(r"eqx_amp\.fp8(?![\w])")
_LAYOUT = ("bitcast", "copy", "transpose", "reshape")
_HIGHEST = re.compile(r'"operand_precision":\["HIGHEST","HIGHEST"\]')


def _bits(dtype: str) -> int:
    """Bits of an HLO element type (`f8e4m3fn` 8, `bf16` 16, `f32` 32)."""
    if dtype.startswith("f8"):
        return 8
    digits = re.search(r"(\d+)$", dtype)
    return int(digits.group(1)) if digits else 0


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    type: str  # "f32[128,64]{1,0}", or a tuple "(f32[..], s8[..])"
    op: str  # "custom-call", "fusion", "dot", "convert", ...
    operands: tuple[str, ...]
    arguments: str  # the text between the parentheses (a parameter's index)
    attributes: str  # the rest of the line
    computation: str
    root: bool

    @property
    def dtype(self) -> str:
        """The element type of the (first) result."""
        return self.type.lstrip("(").split("[", 1)[0]

    @property
    def op_name(self) -> str:
        match = _OP_NAME.search(self.attributes)
        return match.group(1) if match else ""


@dataclasses.dataclass(frozen=True)
class Product:
    """One matmul or convolution of the compiled program."""

    kind: str  # "cublas", "cublas-fp8", "triton", "cudnn", "cudnn-fp8"
    call: str  # the custom-call target, or the Triton fusion's kind
    reads: tuple[str, ...]  # the dtypes it multiplies
    op_name: str
    # A cuBLAS call asked for `Precision.HIGHEST`: an fp8 GEMM then accumulates
    # precisely (at DEFAULT, cuBLASLt's fast fp8 accumulation).
    precise: bool = False
    # The dtype it writes: an fp8 GEMM that writes float32 leaves its scales to
    # another kernel; one that takes them writes the compute dtype.
    writes: str = ""

    @property
    def fp8(self) -> bool:
        """Whether it multiplies fp8 values: cuBLASLt's fp8 GEMM, a cuDNN
        convolution of fp8 operands, or a Triton dot of fp8 values."""
        return self.kind in ("cublas-fp8", "cudnn-fp8", "cudnn-mxfp8") or (
            self.kind == "triton" and all(t in FP8_TYPES for t in self.reads)
        )

    @property
    def asked_for_fp8(self) -> bool:
        """Whether eqx_amp made it an fp8 product (its fp8 scope, not skipped)."""
        return bool(_IN_FP8_SCOPE.search(self.op_name)) and (
            FP8_SKIPPED_SCOPE not in self.op_name
        )


def _split_type(rest: str) -> tuple[str, str]:
    """(the result type, what follows it) of the text after `%name = `."""
    if rest.startswith("("):
        depth = 0
        for i, char in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].lstrip()
    type_, _, after = rest.partition(" ")
    return type_, after


def _call_operands(text: str) -> tuple[str, str]:
    """(the operands between the op's parentheses, the attributes after them), from
    the text after the opening parenthesis."""
    depth = 1
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and char == ")":
            return text[:i], text[i + 1 :]
    return text, ""


def parse(text: str) -> dict[str, Instruction]:
    """Every instruction of an HLO module's text, by name (names are unique in a
    module)."""
    instructions = {}
    computation = ""
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            computation = header.group(1)
            continue
        named = _NAME.match(line)
        if not named:
            continue
        type_, rest = _split_type(line[named.end() :])
        op, _, after = rest.partition("(")
        operands, attributes = _call_operands(after)
        instructions[named.group(1)] = Instruction(
            name=named.group(1),
            type=type_,
            op=op.strip(),
            operands=tuple(_OPERAND.findall(re.sub(r"/\*.*?\*/", "", operands))),
            arguments=operands,
            attributes=attributes,
            computation=computation,
            root=line.lstrip().startswith("ROOT"),
        )
    return instructions


class _Module:
    def __init__(self, text: str):
        self.instructions = parse(text)
        self.roots = {i.computation: i for i in self.instructions.values() if i.root}
        # A fused computation -> the instruction that calls it.
        self.caller = {}
        for i in self.instructions.values():
            for called in _CALLS.findall(i.attributes):
                self.caller.setdefault(called, i)

    def _producer(self, name: str) -> Instruction | None:
        """The instruction that makes a value, through layout ops, fusion
        boundaries (a fusion's root) and fusion parameters (the caller's operand)."""
        for _ in range(64):
            inst = self.instructions.get(name)
            if inst is None:
                return None
            if inst.op in _LAYOUT and inst.operands:
                name = inst.operands[0]
            elif inst.op == "fusion" and _CALLS.search(inst.attributes):
                root = self.roots.get(_CALLS.search(inst.attributes).group(1))
                if root is None:
                    return inst
                name = root.name
            elif inst.op == "parameter" and inst.computation in self.caller:
                caller = self.caller[inst.computation]
                index = int(inst.arguments)
                if index >= len(caller.operands):
                    return inst
                name = caller.operands[index]
            else:
                return inst
        return None

    def read_dtype(self, name: str) -> str:
        """The dtype a product reads from `name`: its own, or where it is a
        conversion up, the narrower dtype converted from (the values it holds)."""
        inst = self.instructions.get(name)
        if inst is None:
            return "?"
        maker = self._producer(name)
        if maker is not None and maker.op == "convert" and maker.operands:
            source = self._producer(maker.operands[0])
            if source is not None and _bits(source.dtype) < _bits(inst.dtype):
                return source.dtype
        return inst.dtype

    def computations_under(self, name: str) -> list[str]:
        """`name` and the computations it calls, transitively."""
        seen, todo = [], [name]
        while todo:
            current = todo.pop()
            if current in seen:
                continue
            seen.append(current)
            for i in self.instructions.values():
                if i.computation == current:
                    todo.extend(_CALLS.findall(i.attributes))
        return seen


def _operand_dtypes(module: _Module, inst: Instruction, n: int) -> tuple[str, ...]:
    return tuple(
        module.instructions[o].dtype if o in module.instructions else "?"
        for o in inst.operands[:n]
    )


def products(text: str) -> list[Product]:
    """Every matmul and convolution of a compiled GPU program."""
    module = _Module(text)
    found = []
    for inst in module.instructions.values():
        if inst.op == "custom-call":
            target = _TARGET.search(inst.attributes)
            target = target.group(1) if target else ""
            reads = _operand_dtypes(module, inst, 2)
            if "cublas" in target:
                kind = "cublas-fp8" if target.endswith("$f8") else "cublas"
            elif target.startswith("__cudnn$conv"):
                fp8 = all(t in FP8_TYPES for t in reads)
                kind = "cudnn-fp8" if fp8 else "cudnn"
            elif target == BLOCK_SCALED_DOT:  # MXFP8 (Blackwell): e8m0 scales inside
                kind = "cudnn-mxfp8"
            else:
                continue
            precise = bool(_HIGHEST.search(inst.attributes))
            found.append(
                Product(kind, target, reads, inst.op_name, precise, inst.dtype)
            )
        elif inst.op == "fusion":
            fusion_kind = _FUSION_KIND.search(inst.attributes)
            if fusion_kind is None or "gemm" not in fusion_kind.group(1):
                continue
            called = _CALLS.search(inst.attributes)
            for computation in module.computations_under(called.group(1)):
                for dot in module.instructions.values():
                    if dot.computation == computation and dot.op == "dot":
                        reads = tuple(module.read_dtype(o) for o in dot.operands)
                        found.append(
                            Product("triton", fusion_kind.group(1), reads, inst.op_name)
                        )
    return found


def kernels(text: str) -> dict[str, int]:
    """Fusions launched (those outside other fusions) and converts anywhere."""
    module = _Module(text)
    fused = {
        c
        for i in module.instructions.values()
        if i.op == "fusion"
        for c in _CALLS.findall(i.attributes)
    }
    inside = set()
    for computation in fused:
        inside.update(module.computations_under(computation))
    counts = collections.Counter()
    for inst in module.instructions.values():
        if inst.op == "fusion" and inst.computation not in inside:
            counts["fusions"] += 1
        if inst.op == "convert":
            counts["converts"] += 1
    return {"fusions": counts["fusions"], "converts": counts["converts"]}


def summary(found: list[Product]) -> dict[str, int]:
    """Products by kind and the dtype they multiply: `cublas-fp8` (fast
    accumulation), `cublas-fp8 precise` (`Precision.HIGHEST`), `cublas bf16`,
    `cublas f32`, `cudnn-fp8`, `cudnn bf16`, `triton f8e4m3fn x f8e4m3fn`, ..."""
    counts = collections.Counter()
    for p in found:
        if p.kind == "cublas-fp8" and p.precise:
            counts["cublas-fp8 precise"] += 1
        elif p.kind in ("cublas-fp8", "cudnn-fp8", "cudnn-mxfp8"):
            counts[p.kind] += 1
        elif p.kind == "triton":
            counts[f"triton {' x '.join(p.reads)}"] += 1
        else:
            counts[f"{p.kind} {'/'.join(sorted(set(p.reads)))}"] += 1
    return dict(sorted(counts.items()))


def not_fp8(found: list[Product]) -> list[Product]:
    """The products eqx_amp made fp8 ones that the compiled program does not run
    in fp8."""
    return [p for p in found if p.asked_for_fp8 and not p.fp8]


_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all")
_BYTES = {8: 1, 16: 2, 32: 4, 64: 8}


def _arrays(type_: str) -> list[tuple[str, int]]:
    """(dtype, element count) of each array in an HLO type."""
    arrays = []
    for dtype, dims in _ARRAY.findall(type_):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        arrays.append((dtype, count))
    return arrays


def collectives(text: str) -> dict[str, int]:
    """Bytes each device receives from the collectives of a compiled program, by kind
    and dtype (`"all-gather bf16"`), and how many of each kind there are (`"all-reduce
    count"`). An async `all-gather-start` holds its operands and its results: the
    results are counted."""
    found = collections.Counter()
    for inst in parse(text).values():
        kind = inst.op.removesuffix("-start")
        if kind not in _COLLECTIVES or inst.op.endswith("-done"):
            continue
        arrays = _arrays(inst.type)
        if inst.op == "all-gather-start":
            arrays = arrays[len(arrays) // 2 :]
        found[f"{kind} count"] += 1
        for dtype, count in arrays:
            found[f"{kind} {dtype}"] += count * _BYTES.get(_bits(dtype), 0)
    return dict(sorted(found.items()))


def all_reduces(text: str) -> list[list[tuple[str, int]]]:
    """Each all-reduce of a compiled program, in program order, as the dtype and
    element count of each array it reduces (after XLA's combiners, which merge
    independent all-reduces into one, of one array or several)."""
    return [
        _arrays(inst.type)
        for inst in parse(text).values()
        if inst.op in ("all-reduce", "all-reduce-start")
    ]


#
# A roofline from the compiled program: each kernel at the rate that bounds it.
#


@dataclasses.dataclass(frozen=True)
class Device:
    """Dense peaks and memory bandwidth of a GPU, and the share of each a kernel is
    taken to reach."""

    name: str
    peak_flops: dict[str, float]  # by what a GEMM reads: "fp4", "fp8", "bf16", "f32"
    bandwidth: float  # bytes per second
    gemm_efficiency: float = 0.7
    memory_efficiency: float = 0.8
    launch_s: float = 3e-6


H100_SXM = Device(
    "H100 SXM", {"fp8": 1979e12, "bf16": 989e12, "f32": 67e12}, bandwidth=3.35e12
)
# Dense peaks; fp8 (MXFP8 included) twice bf16, NVFP4 twice fp8; f32 by CUDA cores.
B200 = Device(
    "B200",
    {"fp4": 9000e12, "fp8": 4500e12, "bf16": 2250e12, "f32": 80e12},
    bandwidth=8e12,
)
# cuDNN's block-scaled GEMM (`jax.nn.scaled_matmul`): `(B, M, K) x (B, N, K)`.
BLOCK_SCALED_DOT = "__cudnn$blockScaledDot"
# cuDNN's flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`):
# `__cudnn$fmhaSoftmax`, `__cudnn$fmhaSoftmaxBackward`, and their dropout and bias forms.
FUSED_ATTENTION = "__cudnn$fmha"
_ATTENTION_MATRIX = re.compile(
    r'"intermediate_tensor_shape":\s*\{"element_type":\s*"\w+",\s*'
    r'"dimensions":\s*\[([^\]]*)\]'
)
_CAUSAL = re.compile(r'"mask_type":\s*"\w*CAUSAL"')
# The kinds of kernel a roofline tells apart, besides GEMMs.
NON_GEMM_KINDS = ("quantise", "amax", "epilogue", "layout", "other")
# Ops that launch nothing (views, bookkeeping, control flow around kernels).
_NOT_KERNELS = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
    "conditional", "call", "after-all", "partition-id", "replica-id", "opt-barrier",
    "add-dependency", "domain", "reshape", "async-done", "all-gather-done",
    "all-reduce-done", "collective-permute-done", "copy-done", "send-done",
    "recv-done",
}  # fmt: skip
_BODIES = re.compile(
    r"(?:body|condition|to_apply|true_computation|false_computation)=%([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TO_APPLY = re.compile(r"to_apply=%([\w.\-]+)")
_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


def _launching_computations(module: _Module) -> set[str]:
    """The computations whose instructions are kernels or launch them: the entry
    and the bodies of loops, conditionals and calls, not fused computations or
    reducers."""
    entry = next((i.computation for i in module.instructions.values() if i.root), None)
    by_computation = collections.defaultdict(list)
    for inst in module.instructions.values():
        by_computation[inst.computation].append(inst)
    # The entry computation is the one no instruction calls.
    called = set()
    for inst in module.instructions.values():
        called.update(_CALLS.findall(inst.attributes))
        called.update(_TO_APPLY.findall(inst.attributes))
        called.update(_BODIES.findall(inst.attributes))
        for group in _BRANCHES.findall(inst.attributes):
            called.update(re.findall(r"%([\w.\-]+)", group))
    entries = [c for c in by_computation if c not in called] or [entry]
    launching, todo = set(), list(entries)
    while todo:
        current = todo.pop()
        if current in launching:
            continue
        launching.add(current)
        for inst in by_computation[current]:
            if inst.op in ("while", "conditional", "call"):
                todo.extend(_BODIES.findall(inst.attributes))
                for group in _BRANCHES.findall(inst.attributes):
                    todo.extend(re.findall(r"%([\w.\-]+)", group))
    return launching


def _array_bytes(type_: str) -> int:
    return sum(count * _BYTES.get(_bits(d), 0) for d, count in _arrays(type_))


def _gemm_flops(module: _Module, inst: Instruction) -> float:
    """2 x output elements x contracted size of a cuBLAS GEMM (convolutions: 0, so
    they are timed by their bytes)."""
    contracting = _CONTRACTING.search(inst.attributes)
    block_scaled = BLOCK_SCALED_DOT in inst.attributes
    if not (contracting or block_scaled) or not inst.operands:
        return 0.0
    lhs = module.instructions.get(inst.operands[0])
    lhs_dims = _ARRAY.findall(lhs.type) if lhs else []
    if not lhs_dims:
        return 0.0
    sizes = [int(d) for d in lhs_dims[0][1].split(",") if d]
    indices = (
        [len(sizes) - 1] if block_scaled else re.findall(r"\d+", contracting.group(1))
    )
    contracted = 1
    for index in indices:
        contracted *= sizes[int(index)]
    (_, out_count), *_ = _arrays(inst.type)
    return 2.0 * out_count * contracted


def _attention_flops(module: _Module, inst: Instruction, target: str) -> float:
    """FLOPs of a cuDNN flash-attention call, as the GEMMs it runs: the forward two
    (scores, probabilities times values), the backward five (the scores again and
    the gradients of the probabilities, values, queries and keys), each `2 x batch x
    heads x queries x keys x head size`; a causal mask halves them (cuDNN skips the
    blocks it masks)."""
    matrix = _ATTENTION_MATRIX.search(inst.attributes)
    query = module.instructions.get(inst.operands[0]) if inst.operands else None
    query_dims = _ARRAY.findall(query.type) if query else []
    if matrix is None or not query_dims:
        return 0.0
    batch_heads_queries_keys = math.prod(int(d) for d in re.findall(r"\d+", matrix[1]))
    head_size = int(query_dims[0][1].split(",")[-1])
    gemms = 5 if "Backward" in target else 2
    causal = 0.5 if _CAUSAL.search(inst.attributes) else 1.0
    return gemms * 2.0 * batch_heads_queries_keys * head_size * causal


def _source(module: _Module, name: str) -> Instruction | None:
    """The instruction a value comes from, through tuple elements and bitcasts."""
    inst = module.instructions.get(name)
    while inst is not None and inst.op in ("get-tuple-element", "bitcast"):
        inst = module.instructions.get(inst.operands[0]) if inst.operands else None
    return inst


def _kind(module: _Module, inst: Instruction) -> str:
    """Which of `NON_GEMM_KINDS` a kernel that is not a GEMM is."""
    if any(d in FP8_TYPES for d, _ in _arrays(inst.type)):
        return "quantise"
    for operand in inst.operands:
        source = _source(module, operand)
        if source is not None and _TARGET.search(source.attributes or ""):
            target = _TARGET.search(source.attributes).group(1)
            # An fp8 GEMM that writes float32 leaves its rescale and convert to the
            # kernel after it; one that takes its scales writes the product itself.
            writes = [d for d, _ in _arrays(source.type) if d != "s8"]
            if target.endswith("$f8") and writes[:1] == ["f32"]:
                return "epilogue"
    inner = []
    called = _CALLS.search(inst.attributes)
    if called:
        computations = set(module.computations_under(called.group(1)))
        inner = [
            i for i in module.instructions.values() if i.computation in computations
        ]
    for i in inner:
        reducer = _TO_APPLY.search(i.attributes) if i.op == "reduce" else None
        root = module.roots.get(reducer.group(1)) if reducer else None
        if root is not None and root.op == "maximum":
            return "amax"
    layout_only = {"parameter", "copy", "transpose", "bitcast", "reshape"}
    if inst.op in ("copy", "transpose") or (
        inner and all(i.op in layout_only for i in inner)
    ):
        return "layout"
    return "other"


def roofline(text: str, device: Device = H100_SXM) -> dict:
    """A time estimate of a compiled GPU program from its kernels: each cuBLAS GEMM
    (and cuDNN flash-attention call, by the FLOPs of its GEMMs: `_attention_flops`)
    at `gemm_efficiency` of the dense peak of the dtype it reads, or its bytes
    (operands and results) at `memory_efficiency` of the bandwidth, whichever is
    slower; every other kernel at its bytes; `launch_s` per kernel in `time_s_with
    _launches`. No caches, no overlap, no autotuning: for ratios between programs
    compiled alike, not for times. Returns GEMM FLOPs by dtype, GEMM bytes,
    non-GEMM bytes by kind (`NON_GEMM_KINDS`), kernels, the two times and the part
    of `time_s` spent in GEMMs, attention calls and convolutions (`gemm_time_s`)."""
    module = _Module(text)
    launching = _launching_computations(module)
    flops = collections.Counter()
    non_gemm = collections.Counter({k: 0 for k in NON_GEMM_KINDS})
    gemm_bytes, time_s, gemm_time_s, kernels = 0, 0.0, 0.0, 0
    for inst in module.instructions.values():
        if inst.computation not in launching or inst.op in _NOT_KERNELS:
            continue
        if inst.op.endswith("-done"):
            continue
        arrays = _arrays(inst.type)
        results = (
            [(d, n) for d, n in arrays if d != "s8"]
            if inst.op == "custom-call"
            else arrays
        )
        nbytes = sum(n * _BYTES.get(_bits(d), 0) for d, n in results)
        for operand in inst.operands:
            source = module.instructions.get(operand)
            if source is not None:
                nbytes += _array_bytes(source.type)
        kernels += 1
        memory_s = nbytes / (device.bandwidth * device.memory_efficiency)
        target = _TARGET.search(inst.attributes) if inst.op == "custom-call" else None
        target = target.group(1) if target else ""
        block_scaled = target == BLOCK_SCALED_DOT
        attention = target.startswith(FUSED_ATTENTION)
        if (
            "cublas" in target
            or target.startswith("__cudnn$conv")
            or block_scaled
            or attention
        ):
            reads = _operand_dtypes(module, inst, 1)
            dtype = (
                "fp4"
                if reads and reads[0] == "f4e2m1fn"
                else "fp8"
                if reads and reads[0] in FP8_TYPES
                else "bf16"
                if reads and reads[0] in ("bf16", "f16")
                else "f32"
            )
            gemm = "cublas" in target or block_scaled
            work = (
                _attention_flops(module, inst, target)
                if attention
                else _gemm_flops(module, inst)
                if gemm
                else 0.0
            )
            flops[dtype] += work
            gemm_bytes += nbytes
            # A GPU with no fp4 GEMM (an H100) could not run one: its CUDA cores.
            peak = device.peak_flops.get(dtype, device.peak_flops["f32"])
            peak *= device.gemm_efficiency
            gemm_time_s += max(work / peak, memory_s)
            time_s += max(work / peak, memory_s)
        else:
            non_gemm[_kind(module, inst)] += nbytes
            time_s += memory_s
    return {
        "gemm_flops": dict(flops),
        "gemm_bytes": gemm_bytes,
        "non_gemm_bytes": dict(non_gemm),
        "kernels": kernels,
        "time_s": time_s,
        "time_s_with_launches": time_s + kernels * device.launch_s,
        "gemm_time_s": gemm_time_s,
    }


def ideal_ratio(roof: dict, base: dict) -> float:
    """What a program whose GEMMs take `roof`'s time and whose other kernels
    `base`'s would take, over `base`'s time (`roofline`s, without launches): the
    most that fp8 GEMMs can give a step that moves no more bytes outside them than
    the bfloat16 one does."""
    return (base["time_s"] - base["gemm_time_s"] + roof["gemm_time_s"]) / base["time_s"]
