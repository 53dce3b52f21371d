"""The job's secret file (agent/_paths.job_secret) is read only as what jaxckpt wrote: a
plain file of the user's, mode 0600. A link (to a file of the user's, or dangling), a
directory, a FIFO (an open of which would block for ever) or bytes that are no text put
in its place are refused with a PermissionDeniedError naming the file and the fix (remove
it), never followed, never a bare OSError or UnicodeDecodeError."""

import os

import pytest

from jaxckpt import errors
from jaxckpt.agent import _paths


def _plant(tmp_path, how):
  root = str(tmp_path / "root")
  _paths.job_secret(root, "j")                      # the job's first start writes it
  path = os.path.join(_paths.job_dir(root, "j"), "secret")
  os.unlink(path)
  other = tmp_path / "attacker"
  other.write_text("ATTACKER")
  other.chmod(0o600)
  if how == "link":
    os.symlink(other, path)
  elif how == "dangling link":
    os.symlink(tmp_path / "nothing", path)
  elif how == "directory":
    os.mkdir(path, 0o700)
  elif how == "fifo":
    os.mkfifo(path, 0o600)
  elif how == "not text":
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"\xff\xfe\x00secret")
    os.close(fd)
  return root, path


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["link", "dangling link", "directory", "fifo", "not text"])
def test_a_secret_file_that_jaxckpt_did_not_write_is_refused_naming_it(tmp_path, how):
  root, path = _plant(tmp_path, how)
  with pytest.raises(errors.PermissionDeniedError, match=rf"job secret {path} .*remove it"):
    _paths.job_secret(root, "j")
