"""jaxckpt's own test harness: the worker processes, launchers and fixtures that the
suite and ``benchmarks/`` use, kept out of the package (the wheel holds only
``jaxckpt/``; what users test with is ``jaxckpt.testing``).

Import it from the repository root (``from tests.support import soak``); workers run as
``python -m tests.support.job_worker ...`` with the root on ``PYTHONPATH``, which the
root ``conftest.py`` and ``benchmarks/_repo.py`` set for every process they start.
"""
