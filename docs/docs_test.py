"""Builds the documentation with warnings as errors, and checks it documents the public API."""

from __future__ import annotations

import difflib
import importlib
import os
import pathlib
import re
import subprocess
import sys

import pytest
import tensorstore as ts
import zarr

from jaxckpt import errors as errors_module

_DOCS = pathlib.Path(__file__).resolve().parent
PUBLIC_MODULES = ("jaxckpt", "jaxckpt.universal", "jaxckpt.parity", "jaxckpt.ft", "jaxckpt.agent")
# documented once, under another public name
_ALIASES = {"jaxckpt.parity.ParityOptions": "jaxckpt.ParityOptions"}


@pytest.fixture(scope="module")
def html(tmp_path_factory) -> pathlib.Path:
  out = tmp_path_factory.mktemp("html")
  proc = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q",
       "-d", str(out / ".doctrees"), str(_DOCS), str(out)],
      capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, f"sphinx-build failed:\n{proc.stdout[-5000:]}\n{proc.stderr[-10000:]}"
  return out


def _inventory(html_dir: pathlib.Path) -> set[str]:
  from sphinx.util.inventory import InventoryFile  # pylint: disable=import-outside-toplevel
  with open(html_dir / "objects.inv", "rb") as f:
    inv = InventoryFile.load(f, "", lambda base, uri: uri)
  return {name for domain, entries in inv.items() if domain.startswith("py:") for name in entries}


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_docs_build_without_warnings_and_document_every_public_name(html: pathlib.Path):
  for page in ("index", "getting_started", "concepts", "howto", "api", "format", "benchmarks",
               "guide", "architecture", "conversion", "replica_groups",
               "notebooks/quickstart", "notebooks/reshard_and_convert", "notebooks/parity"):
    assert (html / f"{page}.html").is_file(), page
  documented = _inventory(html)
  missing = []
  for module_name in PUBLIC_MODULES:
    module = importlib.import_module(module_name)
    for name in module.__all__:
      full = f"{module_name}.{name}"
      if isinstance(getattr(module, name), type(module)):
        continue                       # a subpackage, documented with its own section
      if _ALIASES.get(full, full) not in documented:
        missing.append(full)
  assert not missing, f"public names missing from docs/api.md: {missing}"


@pytest.mark.slow
def test_benchmark_plots_are_embedded_and_small(html: pathlib.Path):
  for png in ("goodput.png", "goodput_measured.png", "goodput_tornado.png", "parity_codec.png", "train_overhead.png",
              "scale_leaves.png", "scale_commit.png"):
    src = _DOCS / "_static" / png
    assert src.stat().st_size < 150_000, f"{png} is {src.stat().st_size} bytes"
    assert png in (html / "benchmarks.html").read_text(), png


def test_readme_lists_every_error_class():
  """The README's error list names every public error class with its builtin base."""
  readme = (_DOCS.parent / "README.md").read_text()
  classes = [c for c in vars(errors_module).values()
             if isinstance(c, type) and issubclass(c, errors_module.JaxckptError)
             and c is not errors_module.JaxckptError]
  assert classes
  for c in classes:
    builtin = next(b for b in c.__mro__[1:] if b.__module__ == "builtins" and b is not Exception)
    assert f"`{c.__name__}({builtin.__name__})`" in readme, c.__name__


@pytest.mark.parametrize("dtype,zarr_reads", [("float32", True), ("int8", True), ("bfloat16", False),
                                               ("float8_e4m3fn", False), ("int4", False)])
def test_format_md_claim_on_which_dtypes_zarr_python_reads(tmp_path, dtype, zarr_reads):
  """docs/format.md: zarr-python reads core-dtype arrays and refuses JAX's extension dtypes."""
  assert "refuses the extension types JAX uses (`bfloat16`" in (_DOCS / "format.md").read_text()
  path = tmp_path / dtype
  ts.open({"driver": "zarr3", "kvstore": f"file://{path}", "metadata": {"shape": [4], "data_type": dtype}},
          create=True).result()
  if zarr_reads:
    assert zarr.open_array(str(path), mode="r")[:].tolist() == [0, 0, 0, 0]
  else:
    with pytest.raises(ValueError):
      zarr.open_array(str(path), mode="r")


