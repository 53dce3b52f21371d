"""`jaxckpt plan` on finite inputs too far out for its model: a clear error and exit 2,
never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

BASE = {"state-gib-per-host": "8", "host-ram-gib": "512", "hosts": "64", "step-secs": "1",
        "storage-gbps": "1"}


@pytest.mark.parametrize("name,value", [("state-gib-per-host", "1e308"),
                                        ("step-secs", "1e-320"), ("host-ram-gib", "1e308"),
                                        ("storage-gbps", "1e-320")])
@pytest.mark.parametrize("as_json", [False, True])
def test_absurd_finite_inputs_exit_2_with_the_reason_and_no_traceback(name, value, as_json):
  argv = [x for k, v in {**BASE, name: value}.items() for x in ("--" + k, v)]
  p = subprocess.run([sys.executable, "-m", "jaxckpt", "plan", *argv,
                      *(["--json"] if as_json else [])],
                     capture_output=True, text=True, timeout=120, check=False)
  assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
  assert "Traceback" not in p.stderr and p.stdout == ""
  assert p.stderr.startswith("jaxckpt plan: ") and f"--{name}" in p.stderr, p.stderr
  assert "must be between" in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr
