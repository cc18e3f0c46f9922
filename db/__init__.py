"""Persistence: the measurement and plan cache (SQLAlchemy 2; SQLite or PostgreSQL).

Imports only `ucudnn.solver.types`, `ucudnn.errors` and the value `ucudnn.problem` (an import
checks that each problem key parses) from the project, never the runtime.
"""

from ucudnn.db.cache import (MERGE_RULE, Cache, MeasurementRecord, MergeCounts, MergeReport,
                             PlanRecord, default_url)
from ucudnn.db.models import SCHEMA_VERSION

__all__ = ["MERGE_RULE", "SCHEMA_VERSION", "Cache", "MeasurementRecord", "MergeCounts",
           "MergeReport", "PlanRecord", "default_url"]
