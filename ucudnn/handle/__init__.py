"""`Handle`: what a framework holds instead of a cuDNN handle (see `ucudnn.handle.handle`).

The handle's parts, each its own module: `arguments` (checking a call, inferring its shapes),
`calls` (the kernel calls and their lookup), `planning` (WR and WD plans), `arena` (where each kernel's
workspace lives), `kernel` (the prepared kernel and its launch, the hot path), `replan` (a plan that cannot
run, planned again), `trials` (a plan against torch's own convolution inside the caller's step); `handle`
ties them together.
"""

from ucudnn.handle.arena import SEGMENT_ALIGN_BYTES

# `_rebuild_handle` here too: handles pickled before this was a package name it at ucudnn.handle
from ucudnn.handle.handle import Handle, KernelChoice, LateRegistrationWarning, _rebuild_handle  # noqa: F401
from ucudnn.handle.kernel import Kernel, Turns, native_only  # noqa: F401
from ucudnn.handle.replan import PlanFailureWarning

__all__ = ["SEGMENT_ALIGN_BYTES", "Handle", "Kernel", "KernelChoice", "LateRegistrationWarning", "PlanFailureWarning"]
