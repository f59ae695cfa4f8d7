"""fp8 matmuls with current scaling: no state, scales from each tensor's own amax.

The forward operands are quantised to `float8_e4m3fn` and the backward pass's output
gradient to `float8_e5m2` (more range, less precision: gradients need it), each
with a float32 scale computed from the tensor's absolute maximum right before use
("current" scaling; delayed scaling keeps a history of amaxes in state, which goes
stale). The matmul multiplies the fp8 arrays themselves (what XLA makes an fp8
GEMM of on GPUs that have one), accumulates in float32 and applies the scales to
its output; so do the backward products, forward-scaled rowwise ones included.
Convolutions are fp8 forward only: cuDNN has no fp8 backward convolution, so those
read bfloat16 copies of the fp8 values (exact) and `precision_report` says so.
Derivatives come from `jax.custom_vjp`, so the backward pass is exactly the one
written here, and differentiating it again is refused.

`MXFP8` products are block-scaled instead: e4m3 values and gradients with one
power-of-two scale per 32 values along each product's contracting dimension,
applied inside the GEMM (`_block_scaled`); `NVFP4` ones quantise the forward
operands to 4 bits with an e4m3 scale per 16 values and one per tensor (`_nvfp4`),
their backward products are MXFP8, or NVFP4 by NVIDIA's recipe (`_block_scaled.
nvfp4_matmul`: 16 x 16 weight tiles, stochastic rounding, Hadamard rotations).

The layers: `_scaling` (scales from amaxes), `_products` (the fp8 matmul and
convolution with their derivative rules), `_block_scaled` (the MXFP8 and NVFP4 matmuls
and their derivative rules), `_nvfp4` (NVFP4 quantisation), `_shapes` (which shapes an fp8 kernel takes, and which pay),
`_rules` (where products run in fp8), `_dot_general` (one fp8 product, by hand).
"""

from ._block_scaled import MXFP8_SCOPE as MXFP8_SCOPE
from ._block_scaled import block_scaled_flops as block_scaled_flops
from ._block_scaled import is_block_product as is_block_product
from ._delayed import DelayedScaling as DelayedScaling
from ._delayed import delayed as delayed
from ._dot_general import dot_general as dot_general
from ._nvfp4 import NVFP4_SCALES_SCOPE as NVFP4_SCALES_SCOPE
from ._nvfp4 import NVFP4_SCOPE as NVFP4_SCOPE
from ._products import FP8_SCOPE as FP8_SCOPE
from ._products import FP8_SKIPPED_SCOPE as FP8_SKIPPED_SCOPE
from ._products import holding_fp8_values as holding_fp8_values
from ._products import known_fp8 as known_fp8
from ._products import remember_fp8 as remember_fp8
from ._rules import MXFP8 as MXFP8
from ._rules import NVFP4 as NVFP4
from ._rules import ROWWISE as ROWWISE
from ._rules import TENSORWISE as TENSORWISE
from ._rules import Fp8Product as Fp8Product
from ._rules import Fp8Rule as Fp8Rule
from ._rules import product_in_fp8 as product_in_fp8
from ._rules import traced_per_example as traced_per_example
from ._rules import weight_operand as weight_operand
from ._shapes import FP8_PRIMITIVES as FP8_PRIMITIVES
from ._weights import quantize_weights_once as quantize_weights_once
