"""Re-verification of a finished run (parity/report/read.py verify_report, parity/report/reverify.py), behind
`parity report RUN`, `parity check NEW BASELINE`, `--baseline` and the comparison page (with the
run folder's hashes). Three real gpt2-tiny runs (jax, torch; 4 steps), each built once per session on first use and
copied per test before any edit: bf16 (noise envelope, determinism 2 steps, resume at step 1), fp16 (noise envelope)
and an fp32 run that fails (torch lr +10%)."""
from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from conftest import requires_jax, requires_torch

RUNS = {
    "bf16": dict(overrides={"train.precision": "bf16"}, determinism_steps=2, resume_at=1),
    "fp16": dict(overrides={"train.precision": "fp16"}, determinism_steps=0),
    "fail": dict(perturb=["torch:train.lr=0.0011"], determinism_steps=0),
}


@functools.cache
def _built(kind: str) -> Path:
  """The run folder of RUNS[kind], built on first use (~45 s to ~2.5 min on 2 shared cores); removed at exit."""
  from parity.pipeline.compare import compare
  root = Path(tempfile.mkdtemp(prefix=f"parity-verify-{kind}-"))
  atexit.register(shutil.rmtree, root, True)
  compare("gpt2-tiny", steps=4, sides=["jax", "torch"], out=root / kind, progress=False,
          command=f"pytest tests/test_report_verify.py ({kind})", **RUNS[kind])
  return root / kind


def needs_runs(test):
  return pytest.mark.process(pytest.mark.slow(requires_jax(requires_torch(test))))


def _copy(kind: str, tmp_path: Path, name: str | None = None) -> Path:
  return Path(shutil.copytree(_built(kind), tmp_path / (name or kind), ignore=shutil.ignore_patterns(".parity.lock")))


def _edit(rd: Path, edit) -> Path:
  d = json.loads((rd / "report.json").read_text())
  edit(d)
  (rd / "report.json").write_text(json.dumps(d))
  return rd


def _problems(rd: Path) -> list[str]:
  from parity.report.read import load_report, verify_report
  return verify_report(load_report(rd))


def _cli(capsys, *argv) -> tuple[int, str, str]:
  from parity.cli import main
  code = main([str(a) for a in argv])
  cap = capsys.readouterr()
  assert "internal error" not in cap.err and "Traceback" not in cap.err, cap.err
  return code, cap.out, cap.err


def _rehash(rd: Path) -> None:
  """Records the folder's current artifact hashes in report.json: what a forger who also rewrites the hashes does."""
  from parity.report.build import artifact_hashes
  _edit(rd, lambda d: d.update(artifacts=artifact_hashes(rd, list(d["sides"]))))


# ----------------------------------------------------------------------------- item 2: bf16/fp16 are not "edited"


@needs_runs
@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_mixed_precision_run_verifies_and_reports(kind, tmp_path, capsys):
  """The reported-only checks the noise envelope leaves are legitimate: `parity report RUN` exits 0 with the PASS,
  and `parity check` of a copy against the run passes, where both refused the run as "edited" before."""
  from parity.verdict.gating import ENVELOPE_DECIDES
  rd = _copy(kind, tmp_path)
  d = json.loads((rd / "report.json").read_text())
  assert d["verdict"]["passed"], d["verdict"]
  decided = [c for c in d["checks"] if c["gating"] is False and c["metric"] in ENVELOPE_DECIDES]
  assert {c["metric"] for c in decided} >= {"loss", "grad_norm"}, decided  # the case the old rule refused
  assert _problems(rd) == []
  code, out, err = _cli(capsys, "report", rd)
  assert code == 0 and "PASS" in out and "edited" not in err + out, err
  code, out, err = _cli(capsys, "check", _copy(kind, tmp_path, "new"), _built(kind))
  assert code == 0 and "GATE PASS" in out and "edited" not in err, (out, err)


@needs_runs
@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_mixed_precision_run_is_a_baseline(kind):
  from parity.history.snapshot import load_baseline
  snap = load_baseline(_built(kind), flag="--baseline")  # what `parity compare --baseline RUN` reads
  assert snap.passed and snap.precision == kind


@needs_runs
def test_comparison_page_of_mixed_precision_runs(tmp_path, capsys):
  out_dir = tmp_path / "cmp"
  code, out, _ = _cli(capsys, "report", _built("bf16"), _built("fp16"), "-o", out_dir)
  assert code == 0 and "UNVERIFIED" not in out, out
  md = (out_dir / "comparison.md").read_text()
  assert "UNVERIFIED" not in md and "**2 of 2 runs hold parity.**" in md, md


