"""Run every command and code block of README.md as a newcomer would; time each; exit 1 if one fails.

    python benchmarks/readme_check.py [--fresh-clone] [--only fast|all] [--json FILE] [--files FILE ...]

--files checks other Markdown files instead, in the order given: the guide pages (`--files docs/guide-*.md`;
a pattern the shell left unexpanded is expanded from the repository root); README.md alone by default.
Blocks are fenced ```bash (each line one command, run by bash in a scratch folder) and ```python (those
of one `## ` section of one file in one interpreter, in file order). Each Python block runs as if pasted
alone: it finds the names a reader brings (below) and nothing else, not even `torch`, unless its first line
says it continues (`# continued from the block above`, as the reader sees it too): then it runs in the names
the blocks before it in its section left. A fence indented inside a list item is not run. An HTML
comment on the line just before a block tags it:

    <!-- readme-check: setup -->        the fresh-machine set-up: run only with --fresh-clone, in a
                                        clone of this checkout (it builds .venv there and runs the tests)
    <!-- readme-check: slow -->         long (a benchmark from an empty cache): left out by --only fast
    <!-- readme-check: gpu -->          needs an NVIDIA GPU: run only where `nvidia-smi -L` lists one
    <!-- readme-check: torchvision -->  run only where torchvision imports beside torch
    <!-- readme-check: models -->       run only where transformers and MONAI import (the `models` extra)

The scratch folder has its own user cache ($XDG_CACHE_HOME; $UCUDNN_DB unset), so every benchmark
starts from an empty cache, as on a new machine. The Python blocks use names a reader brings
(READER_NAMES: `model`, `example_input`, `x`, `y`, `criterion`, `optimizer`, as the README says): PRELUDE
gives them a small CNN, made afresh for each block that stands alone; the guide pages say the same.
After a run the speedup the README's main job printed (its `speedup:` line) must lie in the range the
README states for it ("the `speedup:` line read LOWx to HIGHx"), which fails the check otherwise. Without --fresh-clone the commands run with this interpreter's
`ucudnn`. The bash blocks of every file given run in one scratch folder, in order.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TAGS = ("setup", "slow", "gpu", "torchvision", "models")
_FENCE = re.compile(r"^```(\w*)\s*$")
_TAG = re.compile(r"^<!--\s*readme-check:\s*([\w-]+)\s*-->\s*$")

# What a reader of the PyTorch examples has already: a model, a batch, a loss and an optimiser.
PRELUDE = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
example_input, criterion = x, nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
"""
READER_NAMES = ("model", "example_input", "x", "y", "criterion", "optimizer")
# The first line of a Python block that runs on in the names of the blocks before it.
CONTINUED = re.compile(r"^# continued\b", re.IGNORECASE)


@dataclass(frozen=True)
class Block:
    language: str  # "bash" or "python"
    tag: str  # one of TAGS, or "" (quick, always run)
    line: int  # line of the opening fence in its file
    text: str
    section: str = ""  # the `## ` heading it is under
    source: str = "README.md"  # the file, relative to the repository root

    @property
    def continued(self) -> bool:
        """A Python block that says, on its first line, that it runs on from the block before it."""
        return bool(CONTINUED.match(self.text.lstrip()))

    def commands(self) -> list[str]:
        """A bash block's commands: its lines without blank and comment-only ones."""
        return [c for c in (raw.strip() for raw in self.text.splitlines()) if c and not c.startswith("#")]


