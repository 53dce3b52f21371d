"""README.md's first screen: what each term means before it is used, the orbax port, and
how long the tests take; its two commands stay as .ci/run reads them."""

from __future__ import annotations

import pathlib
import re

_ROOT = pathlib.Path(__file__).resolve().parent.parent
TERMS = ("host snapshot", "snapshot agent", "parity", "universal format", "replica groups")


def _readme() -> str:
  return (_ROOT / "README.md").read_text()


def _first_screen() -> str:
  """Up to the end of the first example."""
  text = _readme()
  return text[:text.index("```", text.index("```python") + 3)]


def test_each_term_is_defined_where_it_is_first_used():
  text = _readme().lower()
  for term in TERMS:
    first = text.index(term)
    assert text[first - 2:first] == "**" and text[first + len(term):].startswith("**"), term
  assert "(ft-hsdp, fault-tolerant hybrid-sharded data parallelism)" in text
  assert text.index("ft-hsdp") > text.index("**replica groups**")


def test_an_orbax_user_finds_the_port_and_the_import_command():
  screen = _first_screen()
  assert "**Coming from orbax?**" in screen and "`jaxckpt import-orbax ORBAX_DIR NEW_DIR`" in screen
  link, = re.findall(r"\]\((docs/howto\.md#[^)]+)\)", screen)
  page, anchor = link.split("#")
  headings = re.findall(r"^## (.+)$", (_ROOT / page).read_text(), re.M)
  slugs = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in headings}
  assert anchor in slugs and anchor == "port-an-orbax-training-loop"


def test_the_two_commands_and_how_long_the_tests_take():
  screen = _first_screen()
  assert "\n    pip install -e . && python examples/train_flax.py --steps 20\n" in screen
  assert "\n    pip install -e \".[test]\" && python -m pytest -q -n 2\n" in screen
  assert "Install and run the tests (about 20-25 minutes on 2 cores, two at a time):" in screen
  ci = (_ROOT / ".ci" / "run").read_text()
  assert "readme_command 'pip install -e \\. '" in ci
