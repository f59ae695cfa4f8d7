"""fp8 matmuls with current scaling: operands quantised to float8_e4m3fn, gradients to
float8_e5m2, scales from each tensor's (or row's) absolute maximum.

```python
amp_model = eqx_amp.filter_amp(model, fp8=eqx_amp.fp8.TENSORWISE)       # call boundary
logits = eqx_amp.autocast(model, rules={jax.lax.dot_general_p: eqx_amp.fp8.ROWWISE})(x)
y = eqx_amp.fp8.dot_general(x, w, (((1,), (0,)), ((), ())))            # by hand
```
"""

from ._fp8 import ROWWISE as ROWWISE
from ._fp8 import TENSORWISE as TENSORWISE
from ._fp8 import dot_general as dot_general