def _source(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def blocks(readme: Path = README) -> list[Block]:
    """Every ```bash and ```python block of a Markdown file (README.md by default), with the tag on the line
    before it."""
    source = _source(readme)
    found, lines = [], readme.read_text(encoding="utf-8").splitlines()
    i, section = 0, ""
    while i < len(lines):
        if lines[i].startswith("## "):
            section = lines[i][3:].strip()
        match = _FENCE.match(lines[i])
        if not match or not match.group(1):
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        tag_match = _TAG.match(lines[i - 1]) if i else None
        tag = tag_match.group(1) if tag_match else ""
        if tag and tag not in TAGS:
            raise ValueError(f"{source} line {i}: unknown readme-check tag {tag!r}; known: {', '.join(TAGS)}")
        if match.group(1) in ("bash", "python"):
            found.append(Block(match.group(1), tag, i + 1, "\n".join(lines[i + 1 : end]), section, source))
        i = end + 1
    return found


@dataclass(frozen=True)
class Result:
    what: str
    line: int
    seconds: float
    code: int
    tail: str = ""
    source: str = "README.md"


def has_gpu() -> bool:
    try:
        return bool(
            subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        return False


def has_torchvision(python: str) -> bool:
    return subprocess.run([python, "-c", "import torchvision"], capture_output=True, check=False).returncode == 0


def has_models(python: str) -> bool:
    return (
        subprocess.run([python, "-c", "import transformers, monai"], capture_output=True, check=False).returncode == 0
    )


def wanted(block: Block, only: str, fresh_clone: bool, python: str) -> str | None:
    """Why a block is left out this time, or None to run it."""
    if block.tag == "setup" and not fresh_clone:
        return "set-up (run with --fresh-clone)"
    if block.tag == "slow" and only == "fast":
        return "slow (run with --only all)"
    if block.tag == "gpu" and not has_gpu():
        return "needs an NVIDIA GPU"
    if block.tag == "torchvision" and not has_torchvision(python):
        return "torchvision does not import here"
    if block.tag == "models" and not has_models(python):
        return "transformers and MONAI do not import here (pip install -e '.[models]')"
    return None


def run_bash(block: Block, cwd: Path, env: dict[str, str], timeout_s: float) -> list[Result]:
    """Each command of the block in turn, up to the first that fails."""
    results = []
    for command in block.commands():
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                ["bash", "-c", command],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout_s,
                check=False,
            )
            code, tail = proc.returncode, proc.stdout[-4000:]
        except subprocess.TimeoutExpired:
            code, tail = 124, f"timed out after {timeout_s:.0f} s"
        results.append(Result(command, block.line, time.perf_counter() - start, code, tail, block.source))
        if code:
            break
    return results


def run_python(chosen: list[Block], cwd: Path, env: dict[str, str], python: str, timeout_s: float) -> list[Result]:
    """The chosen Python blocks in one interpreter, in order; each block timed on its own."""
    if not chosen:
        return []
    # a block that stands alone gets a fresh namespace holding only the reader's names (from a fresh PRELUDE);
    # a continued one the namespace the block before it left
    driver = (
        "import json, sys, time, traceback\nns = None\n"
        "for source, line, text, continued in BLOCKS:\n"
        "    start = time.perf_counter()\n"
        "    try:\n"
        "        if not continued or ns is None:\n"
        "            reader = {'__name__': '__main__'}\n            exec(PRELUDE, reader)\n"
        "            ns = {'__name__': '__main__', **{n: reader[n] for n in READER_NAMES}}\n"
        "        exec(compile(text, f'{source}:{line}', 'exec'), ns)\n"
        "        code, tail = 0, ''\n"
        "    except BaseException:\n        code, tail = 1, traceback.format_exc()[-2000:]\n"
        "    print('@@' + json.dumps([line, time.perf_counter() - start, code, tail]), flush=True)\n"
        "    if code:\n        break\n"
    )
    blocks_ = [(b.source, b.line, b.text, b.continued) for b in chosen]
    script = f"PRELUDE = {PRELUDE!r}\nREADER_NAMES = {READER_NAMES!r}\nBLOCKS = {blocks_!r}\n{driver}"
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [python, "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return [
            Result("python blocks", chosen[0].line, time.perf_counter() - start, 124, "timed out", chosen[0].source)
        ]
    results = []
    for out_line in proc.stdout.splitlines():
        if out_line.startswith("@@"):
            line, seconds, code, tail = json.loads(out_line[2:])
            source = chosen[0].source
            results.append(Result(f"python block at {source}:{line}", line, seconds, code, tail, source))
    if proc.returncode and not any(r.code for r in results):
        results.append(
            Result(
                "python blocks",
                chosen[0].line,
                time.perf_counter() - start,
                proc.returncode,
                proc.stderr[-2000:],
                chosen[0].source,
            )
        )
    return results


def check(
    *,
    only: str = "all",
    fresh_clone: bool = False,
    timeout_s: float = 1800.0,
    readme: Path = README,
    files: Sequence[Path] | None = None,
) -> tuple[list[Result], list[tuple[Block, str]]]:
    """Run what the README (or each of `files`, in order) shows; returns the results (in order) and the blocks
    left out, with why."""
    scratch = Path(tempfile.mkdtemp(prefix="ucudnn-readme-"))
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("UCUDNN_DB", "VIRTUAL_ENV", "PYTHONPATH")}
        env["XDG_CACHE_HOME"] = str(scratch / "cache")
        env["MPLBACKEND"] = "Agg"
        if fresh_clone:
            work = scratch / "ucudnn"
            subprocess.run(["git", "clone", "-q", str(ROOT), str(work)], check=True)
            bin_dir = work / ".venv" / "bin"
        else:
            work = scratch / "work"
            work.mkdir()
            bin_dir = Path(sys.executable).parent
        env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
        python = str(bin_dir / "python")
        results: list[Result] = []
        left_out: list[tuple[Block, str]] = []
        all_blocks = [b for path in (files or [readme]) for b in blocks(path)]
        for block in all_blocks:  # the set-up first: everything else runs in what it built
            if block.tag == "setup" and fresh_clone:
                results += run_bash(block, work, env, timeout_s)
                if not (bin_dir / "ucudnn").exists():  # a failing test still leaves the rest to check
                    return results, left_out
        python_blocks = []
        for block in all_blocks:
            why = wanted(block, only, fresh_clone, python)
            if why is not None:
                left_out.append((block, why))
            elif block.language == "bash" and block.tag != "setup":
                results += run_bash(block, work, env, timeout_s)
            elif block.language == "python":
                python_blocks.append(block)
        for source, section in dict.fromkeys((b.source, b.section) for b in python_blocks):
            chosen = [b for b in python_blocks if (b.source, b.section) == (source, section)]
            results += run_python(chosen, work, env, python, timeout_s)
        return results, left_out
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# How the README states its main job's headline, and how the job prints it.
STATED_RANGE = re.compile(r"the `speedup:` line read (\d+(?:\.\d+)?)x to (\d+(?:\.\d+)?)x")
PRINTED = re.compile(r"^speedup: (\d+(?:\.\d+)?)x in total", re.MULTILINE)


