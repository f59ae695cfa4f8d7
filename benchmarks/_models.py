"""The benchmark models, their presets and their synthetic data.

Two plain float32 Equinox models, written the way a user would write them (no
knowledge of mixed precision inside):

- `GPT`: token embedding + learned positions, `depth` pre-norm blocks (LayerNorm,
  causal `eqx.nn.MultiheadAttention`, LayerNorm, GELU MLP), final LayerNorm and an
  unbiased head. Called on one sequence of token ids; `jax.vmap` adds the batch.
- `Llama`: a Llama-style decoder: token embedding, `depth` pre-norm blocks (RMSNorm,
  causal `eqx.nn.MultiheadAttention` without biases, RMSNorm, SwiGLU MLP), final
  RMSNorm and an unbiased head. No rotary embedding (it adds elementwise work only,
  the same in every variant). Its presets follow Llama-3-8B's block (d_model 4096,
  32 heads, SwiGLU 14336) with 2 blocks and a small vocabulary: the shape at which
  fp8 products pay most.

Both take `attention="cudnn"` (`--config attention=cudnn`): attention with the same
projections by `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's flash
attention, which never writes the attention matrices (how such models are trained on
GPUs; it compiles only for a GPU).
- `CNN`: a ResNet-ish stack of `Conv2d` + `GroupNorm` + ReLU blocks (a stride-2
  block starts each stage, residual blocks follow), global mean pooling and a linear
  head. Called on one `(channels, height, width)` image.

The data are a few fixed random batches that every variant sees in the same order,
so the loss after K steps (the model memorising them) is comparable across variants.
"""

import dataclasses
import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray


#
# GPT.
#


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear
    flash: bool = eqx.field(static=True)

    def __init__(self, width: int, heads: int, *, flash: bool, key: PRNGKeyArray):
        k1, k2, k3 = jr.split(key, 3)
        self.flash = flash
        self.norm1 = eqx.nn.LayerNorm(width)
        self.attention = eqx.nn.MultiheadAttention(heads, width, key=k1)
        self.norm2 = eqx.nn.LayerNorm(width)
        self.mlp_in = eqx.nn.Linear(width, 4 * width, key=k2)
        self.mlp_out = eqx.nn.Linear(4 * width, width, key=k3)

    def __call__(self, x: Float[Array, "seq width"]) -> Float[Array, "seq width"]:
        attend = flash_causal_attention if self.flash else causal_attention
        x = x + attend(self.norm1, self.attention, x)
        y = jax.vmap(self.norm2)(x)
        y = jax.vmap(self.mlp_out)(jax.nn.gelu(jax.vmap(self.mlp_in)(y)))
        return x + y


def causal_attention(norm, attention, x: Float[Array, "seq width"]) -> Array:
    """Pre-norm causal self-attention (the residual is the caller's)."""
    seq = x.shape[0]
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    y = jax.vmap(norm)(x)
    return attention(y, y, y, mask=causal)


def flash_causal_attention(
    norm, attention: eqx.nn.MultiheadAttention, x: Float[Array, "seq width"]
) -> Array:
    """`causal_attention` with the same weights, the attention itself by cuDNN's
    fused kernel. The kernel takes half precision only, so a float32 caller's
    queries, keys and values go in as bfloat16 (as a model written for it casts
    them); a mixed-precision step's already are."""
    y = jax.vmap(norm)(x)

    def heads(linear):
        out = jax.vmap(linear)(y).reshape(x.shape[0], attention.num_heads, -1)
        half = out.dtype in (jnp.bfloat16, jnp.float16)
        return out if half else out.astype(jnp.bfloat16)

    out = jax.nn.dot_product_attention(
        heads(attention.query_proj),
        heads(attention.key_proj),
        heads(attention.value_proj),
        is_causal=True,
        implementation="cudnn",
    )
    out = out.astype(y.dtype).reshape(x.shape[0], -1)
    return jax.vmap(attention.output_proj)(out)


