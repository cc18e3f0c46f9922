"""Persistence: the measurement and plan cache (SQLAlchemy 2; SQLite or PostgreSQL).

Imports only `ucudnn.solver.types`, `ucudnn.errors` and the value `ucudnn.problem` (an import
checks that each problem key parses) from the project, never the runtime.
"""

from ucudnn.db.cache import Cache
from ucudnn.db.location import default_url
from ucudnn.db.merge import MERGE_RULE, MeasurementRecord, MergeCounts, MergeReport, PlanRecord
from ucudnn.db.models import SCHEMA_VERSION

__all__ = [
    "MERGE_RULE",
    "SCHEMA_VERSION",
    "Cache",
    "MeasurementRecord",
    "MergeCounts",
    "MergeReport",
    "PlanRecord",
    "default_url",
]
