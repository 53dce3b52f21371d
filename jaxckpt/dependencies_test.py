"""The library imports only its runtime dependencies: test and example packages live in extras."""

import pathlib
import subprocess
import sys
import tomllib

_ROOT = pathlib.Path(__file__).resolve().parent.parent
# modules that are test helpers or examples by design (they need the `examples` extra)
_EXTRA_ONLY = {"jaxckpt.ft._toy"}


def _library_modules() -> list[str]:
  mods = []
  for f in sorted((_ROOT / "jaxckpt").rglob("*.py")):
    rel = f.relative_to(_ROOT).with_suffix("")
    name = ".".join(rel.parts)
    if (f.name.endswith("_test.py") or f.name in ("conftest.py", "__main__.py")
        or "testing" in rel.parts or name.endswith("._fixtures") or name in _EXTRA_ONLY):
      continue
    mods.append(name.removesuffix(".__init__"))
  return mods


def test_extras_hold_flax_optax_reedsolo():
  project = tomllib.loads((_ROOT / "pyproject.toml").read_text())["project"]
  runtime = " ".join(project["dependencies"])
  for pkg in ("flax", "optax", "reedsolo"):
    assert pkg not in runtime, pkg
  assert any(d.startswith("flax") for d in project["optional-dependencies"]["examples"])
  assert any(d.startswith("reedsolo") for d in project["optional-dependencies"]["test"])


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
