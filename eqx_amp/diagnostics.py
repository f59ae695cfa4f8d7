"""What ran in which dtype, and which op overflowed.

```python
print(eqx_amp.diagnostics.precision_report(amp_model, x))
print(eqx_amp.diagnostics.find_nonfinite(loss_fn, model, x, y))
```

`precision_report` and `find_nonfinite` are also at `eqx_amp.*`; the types of what
they return live here.
"""

from ._diagnostics._nonfinite import NonfiniteOp as NonfiniteOp
from ._diagnostics._nonfinite import find_nonfinite as find_nonfinite
from ._diagnostics._report import PrecisionReport as PrecisionReport
from ._diagnostics._report import WideMatmul as WideMatmul
from ._diagnostics._report import precision_report as precision_report
