"""Prints each jaxckpt module's jaxckpt imports and flags those that run upward.

The order is docs/architecture.md's "Directions", lowest first (``LAYERS``). An
import is *upward* when it names a module of a higher layer, *sideways* when it
names another package of the same layer; imports inside one package are not
arrows. Every import counts, wherever it is: at the top of the module, inside a
function (``function``), or under ``if TYPE_CHECKING:`` (``type-checking``).

    python tools/import_arrows.py            # every module's imports, arrows marked
    python tools/import_arrows.py --arrows   # the upward and sideways ones only
    python tools/import_arrows.py --json     # the arrows as JSON
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxckpt"

# docs/architecture.md's Directions, lowest first: a layer may import any layer below it.
# "jaxckpt" is the package's __init__ (its names are resolved on first use).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("util._text",),
    ("errors",),
    ("jaxckpt",),
    ("util",),
    ("host",),
    ("net", "parity"),
    ("options", "tree", "arrays"),
    ("universal",),
    ("capture", "restore"),
    ("agent",),
    ("core",),
    ("orbax",),
    ("manager",),
    ("ft", "goodput"),
    ("testing",),
    ("cli",),
    ("__main__",),
)
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


@dataclasses.dataclass(frozen=True)
class Import:
  """One import of a jaxckpt module by another."""

  module: str          # the importing module (jaxckpt.host._persist)
  target: str          # the module it names (jaxckpt.universal)
  line: int
  kind: str            # top | function | type-checking
  direction: str       # down | within | sideways | upward

  def __str__(self) -> str:
    mark = "" if self.direction in ("down", "within") else f"  <-- {self.direction.upper()}"
    return f"{self.module}:{self.line} -> {self.target} ({self.kind}){mark}"


def unit(module: str) -> str:
  """The layer's unit a module belongs to: its subpackage or root module (``util._text``,
  which imports nothing, is a unit of its own below ``errors``)."""
  parts = module.split(".")
  if parts[1:3] == ["util", "_text"]:
    return "util._text"
  return parts[1] if len(parts) > 1 else parts[0]


def _is_module(name: str) -> bool:
  rel = pathlib.Path(*name.split(".")[1:])
  return (PACKAGE / rel).with_suffix(".py").is_file() or (PACKAGE / rel / "__init__.py").is_file()


def _module_name(path: pathlib.Path) -> str:
  rel = path.relative_to(ROOT).with_suffix("")
  return ".".join(rel.parts).removesuffix(".__init__")


def _targets(node: ast.AST, module: str, is_package: bool) -> list[str]:
  """The jaxckpt modules an import statement names."""
  if isinstance(node, ast.Import):
    return [a.name for a in node.names if a.name.split(".")[0] == "jaxckpt"]
  if not isinstance(node, ast.ImportFrom):
    return []
  base = node.module or ""
  if node.level:
    parts = module.split(".")[:len(module.split(".")) - node.level + (1 if is_package else 0)]
    base = ".".join(parts + ([base] if base else []))
  if base.split(".")[0] != "jaxckpt":
    return []
  out = []
  for a in node.names:
    name = f"{base}.{a.name}"
    out.append(name if _is_module(name) else base)
  return out


def _walk(tree: ast.AST, kind: str = "top"):
  """(node, kind) of every import, with where it sits."""
  for child in ast.iter_child_nodes(tree):
    if isinstance(child, (ast.Import, ast.ImportFrom)):
      yield child, kind
    elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      yield from _walk(child, "function" if kind == "top" else kind)
    elif isinstance(child, ast.If) and _is_type_checking(child.test):
      for stmt in child.body:
        yield from _walk(ast.Module(body=[stmt], type_ignores=[]), "type-checking")
      for stmt in child.orelse:
        yield from _walk(ast.Module(body=[stmt], type_ignores=[]), kind)
    else:
      yield from _walk(child, kind)


def _is_type_checking(test: ast.AST) -> bool:
  return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
          or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def direction(module: str, target: str) -> str:
  a, b = unit(module), unit(target)
  if a == b:
    return "within"
  if a not in RANK or b not in RANK:
    raise KeyError(f"{a if a not in RANK else b!r} is in no layer of LAYERS: add it "
                   "where docs/architecture.md's Directions put it")
  if RANK[b] < RANK[a]:
    return "down"
  return "sideways" if RANK[b] == RANK[a] else "upward"


def imports(*, tests: bool = False) -> list[Import]:
  """Every jaxckpt import of the package's modules (test modules left out unless ``tests``)."""
  out = []
  for path in sorted(PACKAGE.rglob("*.py")):
    if path.name.endswith("_test.py") and not tests:
      continue
    module = _module_name(path)
    for node, kind in _walk(ast.parse(path.read_text(), str(path))):
      for target in dict.fromkeys(_targets(node, module, path.name == "__init__.py")):
        out.append(Import(module, target, node.lineno, kind, direction(module, target)))
  return out


def arrows() -> list[Import]:
  """The imports that run upward or sideways."""
  return [i for i in imports() if i.direction in ("upward", "sideways")]


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--arrows", action="store_true", help="print only upward and sideways imports")
  parser.add_argument("--json", action="store_true", help="print the arrows as JSON")
  args = parser.parse_args(argv)
  if args.json:
    print(json.dumps([dataclasses.asdict(i) for i in arrows()], indent=1))
    return 0
  shown = arrows() if args.arrows else imports()
  for i in shown:
    print(i)
  found = arrows()
  print(f"{len(found)} arrows against the Directions: "
        f"{sum(i.direction == 'upward' for i in found)} upward, "
        f"{sum(i.direction == 'sideways' for i in found)} sideways", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
