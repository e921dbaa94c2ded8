"""`parity compare --request` and `parity join` (docs/join.md): the sides of one request run into two folders (as on
two machines) and joined into one verdict and report; tampered, foreign and overlapping folders refused (exit 2); a
planted bug in one folder FAILs the join (exit 1).

The slow tests share one module-scoped pair (torch into A, jax from A's request into B, both with the noise envelope)
and one planted jax folder; every other case works on copies of them or on folders prepared in-process."""
from __future__ import annotations

import contextlib
import dataclasses
import filecmp
import hashlib
import io
import json
import shutil
from pathlib import Path

import pytest

from conftest import requires_jax, requires_torch
from parity.cli import main
from parity.errors import SpecError
from parity.inputs import InputError

FAST = ["--preset", "gpt2-tiny", "--steps", "4", "--determinism-steps", "0", "--noise-envelope", "--no-progress"]
FROM = ["--determinism-steps", "0", "--noise-envelope", "--no-progress"]


def _cli(*argv) -> tuple[int, str]:
  """main(argv) in this process: (exit code, stdout + stderr)."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
    rc = main([str(a) for a in argv])
  return rc, out.getvalue()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  """A: gpt2-tiny's torch side; B: its jax side from A's request (the second machine). Each ~10-20 s on CPU."""
  root = tmp_path_factory.mktemp("join")
  rc_a, out_a = _cli("compare", *FAST, "--sides", "torch", "--out", root / "A")
  rc_b, out_b = _cli("compare", "--request", root / "A" / "request.json", "--sides", "jax", *FROM, "--out", root / "B")
  assert (rc_a, rc_b) == (0, 0), out_a[-2000:] + out_b[-2000:]
  return root


@pytest.fixture(scope="module")
def joined(pair):
  rc, out = _cli("join", pair / "A", pair / "B", "--out", pair / "AB")
  return rc, out, pair / "AB"


@pytest.fixture(scope="module")
def planted(pair):
  """The torch side again from A's request, with a planted norm eps (the bug on machine 1), joined with B."""
  rc, out = _cli("compare", "--request", pair / "A" / "request.json", "--sides", "torch", *FROM,
                 "--perturb", "torch:model.norm_eps=1e-3", "--out", pair / "Abad")
  assert rc == 0, out[-2000:]  # alone in its folder the side has no earlier card to differ from: it trains
  return _cli("join", pair / "Abad", pair / "B", "--out", pair / "AbadB") + (pair / "AbadB",)


slow_pair = [pytest.mark.process, pytest.mark.slow, requires_torch, requires_jax]


def _mark(f):
  for m in slow_pair:
    f = m(f)
  return f


# ----------------------------------------------------------------------------- the join of two machines' folders
@_mark
def test_b_runs_a_s_request_on_a_s_own_inputs(pair):
  a, b = pair / "A", pair / "B"
  for name in ("batches.npy", "val_batches.npy", "init.safetensors"):
    assert filecmp.cmp(a / name, b / name, shallow=False), name
  ra, rb = (json.loads((f / "request.json").read_text()) for f in (a, b))
  assert rb["request_from"]["run_id"] == ra["run_id"] and rb["request_from"]["request"] == str(a / "request.json")
  assert rb["run"]["sides"] == ["jax"] and {**rb["run"], "sides": ["torch"]} == ra["run"]
  assert rb["preset"] == ra["preset"] == "gpt2-tiny" and rb["data"] == ra["data"]


@_mark
def test_the_join_passes_with_every_check_and_names_both_folders(pair, joined):
  rc, out, ab = joined
  assert rc == 0, out[-3000:]
  rep = json.loads((ab / "report.json").read_text())
  assert rep["verdict"]["passed"] and list(rep["sides"]) == ["torch", "jax"]
  names = {c["name"] for c in rep["checks"]}
  for metric in ("completed", "loss", "grad_norm", "lr", "val_loss", "params", "semantics", "loss_envelope",
                 "grad_norm_envelope", "params_envelope"):
    assert f"{metric} torch~jax" in names, metric
  assert "placement jax" in names
  assert set(rep["noise_envelope"]["sides"]) == {"torch", "jax"}  # each machine's own reduction-order rerun
  join = rep["run_folder"]["join"]
  assert [f["path"] for f in join["folders"]] == [str(pair / "A"), str(pair / "B")]
  assert join["sides"]["torch"]["folder"] == "A" and join["sides"]["jax"]["folder"] == "B"
  assert join["sides"]["jax"]["device"] and join["sides"]["jax"]["hostname"]
  assert join["inputs"]["batches.npy"] == hashlib.sha256((pair / "A" / "batches.npy").read_bytes()).hexdigest()
  assert json.loads((ab / "request.json").read_text())["join"] == join
  md = (ab / "report.md").read_text()
  assert "## Joined runs" in md and str(pair / "A") in md and str(pair / "B") in md
  assert "Joined runs" in (ab / "report.html").read_text()
  assert json.loads((ab / "card.json").read_text())["join"]["sides"]["jax"]["folder"] == "B"
  assert str(pair / "A") in out and str(pair / "B") in out and "PASS" in out


