"""The layout of the code: layers that import downwards only, no import circles, modules of one idea.

Read from the source files (not from `sys.modules`), so that an import inside a function counts as much as
one at the top of a module: a lazy import hides a circle, it does not remove it.
"""

from __future__ import annotations

import ast
import graphlib
import importlib
import importlib.util
from pathlib import Path

import pytest

# The installed packages and where their sources lie (solver/, db/ and cli/ are installed under ucudnn).
ROOTS = ("ucudnn", "ucudnn.solver", "ucudnn.db", "ucudnn.cli")

# Bottom to top; a module may import its own layer and those below it. The longest matching prefix names a
# module's layer (`ucudnn` alone is the package's front door: it re-exports from every layer).
LAYERS = (
    ("ucudnn.errors", "ucudnn.sizes", "ucudnn.problem", "ucudnn.devices", "ucudnn.solver"),  # values, pure math
    ("ucudnn.db",),  # the measurement cache
    ("ucudnn.reference", "ucudnn.backends"),  # running one algorithm
    ("ucudnn.kernel",),  # one kernel: measure, run, check
    ("ucudnn.handle",),  # a layer's kernels: plan and launch
    ("ucudnn.network", "ucudnn.memory"),  # a whole network
    # PyTorch, room by room (its front door, `zoo` and `distributed` above them)
    ("ucudnn.torch.converting",),  # drop-in convolutions
    ("ucudnn.torch.capturing",),  # one training step recorded
    ("ucudnn.torch.running",),  # a plan executed
    ("ucudnn.torch.planning",),  # a plan made
    ("ucudnn.torch.checking",),  # a plan checked
    ("ucudnn.torch",),
    ("ucudnn.cli", "ucudnn"),  # entry points
)

MAX_LINES = 600
# A module may be longer when its one idea needs it, and its docstring then says so in these words.
LONG_MODULE_MARK = "One module because"

# Names users import (the README, docs/ and the contracts in docs/design.md): each must keep importing
# from here whatever moves behind it.
PUBLIC = {
    "ucudnn": (
        "BackendUnavailable",
        "Configuration",
        "ConvProblem",
        "Handle",
        "Infeasible",
        "InvalidInput",
        "KernelChoice",
        "LateRegistrationWarning",
        "MicroConfig",
        "UcudnnError",
        "UnsupportedProblem",
        "best_batch_size",
        "get_backend",
        "run_configuration",
    ),
    "ucudnn.torch": (
        "Conv1d",
        "Conv2d",
        "Conv3d",
        "ConvTranspose1d",
        "ConvTranspose2d",
        "ConvTranspose3d",
        "ExecutionStats",
        "PlanCheck",
        "StepTracker",
        "announce",
        "capture",
        "check_plan",
        "convert",
        "execute_plan",
        "measure_profile",
        "plan_memory",
        "zoo",
    ),
    "ucudnn.torch.distributed": ("UnevenBatchState", "UnevenSampler", "allreduce_gradients", "uneven_batch_hook"),
    "ucudnn.memory": (
        "ACTIONS",
        "POLICIES",
        "ConvWorkspace",
        "MemoryPlan",
        "TensorAction",
        "available_policies",
        "make_plan",
    ),
    "ucudnn.memory.graph": ("Op", "Step", "Tensor", "TrainingGraph", "from_network"),
    "ucudnn.solver": ("Configuration", "Infeasible", "MicroConfig", "wr", "pareto", "wd", "cluster"),
    "ucudnn.solver.cluster": ("best_batch_sizes", "makespan"),
    "ucudnn.db": (
        "MERGE_RULE",
        "SCHEMA_VERSION",
        "Cache",
        "MeasurementRecord",
        "MergeCounts",
        "MergeReport",
        "PlanRecord",
        "default_url",
    ),
    "ucudnn.backends": ("BACKENDS", "Backend", "DeviceInfo", "get_backend"),
    "ucudnn.backends.cpu": ("CpuBackend",),
    "ucudnn.handle": ("Handle", "KernelChoice", "LateRegistrationWarning"),
}


def _sources() -> dict[str, Path]:
    """Every module of the installed packages, by dotted name, and its file."""
    modules: dict[str, Path] = {}
    for root in ROOTS:
        folder = Path(importlib.util.find_spec(root).submodule_search_locations[0])
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if not all((folder.joinpath(*parts[:i]) / "__init__.py").exists() for i in range(len(parts))):
                continue  # a data folder, not a package
            name = ".".join((root, *parts[:-1], *(() if parts[-1] == "__init__" else parts[-1:])))
            modules.setdefault(name, path)
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules that `name` imports anywhere in its file (a name imported from a package counts
    as the package's `__init__` unless it is a submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from .x` is in this package, each further dot one package up
                parents = package.split(".")
                base = ".".join(parents[: len(parents) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _layer(name: str) -> int:
    matches = [
        (len(prefix), index)
        for index, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if name == prefix or name.startswith(prefix + ".")
    ]
    assert matches, f"{name} belongs to no layer: add it to LAYERS"
    return max(matches)[1]


MODULES = _sources()
IMPORTS = {name: _imports(name, path, MODULES) for name, path in MODULES.items()}


def test_the_walk_sees_the_whole_package():
    # A walk that found nothing would pass every check below.
    assert {
        "ucudnn",
        "ucudnn.handle",
        "ucudnn.solver.wr",
        "ucudnn.db.cache",
        "ucudnn.cli.main",
        "ucudnn.torch.converting.conv",
        "ucudnn.memory.graph",
        "ucudnn.backends.cpu",
    } <= set(MODULES)
    assert "ucudnn.reference" in IMPORTS["ucudnn.kernel.selftest"]


def test_no_module_imports_one_that_imports_it_back():
    try:
        graphlib.TopologicalSorter(IMPORTS).prepare()
    except graphlib.CycleError as exc:
        pytest.fail("import circle: " + " -> ".join(exc.args[1]))


def test_imports_point_down_the_layers():
    upward = [
        f"{name} (layer {_layer(name)}) imports {target} (layer {_layer(target)})"
        for name, targets in IMPORTS.items()
        for target in targets
        if _layer(target) > _layer(name)
    ]
    assert not upward, "\n".join(upward)


def test_modules_hold_one_idea_each():
    long = []
    for name, path in MODULES.items():
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_LINES and LONG_MODULE_MARK not in (ast.get_docstring(ast.parse(text)) or ""):
            long.append(f"{name}: {lines} lines, and its docstring does not say why ({LONG_MODULE_MARK} ...)")
    assert not long, "\n".join(long)


def _from_import(module, name: str) -> bool:
    """Whether `from module import name` works (a submodule not yet imported counts, as it does there)."""
    return hasattr(module, name) or importlib.util.find_spec(f"{module.__name__}.{name}") is not None


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_import_from_where_they_did(module):
    imported = importlib.import_module(module)
    missing = [name for name in PUBLIC[module] if not _from_import(imported, name)]
    assert not missing, f"{module} lost {missing}"


def test_every_package_is_in_the_wheel():
    # setuptools ships only the packages pyproject lists: one left out imports here (editable) and not from a wheel.
    import tomllib

    listed = set(
        tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    packages = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    assert packages == listed, (
        f"not in pyproject: {sorted(packages - listed)}; no such package: {sorted(listed - packages)}"
    )
