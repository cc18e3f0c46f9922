"""Sphinx configuration of ucudnn's documentation site (issue 45).

Pages are MyST Markdown; the API reference is autodoc over the docstrings (their few ``Parameters`` sections
read by `_parameter_fields` below, not napoleon); the CLI reference is generated from click (sphinx-click).
Nothing here reaches the network.
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
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = [
    "_build",
    "Thumbs.db",
    ".DS_Store",
]

# The docstrings write code as `name` (Markdown's habit): show it as code, not as italics.
default_role = "literal"

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
