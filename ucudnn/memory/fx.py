"""A PyTorch model's training graph, through `torch.fx`: each fx node that makes a tensor becomes an op.

`torch.fx.symbolic_trace` gives the nodes and `ShapeProp` runs the example input through them for
every node's shape. Each node is mapped to an op type by what it calls (a module's class, a
function, a method); a feature map is named after its node (``layer1_0_conv1``). Views (flatten,
reshape) and in-place calls (``nn.ReLU(inplace=True)``, ``out += identity``, ``relu_``) write into
their input's storage. A loss op named ``loss`` closes the graph, as in the zoo.
"""

from __future__ import annotations

import contextlib
import math
import operator

from ucudnn.errors import UnsupportedProblem
from ucudnn.memory.ops import DTYPE_BYTES, Op, OpBuilder
from ucudnn.problem import ConvProblem


def _conv_problem(module, shape: tuple[int, ...]) -> ConvProblem:
    n, c, h, w = shape
    if isinstance(module.padding, str):
        raise UnsupportedProblem(f"conv with padding={module.padding!r}: give the padding as numbers")
    return ConvProblem(n=n, c=c, h=h, w=w, k=module.out_channels, r=module.kernel_size[0], s=module.kernel_size[1],
                       pad_h=module.padding[0], pad_w=module.padding[1], stride_h=module.stride[0],
                       stride_w=module.stride[1], dilation_h=module.dilation[0], dilation_w=module.dilation[1],
                       groups=module.groups)


def trace_model(model, example_input) -> list:
    """The ops of `model` run on `example_input`, in fx node order (see `ucudnn.memory.graph.trace`)."""
    with plain_convs(model):
        return _trace(model, example_input)


@contextlib.contextmanager
def plain_convs(model):
    """ucudnn's own Conv2d (ucudnn.torch, which this layer does not import) has Python branches fx
    cannot trace, and would plan its kernels on a shape pass's tensors: inside this block it is the
    nn.Conv2d it derives from."""
    from torch import nn

    converted = [(m, type(m)) for m in model.modules()
                 if isinstance(m, nn.Conv2d) and type(m).__module__.startswith("ucudnn.")]
    try:
        for m, _ in converted:
            m.__class__ = nn.Conv2d
        yield
    finally:
        for m, cls in converted:
            m.__class__ = cls


