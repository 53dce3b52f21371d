"""docs/equinox.md: the page's python blocks run as written, in order, as one program."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

_PAGE = pathlib.Path(__file__).resolve().parent / "equinox.md"


def test_the_equinox_page_runs_as_written(tmp_path):
  src = "\n".join(re.findall(r"```python\n(.*?)```", _PAGE.read_text(), re.S))
  assert "eqx.filter_eval_shape" in src
  proc = subprocess.run([sys.executable, "-c", src], cwd=tmp_path, capture_output=True, text=True,
                        timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.splitlines() == ["3 host", "bit-exact: True | same outputs: True",
                                      "combined: True"]