def _port_section() -> tuple[str, str, str]:
  text = (_DOCS / "howto.md").read_text()
  section = text.split("## Port an orbax training loop", 1)[1].split("\n## ", 1)[0]
  section = section.split("\n### ", 1)[0]
  diff, = re.findall(r"```diff\n(.*?)```", section, re.S)
  orbax_src, jaxckpt_src = re.findall(r"```python\n(.*?)```", section, re.S)
  return diff, orbax_src, jaxckpt_src


def test_the_orbax_port_changes_only_the_import_and_the_manager():
  diff, orbax_src, jaxckpt_src = _port_section()
  want = "\n".join(difflib.unified_diff(orbax_src.splitlines(), jaxckpt_src.splitlines(),
                                        "orbax_loop.py", "jaxckpt_loop.py", n=0, lineterm=""))
  assert diff.strip() == want.strip()                     # the diff shown is the real one
  changed = [line for line in want.splitlines()[2:] if line[:1] in "+-"]
  assert changed[0] == "+import jaxckpt"
  assert all("CheckpointManager" in line or "Options(" in line for line in changed[1:]), changed


@pytest.mark.slow
def test_the_agent_beside_orbax_s_retention_example_prints_what_it_says(tmp_path):
  text = (_DOCS / "howto.md").read_text()
  section = text.split("### Add the agent and parity to a ported loop", 1)[1].split("\n### ")[0]
  src, = re.findall(r"```python\n(.*?)```", section, re.S)
  job = f"docs-port-{os.getpid()}"
  try:
    proc = subprocess.run([sys.executable, "-c", src.replace('job_name="demo"', f'job_name="{job}"')],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = re.search(r"print\(.*\)\s+# (\[.*?\] \d+)", src).group(1)
    assert proc.stdout.strip().splitlines()[-1] == said, proc.stdout
  finally:
    subprocess.run([sys.executable, "-m", "jaxckpt.agent", "stop", "--job-name", job],
                   capture_output=True, timeout=60)


def test_the_composite_and_grain_example_runs_as_written(tmp_path):
  text = (_DOCS / "howto.md").read_text()
  section = text.split("### Several items: `Composite`", 1)[1].split("\n## ", 1)[0].split("\n### ")[0]
  src, = re.findall(r"```python\n(.*?)```", section, re.S)
  proc = subprocess.run([sys.executable, "-c", src], cwd=tmp_path, capture_output=True, text=True,
                        timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_both_loops_of_the_orbax_port_run_and_agree(tmp_path):
  _, orbax_src, jaxckpt_src = _port_section()
  outputs = []
  for name, src in (("orbax", orbax_src), ("jaxckpt", jaxckpt_src)):
    (tmp_path / name).mkdir()
    proc = subprocess.run([sys.executable, "-c", src], cwd=tmp_path / name, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, f"{name} loop failed:\n{proc.stderr[-3000:]}"
    outputs.append(proc.stdout.strip().splitlines()[-1])
  assert outputs[0] == outputs[1] and outputs[0].startswith("6 [4, 6] "), outputs


@pytest.mark.slow
@pytest.mark.parametrize("page", ["README.md", "docs/getting_started.md"])
def test_the_first_example_runs_as_written(page: str, tmp_path: pathlib.Path):
  """The page's python blocks, in order, as one program (its agent's job name made unique)."""
  text = (_DOCS.parent / page).read_text()
  src = "\n".join(re.findall(r"```python\n(.*?)```", text, re.S))
  job = f"docs-{os.getpid()}-{tmp_path.name[-12:]}".replace("_", "-")
  unique = src.replace('job_name="demo"', f'job_name="{job}"')
  assert unique != src, f"{page}: no agent job name to make unique"
  try:
    proc = subprocess.run([sys.executable, "-c", unique], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RestoreInfo(step=1, tier='host'" in proc.stdout, proc.stdout
  finally:
    subprocess.run([sys.executable, "-m", "jaxckpt.agent", "stop", "--job-name", job],
                   capture_output=True, timeout=60)


def test_the_guide_s_metrics_example_prints_what_it_says(tmp_path: pathlib.Path):
  text = (_DOCS / "guide.md").read_text()
  section = text.split("### Metrics where you look", 1)[1].split("\n## ", 1)[0]
  src, = re.findall(r"```python\n(.*?)```", section, re.S)
  proc = subprocess.run([sys.executable, "-c", src], cwd=tmp_path, capture_output=True, text=True,
                        timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  said = re.search(r"# (\[.*\])", src).group(1)
  assert proc.stdout.strip().splitlines()[-1] == said, proc.stdout
