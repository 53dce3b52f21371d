"""Runs the ``>>>`` examples in the docstrings of every jaxckpt module, and of the
test harness's modules that have some (``tests/support``: e.g. starting SeaweedFS or an
etcd cluster), and of the goodput simulator's (``tools/goodput``).

The examples are part of the API reference (``docs/api.md``), so they must run
as written. Test modules and ``__main__`` modules are not imported (nor the harness's
worker scripts without examples: they are run, not imported).
"""

from __future__ import annotations

import doctest
import importlib
import pathlib
import pkgutil

import pytest

import jaxckpt

_SKIP_SUFFIXES = ("_test", "__main__")


def _modules() -> list[str]:
  root = pathlib.Path(jaxckpt.__file__).parent
  names = ["jaxckpt"]
  for info in pkgutil.walk_packages([str(root)], prefix="jaxckpt."):
    if info.name.endswith(_SKIP_SUFFIXES):
      continue
    names.append(info.name)
  support = pathlib.Path(__file__).resolve().parent.parent / "tests" / "support"
  names += [f"tests.support.{f.stem}" for f in support.glob("*.py")
            if not f.stem.endswith(_SKIP_SUFFIXES) and ">>>" in f.read_text()]
  research = support.parent.parent / "tools" / "goodput"    # (the simulator, not in the wheel)
  names += [f"tools.goodput.{f.stem}" for f in research.glob("*.py")
            if not f.stem.endswith(_SKIP_SUFFIXES) and ">>>" in f.read_text()]
  return sorted(names)


def test_every_module_is_collected():
  names = _modules()
  assert "jaxckpt.manager" in names and "jaxckpt.universal.convert" in names
  assert "tests.support.soak" in names and "tests.support.ft_simulate" in names
  assert "tools.goodput.simulator" in names
  assert not [n for n in names if n.endswith("_test")]


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name: str):
  module = importlib.import_module(name)
  finder = doctest.DocTestFinder(exclude_empty=True)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  for test in finder.find(module, name):
    runner.run(test)
  results = runner.summarize(verbose=False)
  assert results.failed == 0, f"{results.failed} docstring example(s) of {name} failed (see stdout)"