class GPT(eqx.Module):
    embed: eqx.nn.Embedding
    positions: Float[Array, "seq width"]
    blocks: list[Block]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(
        self,
        vocab: int,
        width: int,
        depth: int,
        heads: int,
        seq: int,
        *,
        flash: bool = False,
        key,
    ):
        keys = jr.split(key, depth + 3)
        self.embed = eqx.nn.Embedding(vocab, width, key=keys[0])
        self.positions = 0.02 * jr.normal(keys[1], (seq, width))
        self.blocks = [Block(width, heads, flash=flash, key=k) for k in keys[2:-1]]
        self.norm = eqx.nn.LayerNorm(width)
        self.head = eqx.nn.Linear(width, vocab, use_bias=False, key=keys[-1])

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = jax.vmap(self.embed)(tokens) + self.positions
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


#
# Llama-style decoder.
#


class LlamaBlock(eqx.Module):
    norm1: eqx.nn.RMSNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.RMSNorm
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    flash: bool = eqx.field(static=True)

    def __init__(
        self, width: int, heads: int, hidden: int, *, flash: bool, key: PRNGKeyArray
    ):
        k1, k2, k3, k4 = jr.split(key, 4)
        self.flash = flash
        self.norm1 = eqx.nn.RMSNorm(width)
        self.attention = eqx.nn.MultiheadAttention(heads, width, key=k1)
        self.norm2 = eqx.nn.RMSNorm(width)
        self.gate = eqx.nn.Linear(width, hidden, use_bias=False, key=k2)
        self.up = eqx.nn.Linear(width, hidden, use_bias=False, key=k3)
        self.down = eqx.nn.Linear(hidden, width, use_bias=False, key=k4)

    def __call__(self, x: Float[Array, "seq width"]) -> Float[Array, "seq width"]:
        attend = flash_causal_attention if self.flash else causal_attention
        x = x + attend(self.norm1, self.attention, x)
        y = jax.vmap(self.norm2)(x)
        swiglu = jax.nn.silu(jax.vmap(self.gate)(y)) * jax.vmap(self.up)(y)
        return x + jax.vmap(self.down)(swiglu)


class Llama(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list[LlamaBlock]
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear

    def __init__(
        self,
        vocab: int,
        width: int,
        depth: int,
        heads: int,
        hidden: int,
        *,
        flash: bool = False,
        key,
    ):
        keys = jr.split(key, depth + 2)
        self.embed = eqx.nn.Embedding(vocab, width, key=keys[0])
        self.blocks = [
            LlamaBlock(width, heads, hidden, flash=flash, key=k) for k in keys[1:-1]
        ]
        self.norm = eqx.nn.RMSNorm(width)
        self.head = eqx.nn.Linear(width, vocab, use_bias=False, key=keys[-1])

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


#
# CNN.
#


class ConvBlock(eqx.Module):
    conv1: eqx.nn.Conv2d
    norm1: eqx.nn.GroupNorm
    conv2: eqx.nn.Conv2d
    norm2: eqx.nn.GroupNorm
    shortcut: eqx.nn.Conv2d | None

    def __init__(self, c_in: int, c_out: int, stride: int, groups: int, *, key):
        k1, k2, k3 = jr.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, key=k1)
        self.norm1 = eqx.nn.GroupNorm(groups, c_out)
        self.conv2 = eqx.nn.Conv2d(c_out, c_out, 3, padding=1, key=k2)
        self.norm2 = eqx.nn.GroupNorm(groups, c_out)
        if stride != 1 or c_in != c_out:
            self.shortcut = eqx.nn.Conv2d(c_in, c_out, 1, stride=stride, key=k3)
        else:
            self.shortcut = None

    def __call__(self, x: Float[Array, "c h w"]) -> Float[Array, "c2 h2 w2"]:
        y = jax.nn.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        skip = x if self.shortcut is None else self.shortcut(x)
        return jax.nn.relu(y + skip)


