"""Dependencies: flax and optax are core (the examples need them) but the library never imports them;
test-only packages live in extras."""

import ast
import functools
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

_ROOT = pathlib.Path(__file__).resolve().parent.parent


def _library_modules() -> list[str]:
  mods = []
  for f in sorted((_ROOT / "jaxckpt").rglob("*.py")):
    rel = f.relative_to(_ROOT).with_suffix("")
    name = ".".join(rel.parts)
    if (f.name.endswith("_test.py") or f.name in ("conftest.py", "__main__.py")
        or "testing" in rel.parts):
      continue
    mods.append(name.removesuffix(".__init__"))
  return mods


def test_flax_and_optax_are_core_and_test_packages_are_extras():
  """The README's first command (`pip install -e .` then the Flax example) needs flax and optax;
  the test-only packages stay in extras."""
  project = tomllib.loads((_ROOT / "pyproject.toml").read_text())["project"]
  runtime = " ".join(project["dependencies"])
  for pkg in ("flax", "optax"):
    assert pkg in runtime, pkg
  for pkg in ("reedsolo", "equinox", "pytest"):
    assert pkg not in runtime, pkg
  extras = project["optional-dependencies"]
  assert any(d.startswith("reedsolo") for d in extras["test"])
  assert any(d.startswith("equinox") for d in extras["equinox"])
  assert any(d.startswith("equinox") for d in extras["test"])


def test_msgspec_is_the_one_serialization_library():
  """The wire's MessagePack is msgspec's (issue 49): msgpack is not a dependency, and no
  module of the library, its tests or its tools imports it."""
  project = tomllib.loads((_ROOT / "pyproject.toml").read_text())["project"]
  deps = [d for d in project["dependencies"] + sum(project["optional-dependencies"].values(), [])]
  assert not [d for d in deps if d.split(">")[0].split("=")[0].strip() == "msgpack"], deps
  assert any(d.startswith("msgspec") for d in project["dependencies"])
  users = [f.relative_to(_ROOT) for d in ("jaxckpt", "tests", "tools", "benchmarks")
           for f in sorted((_ROOT / d).rglob("*.py"))
           if any(m.split(".")[0] == "msgpack" for m in _imports(f))]
  assert not users, users


def test_library_does_not_import_extras_at_run_time():
  mods = _library_modules()
  assert "jaxckpt.manager" in mods and "jaxckpt.universal.cli" in mods
  code = ("import importlib, sys\n"
          f"for m in {mods!r}: importlib.import_module(m)\n"
          "print(sorted(p for p in ('flax', 'optax', 'reedsolo') if p in sys.modules))\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=_ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.strip().splitlines()[-1] == "[]"


def _imports(path: pathlib.Path) -> set[str]:
  """Every module ``path`` imports, at any depth (function-level imports included)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      out.add(node.module)
      out.update(f"{node.module}.{a.name}" for a in node.names)
  return out


# What jaxckpt.testing ships: what users test their own stores and jobs with (docs/api.md's
# HostStore contract tests, scenarios, fault injection, processes, damage, a run's history,
# the power-loss model) and the pytest
# plugin that stops the snapshot agents a session started (a user's suite starts them too).
_SHIPPED_TESTING = {"__init__", "damage", "fault_injection", "history", "host_store",
                    "power_loss", "processes", "pytest_agents", "scenarios"}


def test_the_wheel_holds_the_library_and_not_the_test_harness(tmp_path):
  """The wheel holds ``jaxckpt/`` and no test: of ``jaxckpt.testing`` only what users test
  with; the project's own harness (its workers, the SeaweedFS and etcd launchers, the
  soak) stays in ``tests/support``, which no library module imports."""
  src = tmp_path / "src"        # (a copy: a checkout's stale build/ would leak into the wheel)
  shutil.copytree(_ROOT, src, ignore=shutil.ignore_patterns(
      ".git", "build", "dist", "*.egg-info", "__pycache__", "_build", ".pytest_cache"))
  subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                  "-w", str(tmp_path / "wheels"), str(src)], check=True, timeout=300,
                 capture_output=True)
  wheel, = (tmp_path / "wheels").glob("jaxckpt-*.whl")
  files = [n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n]
  assert files and not [n for n in files if not n.startswith("jaxckpt/")], files
  assert not [n for n in files if n.endswith("_test.py")]
  testing = {pathlib.PurePosixPath(n).stem for n in files if n.startswith("jaxckpt/testing/")}
  assert testing == _SHIPPED_TESTING, sorted(testing ^ _SHIPPED_TESTING)
  for f in sorted((_ROOT / "jaxckpt").rglob("*.py")):
    if not f.name.endswith("_test.py"):
      harness = sorted(m for m in _imports(f) if m.split(".")[0] in ("tests", "tools"))
      assert not harness, f"{f.relative_to(_ROOT)} imports {harness}"
  # The goodput simulator is research code (tools/goodput/): the wheel holds what
  # `jaxckpt plan` needs (the closed forms), and the installed `jaxckpt plan` runs without it.
  goodput = {pathlib.PurePosixPath(n).name for n in files if n.startswith("jaxckpt/goodput/")}
  assert goodput == {"__init__.py", "_research.py", "closed_form.py", "inputs.py", "plan.py"}, goodput
  assert not [n for n in files if pathlib.PurePosixPath(n).name in (
      "simulator.py", "plots.py", "simulate_cli.py")]
  site = tmp_path / "site"
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                  "--target", str(site), str(wheel)], check=True, timeout=300, capture_output=True)
  env = dict(os.environ, PYTHONPATH=str(site))           # the wheel's jaxckpt, no checkout
  run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
  plan = run([sys.executable, "-m", "jaxckpt", "plan", "--state-gib-per-host", "8",
              "--host-ram-gib", "512", "--hosts", "64", "--step-secs", "1", "--storage-gbps", "1"])
  assert plan.returncode == 0 and "recommended: " in plan.stdout, plan.stderr[-3000:]
  where = run([sys.executable, "-c", "import jaxckpt; print(jaxckpt.__file__)"])
  assert where.stdout.startswith(str(site)), (where.stdout, where.stderr[-2000:])
  sim = run([sys.executable, "-m", "jaxckpt", "simulate", "--from-benchmarks", "measured"])
  assert sim.returncode == 2 and "tools/goodput/" in sim.stderr and "checkout" in sim.stderr, (
      sim.returncode, sim.stdout[-2000:], sim.stderr[-2000:])


def test_the_layers_import_only_downwards():
  """docs/architecture.md's directions: the tiers below the manager never import the
  agent, the manager or the replica groups, and host/net/parity never import JAX
  (the agent process runs them), but for net._kv, the trainer's side only."""
  above = ("jaxckpt.agent", "jaxckpt.manager", "jaxckpt.ft")
  for pkg in ("host", "net", "parity", "universal", "capture", "restore"):
    for f in sorted((_ROOT / "jaxckpt" / pkg).glob("*.py")):
      if f.name.endswith("_test.py"):
        continue
      bad = sorted(m for m in _imports(f) if m.startswith(above))
      assert not bad, f"{f.relative_to(_ROOT)} imports {bad}"
      if pkg in ("host", "net", "parity") and f.name != "_kv.py":
        jax = sorted(m for m in _imports(f) if m == "jax" or m.startswith("jax."))
        assert not jax, f"{f.relative_to(_ROOT)} imports {jax}"
  assert not [m for m in _imports(_ROOT / "jaxckpt" / "options.py")
              if m.startswith(above + ("jaxckpt.host", "jaxckpt.net", "jaxckpt.restore"))]


