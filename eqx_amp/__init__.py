"""Automatic mixed precision for JAX, native to Equinox."""

import importlib.metadata

from ._autocast._autocast import autocast as autocast
from ._autocast._rules import DEFAULT_RULES as DEFAULT_RULES
from ._autocast._rules import FULL as FULL
from ._autocast._rules import KEEP as KEEP
from ._autocast._rules import LOW as LOW
from ._autocast._rules import PROMOTE as PROMOTE
from ._bimodel import BiModel as BiModel
from ._cast import cast_tree as cast_tree
from ._filter_amp import filter_amp as filter_amp
from ._filter_amp import full_precision as full_precision
from ._filters import default_filter_spec as default_filter_spec
from ._filters import keep as keep
from ._fp8 import FP8 as FP8
from ._fp8 import FP8_ROWWISE as FP8_ROWWISE
from ._fp8 import fp8_dot_general as fp8_dot_general
from ._grad import filter_grad as filter_grad
from ._grad import filter_value_and_grad as filter_value_and_grad
from ._jaxpr._compat import warn_if_untested as _warn_if_untested
from ._loss_scale import AbstractLossScale as AbstractLossScale
from ._loss_scale import DynamicLossScale as DynamicLossScale
from ._loss_scale import NoOpLossScale as NoOpLossScale
from ._loss_scale import StaticLossScale as StaticLossScale
from ._loss_scale import all_finite as all_finite
from ._loss_scale import select_tree as select_tree
from ._loss_scaling import LossScalingState as LossScalingState
from ._loss_scaling import loss_scaling as loss_scaling
from ._loss_scaling import scaled_value_and_grad as scaled_value_and_grad
from ._moments import LowPrecisionMomentsState as LowPrecisionMomentsState
from ._moments import QuantizedMoment as QuantizedMoment
from ._moments import low_precision_moments as low_precision_moments
from ._optimizers import KahanSummationState as KahanSummationState
from ._optimizers import MasterWeights as MasterWeights
from ._optimizers import MasterWeightsState as MasterWeightsState
from ._optimizers import StochasticRoundingState as StochasticRoundingState
from ._optimizers import kahan_summation as kahan_summation
from ._optimizers import master_weights as master_weights
from ._optimizers import stochastic_rounding as stochastic_rounding
from ._policy import Policy as Policy
from ._policy import default_policy as default_policy
from ._policy import get_policy as get_policy
from ._policy import using_policy as using_policy
from ._report import NonfiniteOp as NonfiniteOp
from ._report import PrecisionReport as PrecisionReport
from ._report import find_nonfinite as find_nonfinite
from ._report import precision_report as precision_report
from ._sharding import gather_params as gather_params
from ._updates import apply_updates as apply_updates


_warn_if_untested()

try:
    __version__ = importlib.metadata.version("eqx_amp")
except importlib.metadata.PackageNotFoundError:  # a source checkout, not installed
    __version__ = "0+unknown"
