"""Running a memory plan in training: `executor` (`execute_plan`), `prepared_plan` (what the executor prepares
once per model and plan), `offload` (host copies and prefetches through saved-tensor hooks), `recompute`
(dropped storages rebuilt in the backward pass), `stats` (what a run did: `ExecutionStats`) and `labels` (the
category a storage allocated now counts under, for a memory tracker). Imports converting and capturing.
"""