def _arrows_tool():
  spec = importlib.util.spec_from_file_location("import_arrows", _ROOT / "tools" / "import_arrows.py")
  tool = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = tool        # (its dataclasses look their module up)
  spec.loader.exec_module(tool)
  return tool


# The imports left that run upward against docs/architecture.md's Directions: the root's
# names for type checkers only. None may be added.
_UPWARD_LEFT = {
    # the root's names for type checkers (at run time they resolve on first use)
    ("jaxckpt", "jaxckpt.ft"), ("jaxckpt", "jaxckpt.parity"), ("jaxckpt", "jaxckpt.universal"),
    ("jaxckpt", "jaxckpt.restore._read"), ("jaxckpt", "jaxckpt.manager"),
    ("jaxckpt", "jaxckpt.options"), ("jaxckpt", "jaxckpt.parity.placement"),
}


def test_no_import_runs_upward_but_those_named():
  """tools/import_arrows.py reads every import (top-level, in a function, or for type
  checkers) against the Directions; the host tier's persister is handed its writer and
  arrays are assembled below both restore and universal, so neither arrow is back; the
  test harness left the package and orbax's import/export lives in orbax/ (reading
  orbax's files stays in universal, for restores in place), so the only arrows left are
  the root's for type checkers."""
  tool = _arrows_tool()
  arrows = tool.arrows()
  found = {(i.module, i.target) for i in arrows}
  assert found <= _UPWARD_LEFT, sorted(found - _UPWARD_LEFT)
  assert all(i.module == "jaxckpt" and i.kind == "type-checking" for i in arrows), arrows
  assert tool.direction("jaxckpt.host._persist", "jaxckpt.universal") == "upward"
  assert tool.direction("jaxckpt.universal._read", "jaxckpt.arrays._assemble") == "down"
  assert tool.direction("jaxckpt.net._wire", "jaxckpt.parity") == "sideways"


def test_the_root_holds_the_public_surface_only():
  names = sorted(f.stem for f in (_ROOT / "jaxckpt").glob("*.py") if not f.stem.endswith("_test"))
  assert names == ["__init__", "__main__", "cli", "errors", "manager", "options", "tree"], names


# Import name -> the distribution that provides it, where they differ.
_DISTRIBUTIONS = {"zmq": "pyzmq", "yaml": "pyyaml", "orbax": "orbax-checkpoint",
                  "etils": "etils"}


def test_every_package_the_library_imports_is_declared():
  """A package the library imports arrives because pyproject.toml names it (core, or the
  extra of the only module that needs it), never only through another package (rich
  came only through flax)."""
  project = tomllib.loads((_ROOT / "pyproject.toml").read_text())["project"]
  declared = {d.split(";")[0].split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip()
              .lower() for d in project["dependencies"]}
  extras = {d.split("[")[0].split(">")[0].split("=")[0].strip().lower()
            for ds in project["optional-dependencies"].values() for d in ds}
  imported: dict[str, str] = {}
  for f in sorted((_ROOT / "jaxckpt").rglob("*.py")):
    rel = f.relative_to(_ROOT)
    if f.name.endswith("_test.py") or "testing" in rel.parts or f.stem == "conftest":
      continue
    for node in ast.walk(ast.parse(f.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
               else [])
      for name in names:
        top = name.split(".")[0]
        if top != "jaxckpt" and top not in sys.stdlib_module_names:
          imported.setdefault(top, str(rel))
  missing = {m: where for m, where in imported.items()
             if _DISTRIBUTIONS.get(m, m).lower().replace("_", "-") not in
             {d.replace("_", "-") for d in declared}
             and not (m in ("matplotlib", "flax", "optax") and m in extras | declared)}
  assert "rich" in imported and not missing, f"imported but not declared: {missing}"

