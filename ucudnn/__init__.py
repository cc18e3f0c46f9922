"""ucudnn: convolutions that run fast inside a memory budget.

Splits each layer's mini-batch into micro-batches so that faster algorithms fit a workspace limit,
chooses the division optimally (WR per kernel, WD per network), and caches every measurement.
"""

from ucudnn.backends import get_backend
from ucudnn.errors import BackendUnavailable, InvalidInput, UcudnnError, UnsupportedProblem
from ucudnn.handle import Handle, KernelChoice, LateRegistrationWarning
from ucudnn.kernel.run import run_configuration
from ucudnn.network.cluster import best_batch_size
from ucudnn.problem import ConvProblem
from ucudnn.solver.types import Configuration, Infeasible, MicroConfig

__all__ = [
    "BackendUnavailable",
    "Configuration",
    "ConvProblem",
    "Handle",
    "Infeasible",
    "InvalidInput",
    "KernelChoice",
    "LateRegistrationWarning",
    "MicroConfig",
    "UcudnnError",
    "UnsupportedProblem",
    "best_batch_size",
    "get_backend",
    "run_configuration",
]
