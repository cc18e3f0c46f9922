"""Capturing a training step: what the planner and the executor know of a model that runs.

`capture` (one step recorded as PyTorch runs it: forward, loss, backward), `graph` (what it recorded, as the
planner's `TrainingGraph` and the executor's `CapturedStep` operations), `operations` (ATen operations as a
capture reads them), `model_call` (a model's call: its arguments, output tensors and default loss) and
`same_step` (whether a later step is the captured one, beside what watches it). Imports converting only.
"""
