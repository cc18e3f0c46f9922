"""Pure math on measurement tables: WR (per kernel), Pareto fronts and WD (per network), clusters.

NumPy and SciPy only; no I/O and no backends.
"""

from ucudnn.solver.types import Configuration, Infeasible, MicroConfig

__all__ = ["Configuration", "Infeasible", "MicroConfig"]
