"""Sphinx configuration of shmsync's documentation (``make docs``)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

import shmsync  # noqa: E402  (after the checkout is on the path)

project = "shmsync"
author = "the shmsync authors"
copyright = "2026, the shmsync authors"
release = version = shmsync.__version__  # written in one place: shmsync/__init__.py

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
exclude_patterns = ["_build", "results"]  # results/ pages are included by performance.md

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_custom_sections = [("Keyword Args", "params_style")]

# Other projects' names (torch.nn.Module...) stay plain text: the docs build without a network.
nitpicky = False

html_theme = "furo"
html_title = "shmsync"
