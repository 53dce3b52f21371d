"""The repository root on a benchmark's import path and on that of every process it starts.

The benchmarks run as scripts (``python benchmarks/soak.py``), so Python puts ``benchmarks/``
first on the path, not the root: the test harness (``tests/support``, not part of the
installed package) is found through the root, and so are its workers
(``python -m tests.support.job_worker``), which inherit ``PYTHONPATH``. Import this module
before ``tests.support``.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
_paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
if ROOT not in _paths:
  os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *_paths])
