"""An orbax checkpoint at a URL is refused by import and export, naming what to do: orbax's
side of both is a local directory. An export to gs://b/x wrote ./gs:/b/x (with a KeyError
traceback), and an import of one said that ./gs:/b/x does not exist."""

import os

import numpy as np
import pytest

import jaxckpt.universal as u
from jaxckpt import cli, errors
from jaxckpt.orbax import interop as ox
from tests.support import fixtures as _fixtures


def _universal(d: str) -> str:
  (manifest, buf), = _fixtures.host_snapshots(1, {"['w']": np.arange(6.0)})
  u.write_process_shards(d, manifest, buf, attempt="t")
  u.commit_step(d, 1, process_count=1, timeout_secs=10, attempt="t")
  return d


def test_an_orbax_checkpoint_at_a_url_is_refused_naming_what_to_do(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  src = _universal(str(tmp_path / "u"))
  assert cli.main(["export-orbax", src, "gs://bucket/x"]) == 2
  said = capsys.readouterr().err
  assert ("orbax checkpoint 'gs://bucket/x' is a URL: jaxckpt writes orbax checkpoints in local "
          "directories only; export to a local directory and copy that (e.g. gcloud storage cp "
          "-r DIR gs://bucket/x)") in said, said
  assert sorted(os.listdir(tmp_path)) == ["u"]                   # nothing written at ./gs:
  for argv in (["import-orbax", "s3://bucket/x", str(tmp_path / "v")],
               ["import-orbax", "gs://bucket/x", str(tmp_path / "v"), "--step", "3"]):
    assert cli.main(argv) == 2
    said = capsys.readouterr().err
    assert (f"orbax checkpoint {argv[1]!r} is a URL: jaxckpt reads orbax checkpoints in local "
            f"directories only; copy it to a local directory first (e.g. gcloud storage cp -r "
            f"{argv[1]} DIR) and import that") in said, said
  with pytest.raises(errors.InvalidArgumentError, match="'gs://bucket/x' is a URL"):
    ox.import_orbax("gs://bucket/x", str(tmp_path / "v"))
  assert sorted(os.listdir(tmp_path)) == ["u"]


def test_a_file_url_is_the_local_directory(tmp_path):
  src = _universal(str(tmp_path / "u"))
  out = ox.export_orbax(src, f"file://{tmp_path}/orbax")
  assert out == str(tmp_path / "orbax")
  assert ox.import_orbax(f"file://{out}", str(tmp_path / "back")) == 0
  back = u.open_step(str(tmp_path / "back"), 0)
  np.testing.assert_array_equal(back.read("['w']"), np.arange(6.0))
