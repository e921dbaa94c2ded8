"""Inputs that broke the host-stack gradient change's neighbours: the placement verdict of a partly offloaded state
whose placement.json records no host bytes, and benchmark options that slipped past their command-line checks."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import requires_jax
from parity.report import placement_view


def test_a_mixed_class_without_host_bytes_is_as_planned_not_a_crash():
  """placement.json's schema lets a class's host_bytes be null (`_CLASS`: number or null): the report renders it
  ('n/a') and cannot state a share, rather than dividing None by the bytes."""
  p = {"classes": [{"class": "opt_state", "role": "argument", "memory_space": "mixed", "expected": "mixed",
                    "buffers": 4, "host_buffers": 2, "bytes": 4096, "host_bytes": None}], "mismatches": []}
  assert not [x for x in placement_view._placement_problems({**p, "schema": placement_view.PLACEMENT_SCHEMA})
              if "classes" in x]  # the reader accepts the row
  rows, flags = placement_view.class_rows(p)
  assert rows[0][-1] == "as planned" and flags == [False]
  p["classes"][0]["host_bytes"] = 1024
  assert placement_view.class_rows(p)[0][0][-1] == "as planned (25% of its bytes in host memory)"


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_confirming_run_limit_must_be_a_finite_number(value, capsys):
  """--confirm-timeout-s nan passed `<= 0` and became every confirming run's limit: min(nan, left) is nan, and a
  subprocess timeout of nan (or inf) waits for ever."""
  from benchmarks import gpu
  with pytest.raises(SystemExit) as exc:
    gpu.parse_args(["--confirm-timeout-s", value])
  err = capsys.readouterr().err
  assert exc.value.code == 2 and f"--confirm-timeout-s must be a finite number > 0; got {float(value)}" in err


@pytest.mark.parametrize("module, flag", [("benchmarks.tpu_parts.offload", "--grad-accum"),
                                          ("benchmarks.gpu", "--grad-accum")])
def test_a_digit_that_is_not_a_number_exits_2(module, flag, capsys):
  """'²' is a digit to str.isdigit but not to int(): the check passed it and int() raised (a traceback)."""
  import importlib
  mod = importlib.import_module(module)
  with pytest.raises(SystemExit) as exc:
    mod.parse_args(["--out", "x", flag, "2,²"])
  assert exc.value.code == 2 and f"{flag} '2,²': whole numbers > 0" in capsys.readouterr().err


@requires_jax
@pytest.mark.parametrize("precision, ratio", [("bf16", 1.0), ("fp16", 1.0), ("fp32", 0.5)])
def test_the_filled_trainer_is_the_fast_weights_trainer_in_every_precision(precision, ratio, monkeypatch):
  """--fast-init used to build the Trainer from common.fast_params, whose bf16/fp16 masters Trainer.build rounds to
  the compute dtype (parity.weights.master_weights): the in-place fill must start from those numbers, and build
  a run that offloads part of its optimizer state (abstract_trainer's placement needs the model for it)."""
  import jax
  from benchmarks.gpu_parts import sizing
  from benchmarks.gpu_parts.common import fast_params
  from benchmarks.gpu_parts.jax_train import filled_trainer
  from jax_impl import offload
  from jax_impl.step import Trainer

  run = sizing.grid_run(sizing.tiny_run(), "scan-offload" if ratio == 1 else "zero2-offload-scan", 64, 1)
  run = dataclasses.replace(run, train=dataclasses.replace(run.train, precision=precision),
                            jax=dataclasses.replace(run.jax, offload_opt_ratio=ratio)).validate()
  monkeypatch.setattr(offload, "PER_LEAF_BYTES", 0)  # the per-leaf path, as a large model takes it
  filled, built = filled_trainer(run), Trainer.build(run, fast_params(run.model))
  kinds = lambda st: [x.sharding.memory_kind for x in jax.tree.leaves(st)]
  assert kinds(filled.state) == kinds(built.state)
  if ratio < 1:
    assert len(set(kinds(filled.state.opt_state))) == 2  # the split is real: moments in both kinds
  for a, b in zip(jax.tree.leaves(filled.state), jax.tree.leaves(built.state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
