"""Sphinx configuration for npattn's documentation.

Build from the repository root, with npattn importable (installed, or built in
place with python/ on PYTHONPATH):

    pip install ".[docs]"
    sphinx-build -W --keep-going -n -b html docs docs/_build/html

The notebooks are rendered from their stored outputs (never executed here);
they are copied from notebooks/ into docs/notebooks/ at the start of a build.
"""

import os
import re
import shutil
import sys

import npattn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "_ext"))

project = "npattn"
author = "the npattn authors"
copyright = "the npattn authors; BSD-3-Clause"
release = npattn.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",
    "myst_nb",
    "c_header",  # docs/_ext/c_header.py: attention.h's comments as prose
    "optional_module",  # docs/_ext/optional_module.py: adapters that may not exist yet
    "svgmath",  # docs/_ext/svgmath.py: maths as SVG, drawn at build time (MathJax would come from a CDN)
]
html_math_renderer = "svgmath"

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "notebooks/README.md", "**.ipynb_checkpoints"]
templates_path = ["_templates"]
highlight_language = "none"  # literal blocks are formulas and shapes; code blocks name their language

# The API reference: one page per public function, from its numpydoc docstring.
autosummary_generate = True
# the optional modules' pages build without their libraries (the docs extra alone has none of them)
autodoc_mock_imports = ["dask", "distributed", "torch", "mlx", "transformers"]
autodoc_typehints = "none"  # the docstrings state the types, in NumPy's words
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

# Notebooks: the outputs stored in the repository, as they are.
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

# Everything is checked offline: no intersphinx, no external link check.
nitpicky = True
nitpick_ignore_regex = [
    # types named in signatures and docstrings that live in other projects
    ("py:class", r"(numpy|np|dask|mx|mlx|torch|typing|collections\.abc)\..*"),
    ("py:class", r"(Any|Sequence|NamedTuple|array_like|optional|int|float|bool|str|tuple|None)"),
]

html_theme = "pydata_sphinx_theme"
html_title = f"npattn {release}"
html_theme_options = {
    "navbar_align": "left",
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
    "secondary_sidebar_items": ["page-toc"],
}
html_context = {"default_mode": "light"}
html_static_path = ["_static"]
html_css_files = ["npattn.css"]
# Pages with no pages under them: no left sidebar (it would hold a heading alone).
html_sidebars = {
    page: []
    for page in ("index", "install", "guide", "checking", "tiny-llm", "peers", "benchmarks")
    + ("c-api", "platforms", "development", "changelog")
}
html_show_sourcelink = False


def copy_notebooks(app):
    """notebooks/*.ipynb and their pictures into docs/notebooks/, fresh for each build."""
    src, dst = os.path.join(ROOT, "notebooks"), os.path.join(HERE, "notebooks")
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs(dst)
    for name in sorted(os.listdir(src)):
        if name.endswith((".ipynb", ".png", ".svg")):
            shutil.copy2(os.path.join(src, name), dst)


STAR = re.compile(r"\(\*(?=\w)")


def escape_shape_stars(app, what, name, obj, options, lines):
    """``shape (*B, H_q, L, D)`` on a parameter's or a result's type line: a literal star, not emphasis.

    Runs before numpydoc reads the docstring; text inside backquotes is left alone.
    """
    for i, line in enumerate(lines):
        if "shape (" in line and "``" not in line and not line.startswith(" "):
            lines[i] = STAR.sub(r"(\\*", line)


def setup(app):
    app.connect("builder-inited", copy_notebooks)
    app.connect("autodoc-process-docstring", escape_shape_stars, priority=100)