class CNN(eqx.Module):
    stem: eqx.nn.Conv2d
    stem_norm: eqx.nn.GroupNorm
    blocks: list[ConvBlock]
    head: eqx.nn.Linear

    def __init__(
        self,
        channels: int,
        widths: tuple[int, ...],
        blocks_per_stage: int,
        classes: int,
        groups: int,
        *,
        key,
    ):
        keys = iter(jr.split(key, 2 + len(widths) * blocks_per_stage))
        self.stem = eqx.nn.Conv2d(channels, widths[0], 3, padding=1, key=next(keys))
        self.stem_norm = eqx.nn.GroupNorm(groups, widths[0])
        blocks = []
        c_in = widths[0]
        for i, width in enumerate(widths):
            for j in range(blocks_per_stage):
                stride = 2 if (j == 0 and i > 0) else 1
                blocks.append(ConvBlock(c_in, width, stride, groups, key=next(keys)))
                c_in = width
        self.blocks = blocks
        self.head = eqx.nn.Linear(c_in, classes, key=next(keys))

    def __call__(self, image: Float[Array, "c h w"]) -> Float[Array, " classes"]:
        x = jax.nn.relu(self.stem_norm(self.stem(image)))
        for block in self.blocks:
            x = block(x)
        return self.head(jnp.mean(x, axis=(1, 2)))


#
# Presets and tasks.
#


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int
    width: int
    depth: int
    heads: int
    seq: int
    batch: int
    attention: str = "equinox"  # or "cudnn", as `LlamaConfig.attention`

    def describe(self) -> str:
        return (
            f"GPT: {self.depth} blocks, width {self.width}, {self.heads} heads, "
            f"seq {self.seq}, batch {self.batch}, vocab {self.vocab}"
            + (", cuDNN flash attention" if self.attention == "cudnn" else "")
        )


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab: int
    width: int
    depth: int
    heads: int
    hidden: int
    seq: int
    batch: int
    # "equinox": `eqx.nn.MultiheadAttention`, which writes the attention matrices;
    # "cudnn": cuDNN's flash attention (`flash_causal_attention`; GPU compiles only).
    attention: str = "equinox"

    def describe(self) -> str:
        return (
            f"Llama-style: {self.depth} blocks, width {self.width}, {self.heads} heads, "
            f"SwiGLU {self.hidden}, seq {self.seq}, batch {self.batch}, "
            f"vocab {self.vocab}"
            + (", cuDNN flash attention" if self.attention == "cudnn" else "")
        )


@dataclasses.dataclass(frozen=True)
class CNNConfig:
    image: int
    channels: int
    widths: tuple[int, ...]
    blocks_per_stage: int
    classes: int
    groups: int
    batch: int

    def describe(self) -> str:
        return (
            f"CNN: widths {'/'.join(map(str, self.widths))} x {self.blocks_per_stage} "
            f"residual blocks, GroupNorm({self.groups}), {self.channels}x{self.image}"
            f"x{self.image} images, batch {self.batch}, {self.classes} classes"
        )


PRESETS = {
    # The smoke test: seconds per variant.
    "tiny": {
        "gpt": GPTConfig(vocab=64, width=32, depth=1, heads=2, seq=16, batch=2),
        "cnn": CNNConfig(8, 3, (8,), 1, 10, 4, batch=2),
        "llama": LlamaConfig(
            vocab=64, width=32, depth=1, heads=2, hidden=64, seq=16, batch=2
        ),
    },
    # A whole run in a few minutes on 2 CPU cores.
    "cpu": {
        "gpt": GPTConfig(vocab=256, width=128, depth=2, heads=4, seq=64, batch=8),
        "cnn": CNNConfig(16, 3, (16, 32), 1, 10, 8, batch=16),
        "llama": LlamaConfig(
            vocab=256, width=128, depth=2, heads=4, hidden=352, seq=64, batch=4
        ),
    },
    # GPT-2 small (vocab 32k) at seq 1024 and a ResNet-18-like CNN at 64x64: meant
    # for one large GPU (sized for an H200; `eqx.nn.MultiheadAttention` materialises
    # the attention matrices, tens of GB in float32 for the GPT).
    "gpu": {
        "gpt": GPTConfig(
            vocab=32768, width=768, depth=12, heads=12, seq=1024, batch=16
        ),
        "cnn": CNNConfig(64, 3, (64, 128, 256, 512), 2, 1000, 32, batch=128),
        # Llama-3-8B's block, twice, at seq 4096: large products, where fp8 pays.
        "llama": LlamaConfig(
            vocab=4096, width=4096, depth=2, heads=32, hidden=14336, seq=4096, batch=1
        ),
    },
}