@_mark
def test_the_joined_folder_re_verifies_as_any_run(joined):
  from parity.report.read import load_report, verify_report
  _, _, ab = joined
  assert verify_report(load_report(ab)) == []
  rc, out = _cli("report", ab)
  assert rc == 0 and "UNVERIFIED" not in out, out[-2000:]


@_mark
def test_an_existing_out_is_kept_unless_force(pair, joined):
  rc, out = _cli("join", pair / "A", pair / "B", "--out", joined[2])
  assert rc == 2 and "--force" in out, out[-1000:]
  again = pair / "again"
  shutil.copytree(joined[2], again)
  rc, out = _cli("join", pair / "A", pair / "B", "--out", again, "--force")
  assert rc == 0, out[-2000:]
  assert len(list(pair.glob("again.old-*"))) == 1  # moved aside whole, never deleted


@_mark
def test_a_planted_bug_on_one_machine_fails_the_join(planted):
  rc, out, folder = planted
  assert rc == 1, out[-3000:]
  rep = json.loads((folder / "report.json").read_text())
  first = rep["verdict"]["first_failure"]
  assert first["metric"] == "semantics" and first["sides"] == ["torch", "jax"]
  assert "norm.eps torch=0.001 jax=1e-05" in rep["verdict"]["message"]
  assert [(p["side"], p["key"], p["applied"]) for p in rep["perturbations"]] == [("torch", "model.norm_eps", True)]
  loss = next(c for c in rep["checks"] if c["name"] == "loss torch~jax")
  assert not loss["passed"] and loss["first_failing_step"] == 0  # trained anyway: the loss differs from step 0


# ----------------------------------------------------------------------------- refusals: exit 2, nothing written
def _flip_last_byte(path: Path) -> None:
  data = bytearray(path.read_bytes())
  data[-1] ^= 1
  path.write_bytes(bytes(data))


@_mark
@pytest.mark.parametrize("name", ["batches.npy", "init.safetensors", "request.json"])
def test_a_file_changed_after_its_run_is_refused_by_name(pair, tmp_path, name):
  b2 = tmp_path / "B2"
  shutil.copytree(pair / "B", b2)
  if name == "request.json":
    req = json.loads((b2 / name).read_text())
    req["run"]["train"]["lr"] = 2e-3
    (b2 / name).write_text(json.dumps(req, indent=2))
  else:
    _flip_last_byte(b2 / name)
  rc, out = _cli("join", pair / "A", b2, "--out", tmp_path / "AB")
  assert rc == 2, out[-2000:]
  assert f"{b2 / name} changed after its run" in out and "internal error" not in out
  assert not (tmp_path / "AB").exists()


@_mark
def test_another_run_s_batches_are_refused_naming_both_folders(pair, tmp_path):
  """A folder whose records are its own but whose batches are not A's (e.g. made from its own data on the second
  machine, not with --request)."""
  b2 = tmp_path / "B2"
  shutil.copytree(pair / "B", b2)
  _flip_last_byte(b2 / "batches.npy")
  rep = json.loads((b2 / "report.json").read_text())
  rep["artifacts"]["batches.npy"]["sha256"] = hashlib.sha256((b2 / "batches.npy").read_bytes()).hexdigest()
  (b2 / "report.json").write_text(json.dumps(rep, indent=2))
  rc, out = _cli("join", pair / "A", b2, "--out", tmp_path / "AB")
  assert rc == 2, out[-2000:]
  assert f"{b2 / 'batches.npy'} differs from {pair / 'A' / 'batches.npy'}" in out
  assert "did not train on the same batches" in out and f"--request {pair / 'A' / 'request.json'}" in out
  assert not (tmp_path / "AB").exists()


@_mark
def test_overlapping_sides_and_bad_folders_are_refused(pair, tmp_path):
  b2 = tmp_path / "B2"
  shutil.copytree(pair / "B", b2)
  rc, out = _cli("join", pair / "B", b2, "--out", tmp_path / "x")
  assert rc == 2 and "side 'jax' ran in both" in out and str(b2) in out, out[-1000:]
  rc, out = _cli("join", pair / "A", pair / "A", "--out", tmp_path / "x")
  assert rc == 2 and "is the same folder as A" in out
  rc, out = _cli("join", pair / "A", pair / "B", "--out", pair / "A", "--force")
  assert rc == 2 and "must be a new one" in out and (pair / "A" / "report.json").is_file()
  rc, out = _cli("join", pair / "A", "--out", tmp_path / "x")
  assert rc == 2 and "two or more" in out
  rc, out = _cli("join", pair / "A", tmp_path / "nothing", "--out", tmp_path / "x")
  assert rc == 2 and "internal error" not in out
  assert not (tmp_path / "x").exists()


