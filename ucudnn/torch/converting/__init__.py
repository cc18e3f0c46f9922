"""Converting convolutions: ucudnn's drop-ins for torch's convolution modules, and how they run.

`conv` (the six drop-in modules and `convert(model)`), `layer` (`ConvLayer`: a converted module's routes to its
planned kernels), `ops` (those kernels as torch.library operators, for torch.compile and torch.export) and
`launch` (a planned kernel run on torch tensors). The bottom room: it imports no other room.
"""
