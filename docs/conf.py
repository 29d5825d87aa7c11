"""Sphinx configuration of the tf_nestpipe docs (`python -m sphinx -W -b html docs OUT`)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

from tf_nestpipe import settings  # noqa: E402  (standard library only)

project = "tf_nestpipe"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "_generated"]
myst_heading_anchors = 3
# `name` in docstrings is code, as in the Markdown pages.
default_role = "literal"
autodoc_member_order = "bysource"
autodoc_inherit_docstrings = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
html_theme = "alabaster"

# The configuration reference's table of environment variables, from their one declaration.
_GENERATED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_generated")
os.makedirs(_GENERATED, exist_ok=True)
with open(os.path.join(_GENERATED, "environment.md"), "w") as _f:
    _f.write(settings.markdown_table())