@needs_runs
def test_reported_only_check_without_its_envelope_is_refused(tmp_path):
  """The registry (parity.verdict.gating) allows a bf16 pointwise check to be reported only where its envelope
  check for the pair is stored; the envelope check removed, the loss check's reported-only flag is refused."""
  rd = _edit(_copy("bf16", tmp_path), lambda d: d.update(
      checks=[c for c in d["checks"] if c["metric"] != "loss_envelope"]))
  problems = _problems(rd)
  assert any("(loss jax~torch) is stored as not gating" in p for p in problems), problems
  assert any("recomputed only: ['loss_envelope jax~torch']" in p for p in problems), problems


def test_gating_registry_is_what_the_writer_marks():
  """mark_envelope_decided (used by parity.pipeline.reruns) marks exactly what reported_only_allowed (used by the
  verifier) accepts: per precision, per metric, per pair."""
  from parity.verdict.check import Check
  from parity.verdict.gating import ENVELOPE_DECIDES, mark_envelope_decided, reported_only_allowed
  for precision in ("fp32", "bf16", "fp16"):
    checks = [Check(f"{m} a~b", m, ("a", "b"), 0.0, 1.0, True) for m in (*ENVELOPE_DECIDES, "lr", "completed")]
    envelope = [Check(f"{e} a~b", e, ("a", "b"), 0.0, 1.0, True) for e in ENVELOPE_DECIDES.values()]
    mark_envelope_decided(checks, {(m, "a", "b") for m in ENVELOPE_DECIDES} | {("lr", "a", "b")}, precision)
    stored = [c.to_json() for c in checks + envelope]
    for c in stored[:len(checks)]:
      decided = precision != "fp32" and c["metric"] in ENVELOPE_DECIDES
      assert c["gating"] is not decided, (precision, c)
      assert reported_only_allowed(c, stored, precision) is decided, (precision, c)
      assert not reported_only_allowed({**c, "sides": ["a", "c"]}, stored, precision)  # no envelope for that pair
  assert reported_only_allowed({"metric": "determinism"}, [], "fp32")


# ----------------------------------------------------------------------------- item 4: recompute, do not trust


def _zero_values(d: dict, *, flip: bool) -> None:
  """Every check's value zeroed; with `flip` also marked passed and the verdict made the one those checks give."""
  from parity.report.reverify import check_from_json
  from parity.verdict.sides import verdict
  for c in d["checks"]:
    c["value"] = 0.0
    if flip:
      c["passed"], c["first_failing_step"] = True, None
  if flip:
    d["verdict"] = verdict([check_from_json(c) for c in d["checks"]], {s: "ok" for s in d["sides"]}).to_json()


@needs_runs
def test_failing_run_verifies_as_fail(tmp_path, capsys):
  rd = _copy("fail", tmp_path)
  assert _problems(rd) == []
  code, out, err = _cli(capsys, "report", rd)
  assert code == 1 and "FAIL" in out and "UNVERIFIED" not in err + out, (out, err)


@needs_runs
@pytest.mark.parametrize("flip", [True, False], ids=["zeroed-and-flipped-to-pass", "values-zeroed"])
def test_zeroed_check_values_are_recomputed(flip, tmp_path, capsys):
  """A failing run whose check values are zeroed (and flags and verdict turned PASS) is not re-verified: every check
  is recomputed from the sides' records and the difference named; `parity report` exits 1 UNVERIFIED, `parity check`
  and --baseline refuse it (exit 2), the comparison page does not count it."""
  from parity.inputs import InputError
  from parity.history.snapshot import load_baseline
  rd = _edit(_copy("fail", tmp_path), lambda d: _zero_values(d, flip=flip))
  problems = "; ".join(_problems(rd))
  assert "checks[4] (lr jax~torch): value stored 0.0, recomputed 3.33" in problems, problems
  if flip:
    assert "the stored verdict says PASS" in problems and "the run's records give 'FAIL: lr jax vs torch" in problems
  code, out, err = _cli(capsys, "report", rd)
  assert code == 1 and "UNVERIFIED" in err and "PASS" not in out, (out, err)
  code, _, err = _cli(capsys, "check", rd, _built("fail"))
  assert code == 2 and "cannot be checked" in err and "recomputed" in err, err
  with pytest.raises(InputError, match="cannot be trusted"):
    load_baseline(rd)
  code, out, _ = _cli(capsys, "report", _built("bf16"), rd, "-o", tmp_path / "cmp")
  assert code == 1 and "UNVERIFIED" in out
  assert "**1 of 2 runs hold parity.**" in (tmp_path / "cmp" / "comparison.md").read_text()


