"""Every name from a checkpoint that reaches a terminal is escaped: a
downloaded checkpoint whose Composite item names, Grain iterator keys, leaf paths or
key implementations hold escape sequences (clear the screen, set the window title,
write the clipboard with OSC 52) or newlines cannot act on its user's terminal
through `jaxckpt inspect`, `verify`, `convert --dry-run` or any jaxckpt error."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt.orbax import _items
from jaxckpt.universal import _saved_items as items
from jaxckpt.util._text import shown

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLIPBOARD = "\x1b]52;c;cm0gLXJmIH4=\x07"       # OSC 52: the terminal's clipboard
CLEAR = "\x1b[2J\x1b[H"
TITLE = "\x1b]0;pwned\x07"
BIDI = "\u202e"                                 # right-to-left override
CONTROL = ("\x1b", "\x07", "\x9b", "\u202e")


def _hostile(d: str) -> None:
  """A step whose names are escape sequences: a JSON item, a Grain item (its keys
  too), a plain leaf, a PRNG-style key implementation name, user metadata."""
  json_name, grain_name = f"meta{CLIPBOARD}", f"data{CLEAR}\nforged line"
  state = json.dumps({f"next_index{TITLE}": 7, "seed": 1}).encode()
  rows = _items.encode_row(state, grain_name)[None]
  leaf = f"['w{BIDI}{TITLE}']"
  infos = {
      items.path_of(json_name): jc.universal.LeafInfo(
          path=items.path_of(json_name), kind="scalar", value=json.dumps({f"lr{CLEAR}": 0.1})),
      items.path_of(grain_name): jc.universal.LeafInfo(
          path=items.path_of(grain_name), kind="numpy", shape=rows.shape, dtype="uint8"),
      leaf: jc.universal.LeafInfo(path=leaf, kind="numpy", shape=(4,), dtype="float32",
                                  key_impl=f"threefry{CLEAR}"),
  }
  sources = {items.path_of(grain_name): rows, leaf: np.arange(4, dtype=np.float32)}
  metadata = {items.ITEMS_KEY: {json_name: items.JSON, grain_name: items.GRAIN},
              f"user{TITLE}": f"value{CLIPBOARD}"}
  jc.universal.write_leaves(d, 1, infos, sources, metadata=metadata)


def _cli(*argv: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "jaxckpt", *argv], capture_output=True,
                        text=True, timeout=120, cwd=REPO, check=False)


def _clean(text: str) -> None:
  for c in CONTROL:
    assert c not in text, f"{c!r} reached the terminal: {text!r}"


def test_inspect_shows_hostile_item_names_grain_keys_and_paths_escaped(tmp_path):
  d = str(tmp_path / "ck")
  _hostile(d)
  p = _cli("inspect", d)
  assert p.returncode == 0, p.stderr
  _clean(p.stdout + p.stderr)
  assert "forged line" not in [line.strip() for line in p.stdout.splitlines()]
  assert "meta\\x1b]52;c;cm0gLXJmIH4=\\x07 (json)" in p.stdout, p.stdout
  assert "data\\x1b[2J\\x1b[H\\nforged line (grain iterator state):" in p.stdout, p.stdout
  assert "next_index\\x1b]0;pwned\\x07 = 7" in p.stdout, p.stdout
  assert "key_impl=threefry\\x1b[2J" in p.stdout, p.stdout
  for argv in (["inspect", d, "--json"], ["verify", d, "--no-progress"]):
    p = _cli(*argv)
    assert p.returncode == 0, p.stderr
    _clean(p.stdout + p.stderr)


def test_damage_naming_a_hostile_item_is_escaped_too(tmp_path):
  d = str(tmp_path / "ck")
  _hostile(d)
  leaf = items.path_of(f"data{CLEAR}\nforged line")
  from jaxckpt.testing import damage  # pylint: disable=import-outside-toplevel
  damage.flip_stored_byte(d, 1, leaf, (0, 0))            # its row's length is damaged
  p = _cli("inspect", d)
  assert p.returncode == 1 and "DAMAGED item" in p.stderr, p.stderr
  _clean(p.stdout + p.stderr)
  p = _cli("verify", d, "--no-progress")
  assert p.returncode == 1 and "DAMAGED step 1" in p.stdout, p.stdout
  _clean(p.stdout + p.stderr)


def test_convert_dry_run_shows_hostile_paths_escaped(tmp_path):
  d = str(tmp_path / "ck")
  _hostile(d)
  spec = tmp_path / "spec.yaml"
  spec.write_text("rules: []\n")
  p = _cli("convert", d, str(tmp_path / "out"), "--spec", str(spec), "--dry-run")
  assert p.returncode == 0, p.stderr
  _clean(p.stdout + p.stderr)
  assert "\\u202e" in p.stdout, p.stdout


@pytest.mark.parametrize("name", [CLIPBOARD, CLEAR, TITLE, BIDI, "a\nb", "a\rb", "\x00\x7f"])
def test_no_jaxckpt_error_message_carries_a_control_character(name):
  for e in (errors.CorruptSnapshotError(f"leaf {name}"), errors.StorageError(5, f"{name}"),
            errors.ManifestError(name)):
    assert str(e).isprintable(), repr(str(e))
  assert shown(f"x{name}y").isprintable()
  assert shown("naïve – 日本") == "naïve – 日本"
