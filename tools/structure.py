"""The house's structure figures, as JSON: what a maintainer reads the shape of the
package by (issue 49's "Must show").

- ``lines``: lines of each subpackage's (and root module's) code, test modules left out;
- ``largest_classes``: the ten longest classes (first line to last), with their file;
- ``import_circles``: the circles of the module import graph (its strongly connected
  parts of more than one module; every import counts, wherever it sits: at the top, in
  a function, under ``if TYPE_CHECKING:``), each as its modules;
- ``arrows_back_up``: the imports that run upward against docs/architecture.md's
  Directions (``tools/import_arrows.py``), and the sideways ones;
- ``any_per_1000_lines``: the uses of ``typing.Any`` (the name ``Any`` or
  ``typing.Any`` in an expression or annotation) per 1,000 lines of code.

    python tools/structure.py                 # the figures, as JSON
    python tools/structure.py --out FILE      # and written to FILE
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import pathlib
import sys

if __package__ in (None, ""):
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from tools import import_arrows  # pylint: disable=wrong-import-position

PACKAGE = import_arrows.PACKAGE
ROOT = import_arrows.ROOT


def _code_files() -> list[pathlib.Path]:
  return [p for p in sorted(PACKAGE.rglob("*.py")) if not p.name.endswith("_test.py")]


def _unit(path: pathlib.Path) -> str:
  rel = path.relative_to(PACKAGE)
  return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def lines() -> dict[str, int]:
  """Lines of code per subpackage (or root module), test modules left out; ``total``."""
  out: dict[str, int] = collections.Counter()
  for p in _code_files():
    out[_unit(p)] += len(p.read_text().splitlines())
  result = dict(sorted(out.items(), key=lambda kv: -kv[1]))
  result["total"] = sum(out.values())
  return result


def largest_classes(n: int = 10) -> list[dict[str, object]]:
  """The ``n`` longest classes of the package's code."""
  found = []
  for p in _code_files():
    for node in ast.walk(ast.parse(p.read_text(), str(p))):
      if isinstance(node, ast.ClassDef):
        found.append({"class": node.name, "file": str(p.relative_to(ROOT)),
                      "lines": node.end_lineno - node.lineno + 1})
  return sorted(found, key=lambda c: -c["lines"])[:n]


def import_circles() -> list[list[str]]:
  """The strongly connected parts (more than one module) of the import graph (Tarjan)."""
  graph: dict[str, set[str]] = collections.defaultdict(set)
  for i in import_arrows.imports():
    if i.target != i.module:
      graph[i.module].add(i.target)
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on: set[str] = set()
  out: list[list[str]] = []

  def visit(v: str) -> None:   # (the graph is small: recursion is fine)
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      part = []
      while True:
        w = stack.pop()
        on.discard(w)
        part.append(w)
        if w == v:
          break
      if len(part) > 1:
        out.append(sorted(part))

  sys.setrecursionlimit(10000)
  for v in sorted(graph):
    if v not in index:
      visit(v)
  return sorted(out)


def arrows_back_up() -> dict[str, object]:
  found = import_arrows.arrows()
  return {"upward": sum(i.direction == "upward" for i in found),
          "sideways": sum(i.direction == "sideways" for i in found),
          "upward_imports": [str(i) for i in found if i.direction == "upward"]}


def any_per_1000_lines() -> dict[str, float]:
  uses = total = 0
  for p in _code_files():
    text = p.read_text()
    total += len(text.splitlines())
    for node in ast.walk(ast.parse(text, str(p))):
      if isinstance(node, ast.Name) and node.id == "Any":
        uses += 1
      elif isinstance(node, ast.Attribute) and node.attr == "Any":
        uses += 1
  return {"uses": uses, "lines": total, "per_1000": round(1000 * uses / max(total, 1), 1)}


def figures() -> dict[str, object]:
  circles = import_circles()
  return {"lines": lines(), "largest_classes": largest_classes(),
          "import_circles": {"count": len(circles), "circles": circles},
          "arrows_back_up": arrows_back_up(), "any": any_per_1000_lines()}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", help="also write the JSON to this file")
  args = parser.parse_args(argv)
  text = json.dumps(figures(), indent=1)
  print(text)
  if args.out:
    pathlib.Path(args.out).write_text(text + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