def with_overrides(config, spec: str):
    """`config` with the fields `spec` names (`"depth=4,batch=8"`,
    `"attention=cudnn"`) replaced."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    changes = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, _, value = part.partition("=")
        textual = key in fields and fields[key].type in (str, "str")
        if key not in fields or not (value and (textual or value.isdigit())):
            raise SystemExit(
                f"--config: expected NAME=VALUE (an integer but for 'attention') "
                f"with NAME one of {', '.join(sorted(fields))}; got {part!r}"
            )
        changes[key] = value if textual else int(value)
    return dataclasses.replace(config, **changes)


# Adam's learning rate and how many distinct batches are cycled through.
LEARNING_RATE = 1e-3
NUM_BATCHES = 4


@dataclasses.dataclass
class Task:
    """A model, its data, and the float32 loss every variant optimises."""

    name: str
    description: str
    model: eqx.Module
    # Each batch is `(inputs, labels)`: tokens `(B, seq)` and next tokens `(B, seq)`
    # for the GPT, images `(B, C, H, W)` and classes `(B,)` for the CNN.
    batches: list[tuple[Array, Array]]
    optimizer: optax.GradientTransformation = dataclasses.field(
        default_factory=lambda: optax.adam(LEARNING_RATE)
    )

    def batch(self, step: int) -> tuple[Array, Array]:
        return self.batches[step % len(self.batches)]


def cross_entropy(logits: Array, labels: Array) -> Array:
    """Mean cross entropy in float32, whatever dtype the logits arrive in."""
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_task(name: str, config, *, seed: int = 0) -> Task:
    key_model, key_data = jr.split(jr.key(seed))
    keys = jr.split(key_data, NUM_BATCHES)
    if name in ("gpt", "llama"):
        if config.attention not in ("equinox", "cudnn"):
            raise SystemExit(
                f"--config: attention is 'equinox' or 'cudnn'; got {config.attention!r}"
            )
        if name == "gpt":
            model = GPT(
                config.vocab, config.width, config.depth, config.heads, config.seq,
                flash=config.attention == "cudnn", key=key_model,
            )  # fmt: skip
        else:
            model = Llama(
                config.vocab, config.width, config.depth, config.heads, config.hidden,
                flash=config.attention == "cudnn", key=key_model,
            )  # fmt: skip
        batches = []
        for k in keys:
            seqs = jr.randint(k, (config.batch, config.seq + 1), 0, config.vocab)
            batches.append((seqs[:, :-1], seqs[:, 1:]))
    elif name == "cnn":
        model = CNN(
            config.channels, config.widths, config.blocks_per_stage, config.classes,
            config.groups, key=key_model,
        )  # fmt: skip
        batches = []
        for k in keys:
            k1, k2 = jr.split(k)
            shape = (config.batch, config.channels, config.image, config.image)
            batches.append(
                (
                    jr.normal(k1, shape),
                    jr.randint(k2, (config.batch,), 0, config.classes),
                )
            )
    else:
        raise ValueError(f"unknown model {name!r}; expected 'gpt', 'llama' or 'cnn'")
    return Task(name, config.describe(), model, batches)


def count_params(model: eqx.Module) -> int:
    leaves = jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_inexact_array))
    return sum(math.prod(x.shape) for x in leaves)


NORM_TYPES = (eqx.nn.LayerNorm, eqx.nn.GroupNorm, eqx.nn.RMSNorm, eqx.nn.BatchNorm)


def is_norm(x) -> bool:
    return isinstance(x, NORM_TYPES)


def replace_norms(model: eqx.Module, wrap: Callable[[eqx.Module], eqx.Module]):
    """`model` with every normalisation layer `n` replaced by `wrap(n)`, by
    `eqx.tree_at`."""
    norms = [x for x in jax.tree_util.tree_leaves(model, is_leaf=is_norm) if is_norm(x)]
    if not norms:
        return model

    def where(m):
        return [x for x in jax.tree_util.tree_leaves(m, is_leaf=is_norm) if is_norm(x)]

    return eqx.tree_at(where, model, replace_fn=wrap)