def _trace(model, example_input) -> list:
    import torch
    from torch import fx, nn
    from torch.nn import functional as F
    from torch.fx.passes.shape_prop import ShapeProp

    try:
        gm = fx.symbolic_trace(model)
    except Exception as exc:  # fx raises many kinds (TraceError, TypeError on data-dependent control flow)
        raise UnsupportedProblem(f"torch.fx cannot trace {type(model).__name__}: {exc}") from None
    # Shapes from fake tensors: the real forward pass costs as much as a training step's forward
    # (seconds for a large batch on a CPU) and computes nothing used here. A model whose Python
    # (a hook, say) needs real values gets the real pass.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.no_grad():
        try:
            fake = FakeTensorMode(allow_non_fake_inputs=True)
            ShapeProp(gm, fake_mode=fake).propagate(fake.from_tensor(example_input))
        except Exception:  # noqa: BLE001 - any failure of the fake pass: the real one decides
            ShapeProp(gm).propagate(example_input)
    modules = dict(gm.named_modules())
    b = OpBuilder(int(example_input.shape[0]))
    names: dict[str, str] = {}  # fx node -> the op holding its value (a no-op node maps to its input)
    last = None

    def shape_of(node) -> tuple[int, ...] | None:
        meta = node.meta.get("tensor_meta")
        return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None

    def tensor_args(node) -> list[str]:
        found: list[str] = []

        def visit(a) -> None:
            if isinstance(a, fx.Node):
                if a.name in names:
                    found.append(names[a.name])
            elif isinstance(a, (list, tuple)):
                for item in a:
                    visit(item)
            elif isinstance(a, dict):  # a model may return a dict of outputs
                for item in a.values():
                    visit(item)
        visit(node.args)
        visit(tuple(node.kwargs.values()))
        return found

    for node in gm.graph.nodes:
        shape = shape_of(node)
        if node.op == "placeholder":
            if shape is not None:
                names[node.name] = b.input(node.name, shape)
                last = node.name
            continue
        if node.op == "output":
            out = tensor_args(node)
            if out:
                b.loss(*dict.fromkeys(out))  # every tensor the model returns: the loss may read each
            continue
        if shape is None or node.op == "get_attr":
            continue  # sizes, attributes and other non-tensors hold no memory
        inputs = tensor_args(node)
        if not inputs:
            continue
        x = inputs[0]
        name = node.name
        target = node.target
        if node.op == "call_module":
            m = modules[target]
            if isinstance(m, nn.Conv2d):
                names[name] = b.conv(name, x, _conv_problem(m, b.shapes[x]), module=target)
            elif isinstance(m, (nn.ReLU, nn.ReLU6, nn.SiLU, nn.GELU, nn.Sigmoid, nn.Tanh, nn.Hardswish)):
                names[name] = b.relu(name, x, inplace=bool(getattr(m, "inplace", False)))
            elif isinstance(m, nn.BatchNorm2d):
                names[name] = b.batchnorm(name, x)
            elif isinstance(m, (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)):
                kind = "max" if isinstance(m, (nn.MaxPool2d, nn.AdaptiveMaxPool2d)) else "avg"
                k = getattr(m, "kernel_size", 1)
                window = k if isinstance(k, int) else k[0]
                names[name] = _pool(b, name, x, shape, window, kind, isinstance(m, nn.AdaptiveAvgPool2d))
            elif isinstance(m, nn.Linear):
                names[name] = b.linear(name, x, m.out_features)
            elif isinstance(m, (nn.Flatten, nn.Identity, nn.Dropout, nn.Unflatten)):
                names[name] = b._add(_view(b, name, x, shape))
            else:
                names[name] = b.other(name, tuple(inputs), inplace=bool(getattr(m, "inplace", False)), shape=shape)
        elif target in (torch.flatten, torch.reshape) or target in ("view", "flatten", "reshape", "contiguous",
                                                                     "squeeze", "unsqueeze"):
            names[name] = b._add(_view(b, name, x, shape))
        elif target in (torch.relu, F.relu, "relu", "relu_", torch.relu_):
            inplace = target in ("relu_", torch.relu_) or bool(node.kwargs.get("inplace", False))
            names[name] = b.relu(name, x, inplace=inplace)
        elif target in (operator.add, torch.add, "add", operator.iadd, "add_") and len(inputs) == 2 \
                and b.shapes[inputs[0]] == b.shapes[inputs[1]]:
            names[name] = b.add(name, inputs[0], inputs[1], inplace=target in (operator.iadd, "add_"))
        elif target in (F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d):
            kind = "max" if target in (F.max_pool2d, F.adaptive_max_pool2d) else "avg"
            k = node.args[1] if len(node.args) > 1 else node.kwargs.get("kernel_size", 1)
            names[name] = _pool(b, name, x, shape, k if isinstance(k, int) else k[0], kind,
                                target is F.adaptive_avg_pool2d)
        elif target is F.batch_norm:
            names[name] = b.batchnorm(name, x)
        elif target in (torch.cat, torch.concat):
            names[name] = b.concat(name, inputs)
        else:
            names[name] = b.other(name, tuple(dict.fromkeys(inputs)),
                                  inplace=isinstance(target, str) and target.endswith("_"), shape=shape)
        last = name
    if last is None or b.ops[-1].type != "loss":
        raise UnsupportedProblem(f"{type(model).__name__}: the traced graph returns no tensor")
    return b.ops


def _view(b, name: str, x: str, shape: tuple[int, ...]):
    return Op(name, "view", (x,), shape, inplace=True)


def _pool(b, name: str, x: str, shape: tuple[int, ...], window: int, kind: str, adaptive_avg: bool) -> str:
    """A pool as PyTorch's autograd saves it (derivatives.yaml): its input, and a max-pool's int64 indices of
    the output's shape; an adaptive average pool to 1x1 is a mean, which saves no tensor."""
    if adaptive_avg and shape[-2:] == (1, 1):
        return b.pool(name, x, shape, window, kind, saves=())
    indices = 2 * DTYPE_BYTES * math.prod(shape) if kind == "max" else 0
    return b.pool(name, x, shape, window, kind, saves=(x,), saved_bytes=indices)
