"""fp8 matmuls with current scaling: operands quantised to float8_e4m3fn, gradients to
float8_e5m2, scales from each tensor's (or row's) absolute maximum; or block-scaled
(MXFP8: e4m3 values and gradients, a power-of-two scale per 32 values along the
contracting dimension, applied inside the GEMM: Blackwell's format); or NVFP4
forward products (e2m1 values, an e4m3 scale per 16 and a float32 one per tensor)
with MXFP8 backward ones, or NVFP4 backward ones too (NVIDIA's training recipe).

```python
amp_model = eqx_amp.filter_amp(model, fp8=eqx_amp.fp8.TENSORWISE)       # call boundary
logits = eqx_amp.autocast(model, rules={jax.lax.dot_general_p: eqx_amp.fp8.ROWWISE})(x)
y = eqx_amp.fp8.dot_general(x, w, (((1,), (0,)), ((), ())))            # by hand
amp_model = eqx_amp.filter_amp(model, fp8=eqx_amp.fp8.MXFP8)            # block-scaled
amp_model = eqx_amp.filter_amp(model, fp8=eqx_amp.fp8.NVFP4)            # 4-bit forward
amp_model = eqx_amp.filter_amp(model, fp8=eqx_amp.fp8.NVFP4.with_nvfp4_backward())
scaling = eqx_amp.fp8.DelayedScaling.init(loss_fn, model, x, y)    # delayed scaling
with eqx_amp.fp8.delayed(scaling): ...                               # its scales
```
"""

from ._fp8 import MXFP8 as MXFP8
from ._fp8 import NVFP4 as NVFP4
from ._fp8 import ROWWISE as ROWWISE
from ._fp8 import TENSORWISE as TENSORWISE
from ._fp8 import DelayedScaling as DelayedScaling
from ._fp8 import delayed as delayed
from ._fp8 import dot_general as dot_general
