"""One kernel at a time: measuring it at micro-batch sizes (`measure`), running a configuration as
micro-batches (`run`), whether the machine can run it at all (`resources`), the caller's per-call charge
(`call_overhead`) and the correctness suite (`selftest`). Below the handle; above the backends."""
