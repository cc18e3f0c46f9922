"""PyTorch integration: `Conv2d` (a drop-in for `torch.nn.Conv2d`), `convert(model)` and `announce`.

Submodules: `conv` (the drop-in). This package imports torch; ``import ucudnn`` does not import it.
"""

from ucudnn.torch.conv import Conv2d, announce, convert

__all__ = ["Conv2d", "announce", "convert"]
