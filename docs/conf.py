"""Sphinx configuration: MyST pages, notebooks as pages (myst-nb), API from docstrings.

Build: ``sphinx-build -W --keep-going -b html docs docs/_build/html``
(``docs/docs_test.py`` runs exactly this). Nothing is fetched from the network:
no intersphinx, notebooks are rendered as committed (``notebooks/notebooks_test.py``
executes them).
"""

import pathlib
import shutil

_DOCS = pathlib.Path(__file__).resolve().parent
_NOTEBOOKS = _DOCS.parent / "notebooks"


def _copy_notebooks() -> None:
  """Sphinx reads only its source tree: mirror ../notebooks/*.ipynb into docs/notebooks/."""
  dst = _DOCS / "notebooks"
  dst.mkdir(exist_ok=True)
  for nb in sorted(_NOTEBOOKS.glob("*.ipynb")):
    target = dst / nb.name
    if not target.exists() or target.read_bytes() != nb.read_bytes():
      shutil.copyfile(nb, target)


_copy_notebooks()

project = "jaxckpt"
author = "the jaxckpt authors"
copyright = "2025, the jaxckpt authors"  # pylint: disable=redefined-builtin

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

exclude_patterns = ["_build", "**.ipynb_checkpoints", "README.md", "jupyter_execute"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

nb_execution_mode = "off"        # executed by notebooks/notebooks_test.py instead
nb_merge_streams = True

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True          # dataclass "Attributes:" as fields, not duplicate entries

html_theme = "furo"
html_title = "jaxckpt"
html_static_path = ["_static"]
