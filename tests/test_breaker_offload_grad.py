"""Inputs that broke the host-stack gradient change's neighbours: the placement verdict of a partly offloaded state
whose placement.json records no host bytes, and benchmark options that slipped past their command-line checks."""
from __future__ import annotations

import pytest

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
  assert exc.value.code == 2 and f"--confirm-timeout-s must be > 0; got {float(value)}" in capsys.readouterr().err


@pytest.mark.parametrize("module, flag", [("benchmarks.tpu_parts.offload", "--grad-accum"),
                                          ("benchmarks.gpu", "--grad-accum")])
def test_a_digit_that_is_not_a_number_exits_2(module, flag, capsys):
  """'²' is a digit to str.isdigit but not to int(): the check passed it and int() raised (a traceback)."""
  import importlib
  mod = importlib.import_module(module)
  with pytest.raises(SystemExit) as exc:
    mod.parse_args(["--out", "x", flag, "2,²"])
  assert exc.value.code == 2 and f"{flag} '2,²': whole numbers > 0" in capsys.readouterr().err
