"""`parity port --verify` names every fp16 loss-scale behaviour its run never hit.

In process: `loss_scale_not_exercised` replays the run's own gradient draws (the seeded draws both sides make) with
neighbouring settings; no subprocess runs here.
"""
from __future__ import annotations

import numpy as np

from parity.migrate import Flags, port_config
from parity.migrate.verify import VerifyOutcome, _reference_params, loss_scale_not_exercised

FLAGS = Flags(world_size=1)
BASE = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}}


def _ported(**fp16):
  res = port_config({**BASE, "fp16": {"enabled": True, **fp16}}, FLAGS, source="crafted")
  assert res.ported is not None, res.report.errors
  return res.ported.to_dict()


def _names(items):
  return " | ".join(items)


def test_no_overflow_names_the_skip_hysteresis_and_min_scale():
  """The issue's case (stage 1, hysteresis 2, consecutive_hysteresis true) with a scale no gradient overflows:
  nothing but the initial scale ran."""
  p = _ported(loss_scale=0, initial_scale_power=8, hysteresis=2, consecutive_hysteresis=True, min_loss_scale=1)
  got = _names(loss_scale_not_exercised(p, 200, 0))
  for part in ("the overflow skip (no step of 200 overflowed)", "fp16.hysteresis 2", "fp16.consecutive_hysteresis",
               "fp16.min_loss_scale", "fp16.loss_scale_window 1000", "the scale doubling"):
    assert part in got, got


def test_overflows_exercise_hysteresis_but_not_the_window_or_the_floor():
  """2**16 overflows the first steps (max|g| ~ 3): the skip and the hysteresis ran; in 200 steps no 1000-step window
  ends and the scale never reaches min_loss_scale 1."""
  p = _ported(loss_scale=0, initial_scale_power=16, hysteresis=2, min_loss_scale=1)
  got = loss_scale_not_exercised(p, 200, 0)
  text = _names(got)
  assert "overflow skip" not in text and "fp16.hysteresis 2" not in text
  assert "fp16.min_loss_scale" in text and "the scale doubling" in text and "fp16.loss_scale_window" in text
  _, _, scales = _reference_params(p, 200, 0)  # the reference run agrees: it halved, never doubled
  assert scales[0] == 2 ** 16 and scales.min() < 2 ** 16 and not (np.diff(scales) > 0).any()


def test_a_short_window_and_a_high_floor_are_exercised():
  """A 5-step window doubles within 200 steps; a floor of 2**15, which max|g| * 2**15 > 65504 keeps hitting, clamps."""
  window = _names(loss_scale_not_exercised(_ported(loss_scale=0, initial_scale_power=16, hysteresis=1,
                                                   loss_scale_window=5, min_loss_scale=1), 200, 0))
  assert "fp16.loss_scale_window" not in window and "doubling" not in window, window
  floor = _names(loss_scale_not_exercised(_ported(loss_scale=0, initial_scale_power=16, hysteresis=1,
                                                  min_loss_scale=32768), 200, 0))
  assert "fp16.min_loss_scale" not in floor, floor


def test_a_replay_that_is_not_the_run_claims_nothing():
  p = _ported(loss_scale=0, initial_scale_power=16)
  observed = (np.full(10, 2.0 ** 16), np.zeros(10, bool))  # not what these draws give at 2**16
  assert loss_scale_not_exercised(p, 10, 0, observed)[0].startswith("the fp16 loss-scale settings")


def test_summary_lists_them_under_not_exercised():
  out = VerifyOutcome(True, 200, 0.0, 0.0, 0.5, 0.5, "engine", [], None,
                      not_exercised=["the overflow skip (no step of 200 overflowed)"], scale_steps=200)
  head = out.summary().splitlines()[0]
  assert "verify: OK for what ran; NOT exercised: the overflow skip" in head
