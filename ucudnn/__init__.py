"""ucudnn: convolutions that run fast inside a memory budget.

Splits each layer's mini-batch into micro-batches so that faster algorithms fit a workspace limit,
chooses the division optimally (WR per kernel, WD per network), and caches every measurement.

The names below load on first use (PEP 562): `import ucudnn.cli` (the command line, whose `--help` must not
wait for NumPy, SciPy and every layer) then imports only what it runs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Each public name and the module that defines it.
_EXPORTS = {
    "BackendUnavailable": "ucudnn.errors",
    "Configuration": "ucudnn.solver.types",
    "ConvProblem": "ucudnn.problem",
    "Handle": "ucudnn.handle",
    "Infeasible": "ucudnn.solver.types",
    "InvalidInput": "ucudnn.errors",
    "KernelChoice": "ucudnn.handle",
    "LateRegistrationWarning": "ucudnn.handle",
    "MicroConfig": "ucudnn.solver.types",
    "UcudnnError": "ucudnn.errors",
    "UnsupportedProblem": "ucudnn.errors",
    "best_batch_size": "ucudnn.network.cluster",
    "get_backend": "ucudnn.backends",
    "run_configuration": "ucudnn.kernel.run",
}
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

if TYPE_CHECKING:
    from ucudnn.backends import get_backend
    from ucudnn.errors import BackendUnavailable, InvalidInput, UcudnnError, UnsupportedProblem
    from ucudnn.handle import Handle, KernelChoice, LateRegistrationWarning
    from ucudnn.kernel.run import run_configuration
    from ucudnn.network.cluster import best_batch_size
    from ucudnn.problem import ConvProblem
    from ucudnn.solver.types import Configuration, Infeasible, MicroConfig


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ucudnn' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
