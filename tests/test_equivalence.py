"""--equivalence ga,ranks,packing: the option, its refusals, the rerun folders' arrays (the same
examples at every optimizer step) and the check from two runs' records. In-process: real run folders from
prepare_run_dir, fake step records for the checks (no side is started)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from parity.report.run_record import RunRecord

from harness.runner import SideRun
from parity.errors import SpecError
from parity.pipeline.compare import RunOptions, check_run_options
from parity.pipeline.equivalence import (EQUIVALENCE_LOSS, check_equivalence, equivalence_metric, equivalence_outcome,
                                         equivalence_section, parse_equivalence)
from parity.pipeline.equivalence_inputs import EquivalenceInputError, prepare_equivalence, rerun_train
from parity.pipeline.folder import prepare_run_dir
from parity.presets import preset
from parity.report.equivalence_view import equivalence_lines, equivalence_rows
from parity.dataset.demo import short_prompt_jsonl
from parity.report.read import check_contradictions
from parity.overrides import apply_overrides
from parity.verdict.sides import verdict


def _short_examples(path, n=120, seed=3):
  return short_prompt_jsonl(path, n, seed, lengths=(8, 60))


def _spec(tmp_path, **overrides):
  data = str(_short_examples(tmp_path / "short.jsonl"))
  base = {"train.steps": 3, "train.seq_len": 64, "train.eval_every": 2, "data": data, "train.layout": "packed"}
  return apply_overrides(preset("sft-tiny"), {**base, **overrides}).validate()


# ------------------------------------------------------------------ the option and its refusals
def test_kinds_parse_from_a_comma_string_or_a_list_in_a_fixed_order():
  assert parse_equivalence("packing, ga") == ("ga", "packing")
  assert parse_equivalence(["ranks", "ga,packing"]) == ("ga", "ranks", "packing")
  assert parse_equivalence(None) == () and parse_equivalence(()) == () and RunOptions().equivalence == ()
  for empty in ("", ",", " , "):  # asked for checks, named none: refused, not a run with none
    with pytest.raises(SpecError, match="names no check"):
      parse_equivalence(RunOptions(equivalence=empty).equivalence)
  assert RunOptions(equivalence="ga,ranks").equivalence == ("ga", "ranks")
  for slip in ("ga,", "ga,ga", "ga, ,packing"):  # a slip is refused, not read as some check
    with pytest.raises(SpecError, match="empty or repeated item"):
      parse_equivalence(RunOptions(equivalence=slip).equivalence)
  with pytest.raises(SpecError, match=r"--equivalence grad: not an equivalence check; choose from ga, ranks, packing"):
    parse_equivalence("ga,grad")


def test_checks_that_cannot_apply_are_refused_naming_the_option_and_the_fix():
  stream = preset("gpt2-tiny")
  with pytest.raises(SpecError, match=r"--equivalence ga .*grad_accum_steps is 1; set --set train.grad_accum_steps=2"):
    check_equivalence(stream, ["ga"])
  with pytest.raises(SpecError, match=r"--equivalence packing .*train.layout is 'stream'.*--preset sft-tiny"):
    check_equivalence(stream, ["packing"])
  odd = apply_overrides(stream, {"train.micro_batch_size": 3})
  with pytest.raises(SpecError, match=r"--equivalence ranks reruns the 1-rank run on 2 ranks"):
    check_equivalence(odd, ["ranks"])
  check_equivalence(preset("sft-tiny"), ["ga", "ranks", "packing"])  # GA 2, padded, micro batch 4: all apply
  with pytest.raises(SpecError, match="--equivalence packing"):  # before any side starts (the CLI: exit 2)
    check_run_options(stream, {}, RunOptions(equivalence="packing"))


def test_the_rerun_shapes_keep_the_examples_of_every_step():
  spec = preset("sft-tiny")  # GA 2 x micro 4, padded
  assert rerun_train(spec, "ga", 1, 8) == ({"eval_every": 0, "grad_accum_steps": 1, "micro_batch_size": 8}, 1)
  assert rerun_train(spec, "ranks", 1, 8) == ({"eval_every": 0}, 2)
  assert rerun_train(spec, "ranks", 2, 8) == ({"eval_every": 0}, 1)
  assert rerun_train(spec, "packing", 1, 8)[0] == {"eval_every": 0, "layout": "packed", "examples_per_step": 8}
  packed = apply_overrides(spec, {"train.layout": "packed"})
  # 11 pieces over GA 2: ceil(11 / 2) = 6 rows per micro batch (a multiple of the 2 ranks)
  assert rerun_train(packed, "packing", 2, 11)[0]["micro_batch_size"] == 6


# ------------------------------------------------------------------ the rerun folders
@pytest.fixture(scope="module")
def packed_run(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("eq")
  spec = _spec(tmp)
  prepare_run_dir(spec, tmp / "run")
  return spec, tmp / "run"


def test_the_ga_rerun_holds_the_very_same_rows_reshaped(packed_run):
  spec, run = packed_run
  prep = prepare_equivalence(run, "ga", spec)
  sub = prep["folder"]
  req = json.loads((sub / "request.json").read_text())
  assert req["run"]["train"]["grad_accum_steps"] == 1 and req["run"]["train"]["micro_batch_size"] == 8
  assert req["batches"] == "batches.npy" and req["examples"]["val_arrays"] is None
  for name in ("batches", "loss_mask", "segment_ids", "positions"):
    a, b = np.load(run / f"{name}.npy"), np.load(sub / f"{name}.npy")
    assert b.shape == (a.shape[0], 1, a.shape[1] * a.shape[2], *a.shape[3:])
    assert np.array_equal(a.reshape(b.shape), b)
  assert prep["loss_tokens_per_step"] == np.load(run / "loss_mask.npy").sum(axis=(1, 2, 3)).tolist()


def test_the_packing_rerun_lays_out_the_same_examples_padded(packed_run):
  spec, run = packed_run
  prep = prepare_equivalence(run, "packing", spec)
  sub, train = prep["folder"], prep["train"]
  main_seg, pad_seg = np.load(run / "segment_ids.npy"), np.load(sub / "segment_ids.npy")
  assert main_seg.max() >= 2 and pad_seg.max() == 1  # several examples per row, then one per row
  e = train["examples_per_step"]
  assert ((pad_seg.max(axis=-1) > 0).sum(axis=(1, 2)) == e).all()  # every step: E rows hold one example each
  per_step = lambda d: np.load(d / "loss_mask.npy").sum(axis=(1, 2, 3)).tolist()
  assert per_step(run) == per_step(sub) == prep["loss_tokens_per_step"]
  # the same tokens carry the loss in each step: the multiset of (target id) over loss slots is equal
  for s in range(spec.train.steps):
    tm, ts = np.load(run / "batches.npy")[s][..., 1:], np.load(sub / "batches.npy")[s][..., 1:]
    lm, ls = np.load(run / "loss_mask.npy")[s], np.load(sub / "loss_mask.npy")[s]
    assert sorted(tm[lm].tolist()) == sorted(ts[ls].tolist())


def test_the_ranks_rerun_runs_on_two_ranks_with_the_main_arrays(packed_run):
  spec, run = packed_run
  prep = prepare_equivalence(run, "ranks", spec)
  launch = json.loads((prep["folder"] / "launch.json").read_text())
  req = json.loads((prep["folder"] / "request.json").read_text())
  assert launch["nproc"] == 2 and req["batches"] == "../../batches.npy"


def test_a_changed_data_file_refuses_the_packing_rerun(tmp_path):
  spec = _spec(tmp_path)
  prepare_run_dir(spec, tmp_path / "run")
  _short_examples(tmp_path / "short.jsonl", seed=4)  # other examples under the same name
  with pytest.raises(EquivalenceInputError, match="could not be rebuilt from its examples"):
    prepare_equivalence(tmp_path / "run", "packing", spec)


# ------------------------------------------------------------------ the check
def _records(losses, grad_norms=None):
  return [{"step": i, "loss": x, "grad_norm": (grad_norms or [1.0] * len(losses))[i], "lr": 1e-3}
          for i, x in enumerate(losses)]


def _params(shift=0.0):
  return {"w": np.full((4, 4), 1.0 + shift, np.float32)}


_INIT = {"w": np.zeros((4, 4), np.float32)}
_OK = SideRun(side="jax", status="ok", returncode=0, wall_s=1.0, peak_rss_bytes=None, summary={}, error=None)


def _outcome(spec, rerun_losses, shift=0.0, status=_OK):
  main = {"status": "ok", "steps": _records([5.0, 4.9, 4.8]), "final": _params(), "moments": None}
  return equivalence_outcome("ga", "jax", main, status, _records(rerun_losses), _params(shift), None,
                             spec, _INIT)


def test_tokens_in_fp32_gates_and_passes_within_fp32_rounding():
  c, row = _outcome(preset("sft-tiny"), [5.0, 4.9 + 2e-7, 4.8])
  assert c.metric == "equivalence_ga" and c.gating and c.passed and c.sides == ("jax", "jax#ga")
  assert c.value == pytest.approx(2e-7, rel=1e-3) and c.tolerance == EQUIVALENCE_LOSS.atol
  assert row["worst_step"] == 1 and row["passed"] and row["params_ratio_max"] == 0.0


def test_tokens_in_fp32_fails_naming_the_first_step_past_the_bound():
  c, _ = _outcome(preset("sft-tiny"), [5.0, 4.9 + 3e-5, 4.8 + 1e-4])
  assert not c.passed and c.gating and c.first_failing_step == 1 and c.value == pytest.approx(1e-4, rel=1e-3)
  assert verdict([c], {"jax": "ok", "torch": "ok"}).passed is False


def test_far_apart_params_fail_even_when_the_losses_agree():
  c, row = _outcome(preset("sft-tiny"), [5.0, 4.9, 4.8], shift=0.1)
  assert not c.passed and "over the fp32 params rule" in c.detail and row["params_max_abs_diff"] > 0.09


def test_micro_mean_reports_the_distance_without_failing_the_verdict():
  spec = apply_overrides(preset("sft-tiny"), {"train.loss_normalization": "micro_mean"})
  c, row = _outcome(spec, [5.0, 4.95, 4.7])
  assert c.metric == "equivalence_ga_distance" and c.gating is False and not c.passed
  assert c.detail.startswith("reported only (micro_mean") and c.value == pytest.approx(0.1)
  assert verdict([c], {"jax": "ok", "torch": "ok"}).passed is True
  assert check_contradictions([c.to_json()], "fp32") == []  # a reported-only metric the verifier accepts


def test_bf16_is_reported_not_gated():
  spec = apply_overrides(preset("sft-tiny"), {"train.precision": "bf16"})
  assert equivalence_metric("packing", spec) == "equivalence_packing_distance"


def test_a_rerun_that_did_not_finish_fails_saying_so():
  crashed = SideRun(side="jax", status="crashed", returncode=1, wall_s=1.0, peak_rss_bytes=None, summary={},
                    error="boom")
  c, row = _outcome(preset("sft-tiny"), [], status=crashed)
  assert not c.passed and c.gating and "did not finish (crashed): boom" in c.detail and row["status"] == "crashed"


def test_the_report_rows_name_kind_side_rerun_and_result():
  spec = preset("sft-tiny")
  c, row = _outcome(spec, [5.0, 4.9, 4.8 + 1e-7])
  prep = {"train": {"eval_every": 0, "grad_accum_steps": 1, "micro_batch_size": 8}, "nproc": 1,
          "loss_tokens_per_step": [10, 12, 9]}
  d = {"equivalence": {"ga": equivalence_section("ga", spec, prep, {"jax": row})}}
  (r,) = equivalence_rows(RunRecord.of(d))
  assert r[:4] == ["ga", "jax", "tokens", "grad_accum_steps=1, micro_batch_size=8, nproc=1"] and r[-1] == "PASS"
  assert equivalence_lines(RunRecord.of(d))[0].startswith("equivalence ga jax (tokens): max |Δloss| 1e-07 at step 2")
  assert equivalence_rows(RunRecord.of({})) == []


def test_the_cli_refuses_an_equivalence_that_cannot_apply_with_exit_2(tmp_path, capsys):
  from parity.cli import main  # in-process: refused before any folder or side exists
  assert main(["compare", "--preset", "gpt2-tiny", "--sides", "jax,torch", "--equivalence", "ga",
               "--out", str(tmp_path / "run"), "--no-progress"]) == 2
  err = capsys.readouterr()
  assert "--equivalence ga" in err.out + err.err and "train.grad_accum_steps=2" in err.out + err.err
  assert not (tmp_path / "run").exists()