def stated_range(readme: Path = README) -> tuple[float, float] | None:
    """The main job's `speedup:` range as the README's text states it (whitespace runs read as one space)."""
    match = STATED_RANGE.search(" ".join(readme.read_text(encoding="utf-8").split()))
    return (float(match.group(1)), float(match.group(2))) if match else None


def check_headline(results: list[Result], readme: Path = README) -> list[Result]:
    """A result for each run of the README's main job (its set-up block's `ucudnn bench`): passed when its printed
    speedup lies in the range the README states, failed when outside or when it printed none (no result when
    the job did not run: only --fresh-clone runs the set-up block)."""
    stated = stated_range(readme)
    source = _source(readme)
    setup = [b for b in blocks(readme) if b.tag == "setup"]
    jobs = {c for b in setup for c in b.commands() if "ucudnn bench " in c}
    found = []
    for r in results:
        if r.source != source or r.what not in jobs or r.code:
            continue
        printed = PRINTED.search(r.tail)
        if stated is None or printed is None:
            why = "the README states no `speedup:` range" if stated is None else "it printed no `speedup:` line"
            found.append(Result(f"the main job's headline: {why}", r.line, 0.0, 1, r.tail[-2000:], source))
            continue
        value = float(printed.group(1))
        inside = stated[0] <= value <= stated[1]
        what = f"the main job printed {value:.2f}x, {'inside' if inside else 'OUTSIDE'} the README's range"
        found.append(
            Result(f"{what}, {stated[0]:.2f}x to {stated[1]:.2f}x", r.line, 0.0, 0 if inside else 1, r.tail, source)
        )
    return found


def markdown_files(names: Sequence[str]) -> list[Path]:
    """The files named, in order: each as given (from the current folder) or from the repository root; a glob
    pattern (`docs/guide-*.md`, when the shell did not expand it) from the repository root, sorted."""
    found: list[Path] = []
    for name in names:
        if any(c in name for c in "*?["):
            matches = sorted(ROOT.glob(name))
            if not matches:
                raise FileNotFoundError(f"--files: nothing matches {name!r} under {ROOT}")
            found += matches
            continue
        path = Path(name) if Path(name).exists() else ROOT / name
        if not path.is_file():
            raise FileNotFoundError(f"--files: no file {name!r}")
        found.append(path)
    return list(dict.fromkeys(p.resolve() for p in found))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fresh-clone",
        action="store_true",
        help="clone this checkout into a scratch folder and run the set-up block there first",
    )
    parser.add_argument("--only", choices=("fast", "all"), default="all")
    parser.add_argument("--json", dest="json_path", help="also write the results to this file")
    parser.add_argument(
        "--files",
        nargs="+",
        metavar="FILE",
        help="the Markdown files to check, in order (default README.md), e.g. README.md docs/guide-*.md",
    )
    args = parser.parse_args(argv)
    try:
        files = markdown_files(args.files) if args.files else None
    except FileNotFoundError as error:
        parser.error(str(error))
    results, left_out = check(only=args.only, fresh_clone=args.fresh_clone, files=files)
    results += check_headline(results)
    for r in results:
        status = "ok" if r.code == 0 else f"EXIT {r.code}"
        print(f"{r.seconds:8.1f} s  {status:<7}  {r.source}:{r.line}  {r.what}")
    for block, why in left_out:
        print(f"{'-':>8}    left out  {block.source}:{block.line}  {block.language} block: {why}")
    failed = [r for r in results if r.code]
    for r in failed:
        print(f"\nfailed: {r.what} ({r.source}:{r.line}), exit {r.code}:\n{r.tail}", file=sys.stderr)
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps(
                {
                    "results": [r.__dict__ for r in results],
                    "left_out": [
                        {"source": b.source, "line": b.line, "language": b.language, "why": why} for b, why in left_out
                    ],
                },
                indent=2,
            )
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