@needs_runs
def test_report_without_artifacts_is_unverified(tmp_path, capsys):
  rd = _edit(_copy("bf16", tmp_path), lambda d: d.pop("artifacts"))
  problems = _problems(rd)
  assert len(problems) == 1 and "records no 'artifacts'" in problems[0] and "UNVERIFIED" in problems[0]
  code, out, err = _cli(capsys, "report", rd)
  assert code == 1 and "UNVERIFIED" in err and "PASS" not in out
  code, _, err = _cli(capsys, "check", rd, _built("bf16"))
  assert code == 2 and "records no 'artifacts'" in err


@needs_runs
@pytest.mark.parametrize("where", ["empty folder", "real run folder"])
def test_minimal_forged_report_is_refused_cleanly(where, tmp_path, capsys):
  """A minimal report.json (the four sections load_report needs, saying PASS) is UNVERIFIED (exit 1) for `parity
  report` and refused (exit 2, no KeyError) by `parity check`, alone or dropped into a real run folder with the
  real run's artifact hashes."""
  rd = tmp_path / "forged" if where == "empty folder" else _copy("fail", tmp_path)
  rd.mkdir(exist_ok=True)
  real = json.loads((_built("fail") / "report.json").read_text())
  forged = {"schema": "parity.report/3", "verdict": {"passed": True, "message": "PASS"}, "checks": [],
            "sides": {"jax": {"status": "ok", "summary": {}, "series": {"loss": [1.0], "val_loss": []}}}}
  if where == "real run folder":
    forged["artifacts"] = real["artifacts"]
  (rd / "report.json").write_text(json.dumps(forged))
  code, out, err = _cli(capsys, "report", rd)
  assert code == 1 and "UNVERIFIED" in err and "PASS" not in out, (out, err)
  code, out, err = _cli(capsys, "check", rd, _built("fail"))
  assert code == 2 and "cannot be checked" in err and "KeyError" not in err, err


@needs_runs
@pytest.mark.parametrize("gone,said", [
    (["torch/final.safetensors"], "sides.torch.status is stored 'ok', its records give 'crashed'"),
    (["noise/jax/summary.json", "noise/jax/steps.jsonl", "noise/jax/final.safetensors"],
     "noise/jax/summary.json is missing"),
    (["repeat/torch/summary.json", "repeat/torch/steps.jsonl"], "repeat/torch/summary.json is missing"),
    # checks[15] is the jax side's placement check (after the pair's checks, before the reruns')
    (["resume/jax/steps.jsonl"], "checks[16] (jax resume): value stored 0.0, recomputed None; passed stored True"),
])
def test_missing_records_are_recomputed_not_trusted(gone, said, tmp_path):
  """Records removed together with their hashes (so re-hashing alone sees nothing): the recomputation finds what
  they held is gone, and the run is UNVERIFIED."""
  rd = _copy("bf16", tmp_path)
  for rel in gone:
    (rd / rel).unlink()
  _rehash(rd)
  problems = "; ".join(_problems(rd))
  assert said in problems and ("UNVERIFIED" in problems or "edited or is inconsistent" in problems), problems


@needs_runs
def test_rehashed_rerun_records_are_recomputed(tmp_path):
  """noise/jax/steps.jsonl rewritten (its rerun's losses moved by 0.01) and the hashes rewritten to match: the
  recomputed envelope checks and section differ from the stored ones."""
  rd = _copy("bf16", tmp_path)
  path = rd / "noise" / "jax" / "steps.jsonl"
  recs = [json.loads(line) for line in path.read_text().splitlines()]
  for r in recs:
    r["loss"] += 0.01
  path.write_text("".join(json.dumps(r) + "\n" for r in recs))
  _rehash(rd)
  problems = "; ".join(_problems(rd))
  assert "(loss_envelope jax~torch): value stored" not in problems  # the pair's Δ is the same: only its bound moved
  assert "(loss_envelope jax~torch): tolerance stored" in problems, problems
  assert "the noise_envelope section is not what noise/ gives" in problems, problems


@needs_runs
def test_edited_side_series_is_named(tmp_path):
  rd = _edit(_copy("fail", tmp_path), lambda d: d["sides"]["jax"]["series"]["loss"].__setitem__(2, 1.0))
  problems = "; ".join(_problems(rd))
  assert "sides.jax.series (loss) is not jax/steps.jsonl" in problems, problems


# ----------------------------------------------------------------------------- item 9: no hash when the size differs


