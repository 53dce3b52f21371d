"""Runs the ``>>>`` examples in the docstrings of the test harness's modules, as
``docs/docstrings_test.py`` runs the package's (the harness left the package, and its
examples, e.g. starting SeaweedFS or an etcd cluster, still run as written)."""

from __future__ import annotations

import doctest
import importlib
import pathlib

import pytest

_HERE = pathlib.Path(__file__).resolve().parent


def _modules() -> list[str]:
  """The harness's modules with examples (its worker scripts are run, not imported)."""
  return sorted(f"tests.support.{f.stem}" for f in _HERE.glob("*.py")
                if not f.stem.endswith("_test") and ">>>" in f.read_text())


def test_every_module_is_collected():
  names = _modules()
  assert "tests.support.soak" in names and "tests.support.ft_simulate" in names
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
