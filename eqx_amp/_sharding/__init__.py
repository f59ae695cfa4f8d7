"""Beyond one device: the dtype gradients are reduced in, under both of JAX's engines.

Under `jax.jit` with sharded arrays (GSPMD), the partitioner sums a weight gradient
across devices right where it is made: on the output of the matmul that computes
it. So the reduction dtype is the dtype that matmul emits, and choosing it means
binding the matmul so that its transpose for the weight emits
`Policy.reduce_dtype` (`_reduce`). Under `jax.shard_map` FSDP the reduction is the
reduce-scatter that transposes the gather of the parameters, so `gather_params`
casts before it gathers and reduces in the chosen dtype (`_fsdp`).
"""

from ._fsdp import gather_params as gather_params
from ._fsdp import recording_gathers as recording_gathers
from ._reduce import (
    ReduceInHook as ReduceInHook,
)
from ._reduce import (
    bind_reducing_gradients as bind_reducing_gradients,
)
from ._reduce import (
    reduced_operands as reduced_operands,
)
from ._reduce import (
    warn_if_batched_after_tracing as warn_if_batched_after_tracing,
)
