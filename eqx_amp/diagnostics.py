"""What ran in which dtype, which op overflowed, and what each layer's tensors
look like in half precision inside the training step.

```python
print(eqx_amp.diagnostics.precision_report(amp_model, x))
print(eqx_amp.diagnostics.find_nonfinite(loss_fn, model, x, y))
outputs, stats = eqx.filter_jit(eqx_amp.diagnostics.telemetry(train_step))(model, x)
```

`precision_report` and `find_nonfinite` are also at `eqx_amp.*`; the types of what
they return live here.
"""

from ._diagnostics._first_call import CoverageWarning as CoverageWarning
from ._diagnostics._first_call import check_coverage as check_coverage
from ._diagnostics._nonfinite import NonfiniteOp as NonfiniteOp
from ._diagnostics._nonfinite import find_nonfinite as find_nonfinite
from ._diagnostics._report import PrecisionReport as PrecisionReport
from ._diagnostics._report import WideMatmul as WideMatmul
from ._diagnostics._report import precision_report as precision_report
from ._diagnostics._telemetry import Telemetry as Telemetry
from ._diagnostics._telemetry import TensorRow as TensorRow
from ._diagnostics._telemetry import TensorStats as TensorStats
from ._diagnostics._telemetry import telemetry as telemetry