@_mark
def test_request_refuses_what_would_make_another_run(pair, tmp_path):
  out_dir = tmp_path / "B"
  rc, out = _cli("compare", "--request", pair / "A" / "request.json", "--sides", "jax", "--steps", "3",
                 "--set", "train.lr=1e-2", "--out", out_dir)
  assert rc == 2 and "--set, --steps would change it" in out, out[-1000:]
  rc, out = _cli("compare", "--request", pair / "A" / "noise" / "request.json", "--sides", "jax", "--out", out_dir)
  assert rc == 2 and "the request of a rerun" in out
  rc, out = _cli("compare", "--request", tmp_path / "missing.json", "--out", out_dir)
  assert rc == 2 and "no such file" in out
  assert not out_dir.exists()


# ----------------------------------------------------------------------------- in-process: prepared folders only
def _prepared(folder: Path, run) -> Path:
  from parity.pipeline.folder import open_run_folder
  open_run_folder(run, folder, {}).claim.release()
  return folder


def test_a_request_rebuilds_its_run_and_copies_its_inputs(tmp_path):
  """Padded examples and a DeepSpeed config: the example arrays and the config copy come from the request's folder,
  and the spec rebuilds to the request's config_hash."""
  from parity.pipeline.request_source import resolve_request
  from parity.pipeline.resolve import resolve_run
  from parity.spec import config_hash
  a = _prepared(tmp_path / "A", resolve_run("sft-tiny", steps=2, sides=["torch"]))
  run = resolve_request(a / "request.json", sides=["jax"])
  assert run.spec.sides == ("jax",) and run.inputs_from == str(a.absolute()) and run.preset == "sft-tiny"
  req = json.loads((a / "request.json").read_text())
  assert config_hash(dataclasses.replace(run.spec, sides=("torch",))) == req["config_hash"]
  b = _prepared(tmp_path / "B", run)
  for f in sorted(a.glob("*.npy")) + [a / "init.safetensors"]:
    assert filecmp.cmp(f, b / f.name, shallow=False), f.name
  assert json.loads((b / "request.json").read_text())["examples"] == req["examples"]
  cfg = tmp_path / "ds.json"
  cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                             "zero_optimization": {"stage": 2}}))
  c = _prepared(tmp_path / "C", resolve_run("gpt2-tiny", deepspeed_config=cfg, steps=2, sides=["jax"]))
  d = _prepared(tmp_path / "D", resolve_request(c, sides=["deepspeed"]))
  for name in ("deepspeed_config.given.json", "deepspeed_config.resolved.json", "batches.npy"):
    assert filecmp.cmp(c / name, d / name, shallow=False), name


def test_an_edited_or_incomplete_request_is_refused(tmp_path):
  from parity.pipeline.request_source import resolve_request
  from parity.pipeline.resolve import resolve_run
  a = _prepared(tmp_path / "A", resolve_run("gpt2-tiny", steps=2, sides=["torch"]))
  req = json.loads((a / "request.json").read_text())
  req["run"]["train"]["lr"] = 5e-3  # not the run its config_hash names
  (a / "request.json").write_text(json.dumps(req))
  with pytest.raises(SpecError, match="does not rebuild as it was recorded"):
    resolve_request(a / "request.json", sides=["jax"])
  (a / "batches.npy").unlink()
  with pytest.raises(InputError, match="batches.npy is missing"):
    resolve_request(a, sides=["jax"])


def _source(label: str, run: dict, *, noise=None, sha="1" * 64):
  from parity.pipeline.join_sources import Source
  from parity.report.build import Report
  from parity.spec import RunSpec
  from parity.fields import from_dict
  data = {"sides": {s: {"status": "ok"} for s in run["sides"]}, "noise_envelope": noise, "determinism": {},
          "resume": {},
          "equivalence": {}, "artifacts": {n: {"sha256": sha} for n in ("batches.npy", "init.safetensors")}}
  return Source(label=label, path=Path(f"/x/{label}"), report=Report(data=data, run_dir=Path(f"/x/{label}")),
                request={"run": run, "data": {"sha256": "d"}}, spec=from_dict(RunSpec, run), environment=None)


