"""Executes every notebook top to bottom, as Colab would, so that none can rot.

Each runs in a fresh kernel (its first cell, the install cell, is a no-op here
because jaxckpt is importable) in a temporary working directory, and must
finish within five minutes. A cell that raises fails the test with the cell
and its traceback.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import sysconfig
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
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # (conftest's: the repo)
  out = subprocess.run([sys.executable, "-S", "-c", _install_cell(path)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode != 0
  assert "CalledProcessError" in out.stderr and "git+" + _repository() in out.stderr, out.stderr[-2000:]


def test_notebooks_are_committed_executed_with_a_plot_and_no_error():
  """Committed as executed top to bottom (rendered so in the docs), each with a plot."""
  for path in NOTEBOOKS:
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), path.name
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"], path.name
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} shows no plot"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_install_cell_installs_jaxckpt_into_a_fresh_virtual_environment(tmp_path: pathlib.Path):
  """The install cell, run by a fresh venv's Python (no jaxckpt, as on Colab) with its source pointed
  at a wheel of this checkout, installs it into that venv; run again, it installs nothing; then the
  three notebooks run top to bottom there, importing the jaxckpt the cell installed."""
  wheels = tmp_path / "wheels"
  subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                  "-w", str(wheels), str(_HERE.parent)], check=True, timeout=300,
                 capture_output=True)
  wheel, = wheels.glob("jaxckpt-*.whl")
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
  python = str(venv / "bin" / "python")
  (tmp_path / "jaxckpt").mkdir()                          # a checkout folder in the cwd
  where = ('import importlib.metadata as m; d = m.distribution("jaxckpt"); '
           'print(d.version, d.locate_file(""))')
  env = dict(os.environ, PIP_NO_DEPS="1", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
  env.pop("PYTHONPATH", None)
  run = lambda src: subprocess.run([python, "-c", src], cwd=tmp_path, env=env, capture_output=True,
                                   text=True, timeout=300)
  assert run(where).returncode != 0                       # fresh: not installed
  cell = _install_cell(NOTEBOOKS[0])
  local = cell.replace('JAXCKPT_SOURCE = f"git+{JAXCKPT_REPOSITORY}"', f"JAXCKPT_SOURCE = {str(wheel)!r}")
  assert local != cell
  out = run(local)
  assert out.returncode == 0, out.stderr[-2000:]
  got = run(where)
  version = tomllib.loads((_HERE.parent / "pyproject.toml").read_text())["project"]["version"]
  assert got.returncode == 0 and got.stdout.split()[0] == version, got.stderr[-2000:]
  assert got.stdout.split()[1].startswith(str(venv)), got.stdout
  again = run(cell.replace('JAXCKPT_SOURCE = f"git+{JAXCKPT_REPOSITORY}"',
                           'JAXCKPT_SOURCE = "/nonexistent.whl"'))
  assert again.returncode == 0, again.stderr[-2000:]      # installed: pip is not called
  # Colab comes with jax, flax, optax and the rest: this interpreter's packages stand in for them,
  # after the venv's own (so the jaxckpt found is the one the cell installed; a .pth line is not
  # a site directory, so nothing else of this interpreter's installs comes along).
  site = next(pathlib.Path(venv).glob("lib/python*/site-packages"))
  (site / "colab_preinstalled.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
  for path in NOTEBOOKS:                                   # each notebook, top to bottom, there
    work = tmp_path / path.stem
    work.mkdir()
    script = []
    for c in nbformat.read(path, as_version=4).cells:
      if c.cell_type != "code":
        continue
      if c.source.startswith("%%writefile "):
        name, _, body = c.source.partition("\n")
        (work / name.split()[1]).write_text(body)
      else:
        script.append(c.source)
    script.insert(1, "import matplotlib; matplotlib.use('Agg')")
    script.append("import jaxckpt; print('jaxckpt from', jaxckpt.__file__)")
    proc = subprocess.run([python, "-c", "\n".join(script)], cwd=work, env=env, capture_output=True,
                          text=True, timeout=LIMIT_SECS)
    assert proc.returncode == 0, f"{path.name} in the fresh venv:\n{proc.stderr[-3000:]}"
    assert f"jaxckpt from {site}" in proc.stdout, proc.stdout[-500:]


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