@needs_runs
def test_a_file_of_another_size_is_not_hashed(tmp_path, monkeypatch):
  import parity.report.build as build
  rd = _copy("fail", tmp_path)
  with open(rd / "jax" / "steps.jsonl", "a") as f:
    f.write('{"step": 99}\n')
  hashed: list[str] = []
  real = build.file_digest
  monkeypatch.setattr(build, "file_digest", lambda p: hashed.append(Path(p).relative_to(rd).as_posix()) or real(p))
  problems = _problems(rd)
  assert len(problems) == 1 and "jax/steps.jsonl (" in problems[0] and "not hashed: the size shows it changed" in \
      problems[0], problems
  assert "jax/steps.jsonl" not in hashed and "torch/steps.jsonl" in hashed  # the others, of the same size, are hashed


# ----------------------------------------------------------------------------- runs that stopped (fake sides, fast)


def test_interrupted_run_reverifies_as_interrupted(tmp_path, fake_sides, capsys):
  """Ctrl-C in the second side: torch 'killed' with no summary of its own, no reruns; the stored INTERRUPTED verdict
  is what the records give (not UNVERIFIED), and it never passes."""
  from parity.pipeline.compare import RunOptions, run_comparison
  from parity.pipeline.resolve import resolve_run
  fake_sides(interrupt_on="torch")
  with pytest.raises(KeyboardInterrupt):
    run_comparison(resolve_run("gpt2-tiny", steps=4, sides=("jax", "torch")), RunOptions(out=tmp_path / "c"))
  assert _problems(tmp_path / "c") == []
  code, out, err = _cli(capsys, "report", tmp_path / "c")
  assert code == 1 and "INTERRUPTED" in out and "UNVERIFIED" not in err + out, (out, err)
  rd = _edit(tmp_path / "c", lambda d: d["sides"]["torch"].update(status="ok"))  # a killed side made 'ok'
  assert "torch/summary.json is missing" in "; ".join(_problems(rd)), _problems(rd)


def test_run_whose_reruns_stopped_reverifies(tmp_path, fake_sides, monkeypatch):
  """The determinism rerun's folder cannot be written (OSError): the failing 'reruns' check cannot be recomputed and
  is taken as stored (it fails the verdict); the rest recomputes; the check turned passing is refused."""
  import harness.self_runs
  from parity.pipeline.compare import RunOptions, run_comparison
  from parity.pipeline.resolve import resolve_run

  def disk_full(*a, **k):
    raise OSError(28, "No space left on device")
  fake_sides()
  monkeypatch.setattr(harness.self_runs, "run_repeat", disk_full)
  report = run_comparison(resolve_run("gpt2-tiny", steps=4, sides=("jax", "torch")),
                          RunOptions(out=tmp_path / "r", determinism_steps=2))
  assert not report.passed and report.checks[-1]["metric"] == "reruns"
  assert _problems(tmp_path / "r") == []

  def flip(d):
    d["checks"][-1].update(passed=True, value=0.0)
    d["verdict"].update(passed=True)
  problems = "; ".join(_problems(_edit(tmp_path / "r", flip)))
  assert "recomputed only: none" in problems and "stored only: ['reruns']" in problems, problems


def _drop_checks(d: dict, metrics: tuple[str, ...]) -> None:
  """The checks of `metrics` removed, the decided checks made gating again and the verdict made the one the rest
  give: a report edited to hide reruns, consistent in itself."""
  from parity.report.reverify import check_from_json
  from parity.verdict.sides import verdict
  d["checks"] = [c for c in d["checks"] if c["metric"] not in metrics]
  for c in d["checks"]:
    if c["gating"] is False and c["metric"] != "determinism":
      c["gating"], c["detail"] = True, c["detail"].split(" (reported only")[0]
  d["verdict"] = verdict([check_from_json(c) for c in d["checks"]], {s: "ok" for s in d["sides"]}).to_json()


@needs_runs
def test_reruns_removed_from_the_report_are_found_in_the_folder(tmp_path):
  """The resume checks and section removed (bf16), or the whole noise envelope (fp16): the rerun folders' request.json
  files record what was started, so the report that hides them is UNVERIFIED."""
  rd = _edit(_copy("bf16", tmp_path), lambda d: (_drop_checks(d, ("resume",)), d.update(resume={})))
  problems = "; ".join(_problems(rd))
  assert "repeat/request.json started steps 0..1 with a checkpoint at 1" in problems, problems
  envelopes = ("loss_envelope", "grad_norm_envelope", "val_loss_envelope", "params_envelope")
  rd = _edit(_copy("fp16", tmp_path), lambda d: (_drop_checks(d, envelopes), d.update(noise_envelope=None)))
  problems = "; ".join(_problems(rd))
  assert "noise/request.json shows the reduction-order reruns were started" in problems, problems


