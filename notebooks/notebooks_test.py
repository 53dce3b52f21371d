"""Executes every notebook top to bottom, as Colab would, so that none can rot.

Each runs in a fresh kernel (its first cell, the install cell, is a no-op here
because jaxckpt is importable) in a temporary working directory, and must
finish within five minutes. A cell that raises fails the test with the cell
and its traceback.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time
import tomllib

import nbclient
import nbformat
import pytest

_HERE = pathlib.Path(__file__).resolve().parent
NOTEBOOKS = sorted(_HERE.glob("*.ipynb"))
LIMIT_SECS = 300


def test_there_are_three_notebooks_and_each_starts_by_installing_jaxckpt():
  assert [nb.stem for nb in NOTEBOOKS] == ["parity", "quickstart", "reshard_and_convert"]
  for path in NOTEBOOKS:
    nb = json.loads(path.read_text())
    first_code = next(c for c in nb["cells"] if c["cell_type"] == "code")
    src = "".join(first_code["source"])
    assert 'importlib.metadata.version("jaxckpt")' in src and "pip" in src, path.name
    assert f'JAXCKPT_REPOSITORY = "{_repository()}"' in src, path.name


def _repository() -> str:
  return tomllib.loads((_HERE.parent / "pyproject.toml").read_text())["project"]["urls"]["Repository"]


def _install_cell(path: pathlib.Path) -> str:
  nb = json.loads(path.read_text())
  return "".join(next(c for c in nb["cells"] if c["cell_type"] == "code")["source"])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_install_cell_is_not_fooled_by_a_jaxckpt_folder(path: pathlib.Path, tmp_path: pathlib.Path):
  """Where jaxckpt is not installed, a checkout folder named jaxckpt in the cwd does not stop the install.

  The interpreter runs without site-packages (-S), so jaxckpt is not installed there and neither is pip:
  the cell must try `pip install git+<Repository>` and fail on the missing pip, not skip the install.
  """
  (tmp_path / "jaxckpt").mkdir()
  (tmp_path / "jaxckpt" / "__init__.py").write_text("")
  out = subprocess.run([sys.executable, "-S", "-c", _install_cell(path)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode != 0
  assert "CalledProcessError" in out.stderr and "git+" + _repository() in out.stderr, out.stderr[-2000:]


def test_notebooks_are_committed_without_outputs():
  for path in NOTEBOOKS:
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; clear them before committing"


@pytest.mark.slow
@pytest.mark.timeout(LIMIT_SECS + 60)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path: pathlib.Path, tmp_path: pathlib.Path):
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=LIMIT_SECS, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  t0 = time.monotonic()
  client.execute()
  seconds = time.monotonic() - t0
  assert seconds < LIMIT_SECS, f"{path.name} took {seconds:.0f} s, over the {LIMIT_SECS} s budget"
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]
  assert not errors, errors