def test_another_spec_and_other_reruns_are_refused_naming_the_key():
  from parity.pipeline.join_sources import check_reruns, check_same_request
  from parity.presets import preset
  from parity.spec import to_dict
  run = json.loads(json.dumps(to_dict(preset("gpt2-tiny"))))
  a = _source("A", {**run, "sides": ["torch"]})
  other = json.loads(json.dumps(run))
  other["train"]["lr"] = 2e-3
  other.update(sides=["jax"], timeout_s=60.0, data="/elsewhere/stdlib")  # sides, time limit and path may differ
  check_same_request(a, _source("B", {**run, "sides": ["jax"], "timeout_s": 60.0, "data": "/elsewhere"}))
  with pytest.raises(InputError, match=r"train.lr 0.001 vs 0.002 \(B vs A\)"):
    check_same_request(a, _source("B", other))
  with pytest.raises(InputError, match="init.safetensors differs"):
    check_same_request(a, _source("B", {**run, "sides": ["jax"]}, sha="2" * 64))
  with pytest.raises(InputError, match="--noise-envelope off vs on"):
    check_reruns([_source("A", {**run, "sides": ["torch"]}, noise={"sides": {}}),
                  _source("B", {**run, "sides": ["jax"]})])
  crashed = _source("B", {**run, "sides": ["jax"]})
  crashed.report.data["sides"]["jax"]["status"] = "crashed"  # reran nothing: its failed side decides the verdict
  check_reruns([_source("A", {**run, "sides": ["torch"]}, noise={"sides": {}}), crashed])
  bf16 = json.loads(json.dumps(run))
  bf16["train"]["precision"] = "bf16"
  with pytest.raises(InputError, match="ran in bf16 without the noise envelope"):
    check_reruns([_source("A", {**bf16, "sides": ["torch"]}), _source("B", {**bf16, "sides": ["jax"]})])
  check_reruns([_source("A", {**bf16, "sides": ["torch"]}, noise={"sides": {}}),
                _source("B", {**bf16, "sides": ["jax"]}, noise={"sides": {}})])


def test_each_folder_s_rerun_sections_are_merged_per_side():
  """What the verification recomputes is named by the folders' own sections: each side's noise run, determinism
  entry and host-CPU backend rerun (only the accelerator side's folder has one) from the folder that ran it."""
  from parity.pipeline.join import _stub, joined_spec
  from parity.presets import preset
  from parity.spec import to_dict
  run = json.loads(json.dumps(to_dict(preset("gpt2-tiny"))))
  a, b = _source("A", {**run, "sides": ["torch"]}), _source("B", {**run, "sides": ["jax"]})
  a.report.data.update(checks=[], noise_envelope={"rule": "r", "runs": {"torch": {"wall_s": 1.0}}},
                       determinism={"torch": {"steps_checked": 2}})
  b.report.data.update(checks=[], noise_envelope={"rule": "r", "runs": {"jax": {"wall_s": 2.0}}},
                       determinism={"jax": {"steps_checked": 2}}, backend={"runs": {"jax": {"status": "ok"}}})
  stub = _stub([a, b], joined_spec([a, b]))
  assert stub["noise_envelope"] == {"rule": "r", "runs": {"torch": {"wall_s": 1.0}, "jax": {"wall_s": 2.0}}}
  assert set(stub["determinism"]) == {"torch", "jax"} and stub["backend"] == {"runs": {"jax": {"status": "ok"}}}
  assert list(stub["sides"]) == ["torch", "jax"] and stub["run"]["sides"] == ["torch", "jax"]
  assert stub["resume"] == {} and stub["run_folder"] == {"run_id": None}


def test_a_side_s_symlinked_files_are_joined_as_files(tmp_path):
  """`parity join` kept a side's symbolic links as links: a copy of the joined folder (or the source moved away)
  left them dangling, and the folder no longer verified. The joined folder holds files."""
  from types import SimpleNamespace
  from parity.pipeline.join import _copy_sides, _link_or_copy
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  (elsewhere / "final.safetensors").write_bytes(b"weights")
  (elsewhere / "batches.npy").write_bytes(b"batches")
  src = tmp_path / "A"
  for part in (src / "torch", src / "noise" / "torch"):
    part.mkdir(parents=True)
    (part / "final.safetensors").symlink_to(elsewhere / "final.safetensors")
    (part / "steps.jsonl").write_text("{}\n")
  (src / "batches.npy").symlink_to(elsewhere / "batches.npy")
  out = tmp_path / "AB"
  out.mkdir()
  _copy_sides(SimpleNamespace(path=src, sides=("torch",)), out)
  _link_or_copy(src / "batches.npy", out / "batches.npy")
  shutil.rmtree(elsewhere)  # the links' target gone: the joined folder is whole all the same
  assert not [p for p in out.rglob("*") if p.is_symlink()]
  assert (out / "torch" / "final.safetensors").read_bytes() == b"weights"
  assert (out / "noise" / "torch" / "final.safetensors").read_bytes() == b"weights"
  assert (out / "batches.npy").read_bytes() == b"batches" and (out / "torch" / "steps.jsonl").read_text() == "{}\n"