def test_run_with_a_nan_side_reverifies(tmp_path, monkeypatch):
  """A side whose loss went NaN at step 2 (status 'nan', its records NaN from there): the NaN figures stored as
  report.json writes them (None) re-verify as the FAIL they are, not as an edit."""
  import harness.runner
  import harness.self_runs
  from test_pipeline import _fake_run_side
  from parity.pipeline.compare import RunOptions, run_comparison
  from parity.pipeline.resolve import resolve_run
  fake = _fake_run_side([])

  def nan_torch(run_dir, side, **kw):
    sr = fake(run_dir, side, **kw)
    if side == "torch" and Path(run_dir).name == "r":
      out = Path(run_dir) / side
      recs = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()][:3]
      recs[2].update(loss=float("nan"), grad_norm=float("nan"))
      (out / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
      summary = {**sr.summary, "status": "nan", "error": "loss is NaN at step 2"}
      (out / "summary.json").write_text(json.dumps(summary))
      sr = harness.runner.SideRun(side, "nan", 0, 4.0, None, summary, summary["error"])
    return sr
  monkeypatch.setattr(harness.runner, "run_side", nan_torch)
  monkeypatch.setattr(harness.self_runs, "run_side", nan_torch)
  report = run_comparison(resolve_run("gpt2-tiny", steps=4, sides=("jax", "torch")),
                          RunOptions(out=tmp_path / "r", determinism_steps=2))
  assert not report.passed and report.data["sides"]["torch"]["status"] == "nan"
  assert any(c["value"] is None for c in report.checks), report.checks  # a NaN difference, stored as None
  assert _problems(tmp_path / "r") == []


# ----------------------------------------------------------------------------- records that are not a run's


def _filler_run_folder(tmp_path: Path) -> Path:
  """A folder laid out as `parity compare` leaves it, artifacts of filler bytes, and a report.json recording their
  hashes (PASS)."""
  from parity.verdict.check import Check
  from parity.verdict.sides import verdict
  from parity.report.build import REPORT_SCHEMA, artifact_hashes
  rd = tmp_path / "run"
  for rel in ("request.json", "init.safetensors", "batches.npy", "jax/steps.jsonl", "jax/final.safetensors",
              "torch/steps.jsonl", "torch/final.safetensors"):
    (rd / rel).parent.mkdir(parents=True, exist_ok=True)
    (rd / rel).write_bytes(rel.encode() * 50)
  checks = [Check("loss jax~torch", "loss", ("jax", "torch"), 1e-6, 1e-4, True),
            Check("determinism jax", "determinism", ("jax", "jax"), 0.0, 0.0, True, gating=False)]
  statuses = {"jax": "ok", "torch": "ok"}
  side = {"status": "ok", "summary": {}, "series": {"loss": [], "val_loss": []}}
  data = {"schema": REPORT_SCHEMA, "verdict": verdict(checks, statuses).to_json(),
          "checks": [c.to_json() for c in checks], "sides": {s: dict(side) for s in statuses},
          "artifacts": artifact_hashes(rd, list(statuses))}
  (rd / "report.json").write_text(json.dumps(data))
  return rd


def test_report_whose_records_are_not_a_run_is_unverified(tmp_path, capsys):
  """Every hash matches, but the records are not a run's (request.json, steps, weights are filler bytes): the checks
  cannot be recomputed from them, so the stored PASS is UNVERIFIED, never shown (real runs: the tests above)."""
  from parity.report.read import load_report
  rd = _filler_run_folder(tmp_path)
  assert load_report(rd).passed
  problems = _problems(rd)
  assert len(problems) == 1 and "request.json cannot be read" in problems[0] and "UNVERIFIED" in problems[0]
  code, out, err = _cli(capsys, "report", rd)
  assert code == 1 and "UNVERIFIED" in err and "PASS" not in out, (out, err)


@pytest.mark.parametrize("change,said", [
    (lambda p: p.write_bytes(p.read_bytes()[:10]), "torch/final.safetensors (1150 -> 10 bytes; not hashed"),
    (lambda p: p.write_bytes(p.read_bytes()[::-1]), "torch/final.safetensors (same size, different content)"),
    (lambda p: p.unlink(), "torch/final.safetensors (missing)"),
], ids=["truncated", "reversed", "removed"])
def test_report_names_an_artifact_changed_since_the_run(tmp_path, capsys, change, said):
  rd = _filler_run_folder(tmp_path)
  change(rd / "torch" / "final.safetensors")
  problems = _problems(rd)
  assert len(problems) == 1 and said in problems[0], problems
  code, _, err = _cli(capsys, "report", rd)
  assert code == 1 and said in err, err
