"""Automatic mixed precision for JAX, native to Equinox.

The everyday names are here, autocast's rules (`LOW`, `FULL`, `PROMOTE`, `KEEP`,
`DEFAULT_RULES`) among them; the specialist ones live in sub-namespaces:
`eqx_amp.fp8` (fp8 matmuls), `eqx_amp.optim` (optimizer-state precision),
`eqx_amp.sharding` (multi-device helpers) and `eqx_amp.diagnostics` (the types of
the reports).
"""

import importlib.metadata as _metadata

from . import diagnostics as diagnostics
from . import fp8 as fp8
from . import optim as optim
from . import sharding as sharding
from ._autocast._autocast import autocast as autocast
from ._autocast._rules import DEFAULT_RULES as DEFAULT_RULES
from ._autocast._rules import FULL as FULL
from ._autocast._rules import KEEP as KEEP
from ._autocast._rules import LOW as LOW
from ._autocast._rules import PROMOTE as PROMOTE
from ._bimodel import BiModel as BiModel
from ._core._cast import cast_tree as cast_tree
from ._core._filters import default_filter_spec as default_filter_spec
from ._core._filters import keep as keep
from ._core._policy import Policy as Policy
from ._core._policy import default_policy as default_policy
from ._core._policy import get_policy as get_policy
from ._core._policy import using_policy as using_policy
from ._diagnostics._first_call import check_coverage as _check_coverage
from ._diagnostics._nonfinite import find_nonfinite as find_nonfinite
from ._diagnostics._report import precision_report as precision_report
from ._filter_amp._filter_amp import filter_amp as filter_amp
from ._filter_amp._filter_amp import full_precision as full_precision
from ._jaxpr._compat import warn_if_untested as _warn_if_untested
from ._loss_scaling._grad import filter_grad as filter_grad
from ._loss_scaling._grad import filter_value_and_grad as filter_value_and_grad
from ._loss_scaling._scales import AbstractLossScale as AbstractLossScale
from ._loss_scaling._scales import DynamicLossScale as DynamicLossScale
from ._loss_scaling._scales import NoOpLossScale as NoOpLossScale
from ._loss_scaling._scales import StaticLossScale as StaticLossScale
from ._loss_scaling._short_form import loss_scaling as loss_scaling
from ._loss_scaling._short_form import scaled_grad as scaled_grad
from ._loss_scaling._short_form import scaled_value_and_grad as scaled_value_and_grad
from ._loss_scaling._skipping import all_finite as all_finite
from ._loss_scaling._skipping import select_tree as select_tree


_warn_if_untested()
# `filter_amp` warns of low coverage through the check the diagnostics register
# here: its own modules may not import them.
_check_coverage(True)

try:
    __version__ = _metadata.version("eqx_amp")
except _metadata.PackageNotFoundError:  # a source checkout, not installed
    __version__ = "0+unknown"
