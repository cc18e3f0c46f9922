"""Sphinx configuration of ucudnn's documentation site (issue 45).

Pages are MyST Markdown; the API reference is autodoc over the docstrings (their few ``Parameters`` sections
read by `_parameter_fields` below, not napoleon); the CLI reference is generated from click (sphinx-click); the
worked examples (docs/examples/plot_*.py) run at each build and their pages, printed output and figures are made
by sphinx-gallery into docs/auto_examples/ (generated, git-ignored). Nothing here reaches the network.
Build: ``sphinx-build -W --keep-going -b html docs docs/_build/html`` (tests/test_docs.py runs it).
"""

from __future__ import annotations

project = "ucudnn"
author = "ucudnn developers"
copyright = "ucudnn developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx_click",
    "sphinx_gallery.gen_gallery",
]

# reStructuredText only for the pages sphinx-gallery generates from the examples.
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = [
    "_build",
    "Thumbs.db",
    ".DS_Store",
    "examples",  # the example scripts and their gallery header: sources of auto_examples/, not pages
]

# The worked examples run in this process, a failing one failing the build. sphinx-gallery keeps each one's output
# in auto_examples/ with its script's hash and runs it again only when the script changed: a clean checkout (CI's)
# runs all three. Measured on the 2-core VM, 2026-11-28, never idle (other benchmarks kept the load at 4-6): the three
# together 84-130 s (the WR table 39-89 s, 22 s run alone; the memory timeline 8-16 s; the frontier 30-47 s), the
# whole build from a clean checkout 91-138 s; with their output kept, 7.5 s. Their times move with the load.
sphinx_gallery_conf = {
    "examples_dirs": "examples",
    "gallery_dirs": "auto_examples",
    "filename_pattern": r"/plot_",  # every example is run
    "within_subsection_order": "FileNameSortKey",  # plot_1_..., plot_2_..., in the order they build on each other
    "abort_on_example_error": True,
    "download_all_examples": False,
    "line_numbers": False,
    "show_memory": False,
    "min_reported_time": 1,
}

# The docstrings write code as `name` (Markdown's habit): show it as code, not as italics.
default_role = "literal"

# A reference to a document, heading or label that is not there is a warning, and -W makes it an error: MyST's
# local links (`page.md`, `page.md#heading`) and Sphinx's roles (:doc:, :ref:) alike. tests/test_docs.py proves it.
# Not `nitpicky`: what it adds here is the type hints' classes outside the site (Python's, torch's; 83 of them),
# which only intersphinx, over the network, could resolve.
# MyST: anchors for headings down to ###, so that links such as design.md#sizes resolve; definition lists
# (troubleshooting.md: a message, then what it means and what to do).
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"

html_theme = "alabaster"
html_title = "ucudnn"
html_static_path: list[str] = []


def _parameter_fields(app, what, name, obj, options, lines: list[str]) -> None:
    """A docstring's ``Parameters`` section, as ucudnn writes it (a title over dashes, then
    ``name : what it is`` lines, continued indented, up to a blank line; `ucudnn.Handle`'s title carries a
    note in brackets), becomes a field list of ``:param name:`` entries. The prose after it stays prose
    (napoleon would read it as more parameters)."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        title = lines[i].strip()
        rule = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if not (title.startswith("Parameters") and rule and set(rule) == {"-"}):
            out.append(lines[i])
            i += 1
            continue
        note = title.removeprefix("Parameters").strip().strip("()")
        if note:
            out += [f"*{note[0].upper()}{note[1:]}:*", ""]
        i += 2
        while i < len(lines) and lines[i].strip():
            line = lines[i]
            field, colon, text = line.partition(" : ")
            if colon and not line[0].isspace():
                out.append(f":param {field.strip()}: {text.strip()}")
            else:
                out.append(f"   {line.strip()}")
            i += 1
        out.append("")
    lines[:] = out


def setup(app) -> None:
    app.connect("autodoc-process-docstring", _parameter_fields)
