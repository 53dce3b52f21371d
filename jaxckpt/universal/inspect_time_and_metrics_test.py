"""What a user sees of a step an orbax-style manager saved: `inspect` shows its save time and
metrics as such, not jaxckpt's own metadata keys."""

from __future__ import annotations

import re

import numpy as np
import orbax.checkpoint as ocp

import jaxckpt as jc
from jaxckpt import cli


def test_inspect_shows_the_save_time_and_metrics_not_jaxckpt_s_keys(tmp_path, capsys):
  d = str(tmp_path / "ck")
  opts = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")
  with jc.CheckpointManager(d, opts) as m:
    m.save(3, args=ocp.args.StandardSave({"w": np.ones(3, np.float32)}), metrics={"loss": 0.25},
           custom_metadata={"run": "a"})
  assert cli.main(["inspect", d]) == 0
  out = capsys.readouterr().out
  assert "jaxckpt." not in out, out
  assert re.search(r"^saved at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$", out, re.M), out
  assert 'metrics: {"loss": 0.25}' in out, out
  assert 'metadata: {"run": "a"}' in out, out
