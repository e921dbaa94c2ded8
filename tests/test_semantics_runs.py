"""The semantics card in real compares (process tests): the GELU-form and bias-decay plants FAIL at
step 0 on gpt2-tiny naming both values, a differing side stops before step 1 unless --train-anyway-on-card-diff, and
a clean three-side run has no false alarm, and a model-family plant (gemma2-tiny's attention soft-cap on one side) FAILs
at step 0 (each compare run once, module-scoped, as tests/test_plants.py does)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import requires_all

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"gelu": ["--perturb", "jax:model.gelu_approximate=false"],
        "bias": ["--perturb", "deepspeed:decay_biases=true", "--train-anyway-on-card-diff"],
        "clean": []}
FAMILY_RUN = ["--preset", "gemma2-tiny", "--sides", "jax,torch", "--steps", "2",
              "--perturb", "torch:model.attn_softcap=50.0"]
"""A model-family plant: the attention soft-cap of one side, 50 where the preset has 2."""


def _cli(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "parity.cli", *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """name -> (exit code, report.json or None, output, run folder), each compare run once, when a test first asks."""
  base, cache = tmp_path_factory.mktemp("semantics"), {}

  def get(name: str):
    if name not in cache:
      out = base / name
      args = FAMILY_RUN if name == "family" else ["--preset", "gpt2-tiny", "--steps", "3", *RUNS[name]]
      p = _cli("compare", *args, "--determinism-steps", "0", "--no-progress", "--out", str(out))
      rep = out / "report.json"
      cache[name] = (p.returncode, json.loads(rep.read_text()) if rep.exists() else None, p.stdout + p.stderr, out)
    return cache[name]
  return get


def _checks(rep):
  return {c["name"]: c for c in rep["checks"]}


@pytest.mark.process
@requires_all
def test_the_gelu_plant_fails_at_step_0_and_the_later_sides_stop_before_step_1(runs):
  rc, rep, out, folder = runs("gelu")
  assert rc == 1 and rep is not None, out[-3000:]
  first = rep["verdict"]["first_failure"]
  assert first["metric"] == "semantics" and first["step"] == 0 and first["sides"] == ["jax", "deepspeed"]
  checks = _checks(rep)
  for pair, other in (("jax~deepspeed", "deepspeed"), ("jax~torch", "torch")):
    # the probe's loss moves 1.1e-5 (erf against tanh at the probe's weights), under its float32 rounding tolerance
    # (3.0e-5 at 8 nats: parity.semantics.probe_loss_tolerance): the card's own item names the form
    detail = checks[f"semantics {pair}"]["detail"]
    assert detail.startswith(f"semantics: mlp.gelu_form jax=erf {other}=tanh"), detail
  assert checks["semantics deepspeed~torch"]["passed"]
  assert rep["sides"]["jax"]["status"] == "ok"
  for side in ("deepspeed", "torch"):  # stopped before step 1, reported as a crash naming the item
    s = rep["sides"][side]
    assert s["status"] == "crashed" and s["series"]["step"] == [] and "mlp.gelu_form jax=erf" in s["error"]
  assert "mlp.gelu_form jax=erf deepspeed=tanh" in out
  row = next(r for r in rep["semantics"]["rows"] if r["item"] == "mlp.gelu_form")
  assert row == {"item": "mlp.gelu_form", "values": {"jax": "erf", "deepspeed": "tanh", "torch": "tanh"},
                 "agree": False}
  card = json.loads((folder / "card.json").read_text())["semantics"]
  assert not card["agree"] and card["differences"][0]["item"] == "mlp.gelu_form"
  assert "Semantics card" in (folder / "report.html").read_text()


@pytest.mark.process
@requires_all
def test_the_bias_decay_plant_fails_at_step_0_and_trains_anyway_when_asked(runs):
  rc, rep, out, folder = runs("bias")
  assert rc == 1 and rep is not None, out[-3000:]
  checks = _checks(rep)
  for pair in ("jax~deepspeed", "deepspeed~torch"):
    c = checks[f"semantics {pair}"]
    assert not c["passed"] and c["first_failing_step"] == 0 and c["worst"] == "optimizer.decay_set"
  detail = checks["semantics jax~deepspeed"]["detail"]
  assert detail.startswith("semantics: optimizer.decay_set jax=8 names (none the other lacks) deepspeed=21 names "
                           "(13 the other lacks: h.0.attn.proj.bias"), detail
  assert checks["semantics jax~torch"]["passed"]
  assert all(s["status"] == "ok" for s in rep["sides"].values())  # --train-anyway-on-card-diff: every side ran
  assert rep["verdict"]["first_failure"]["metric"] == "semantics"
  assert "| optimizer.decay_set |" in (folder / "report.md").read_text()


@pytest.mark.process
@requires_all
def test_a_clean_three_side_run_has_no_false_alarm_and_reverifies(runs):
  rc, rep, out, folder = runs("clean")
  assert rc == 0 and rep["verdict"]["passed"], out[-3000:]
  sem = [c for c in rep["checks"] if c["metric"] == "semantics"]
  assert len(sem) == 3 and all(c["passed"] for c in sem)
  assert all(r["agree"] for r in rep["semantics"]["rows"]) and set(rep["semantics"]["cards"]) == {
      "jax", "deepspeed", "torch"}
  assert "deepspeed/semantics.json" in rep["artifacts"]
  p = _cli("report", str(folder))
  assert p.returncode == 0 and "UNVERIFIED" not in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]


@pytest.mark.process
@requires_all
def test_a_family_plant_fails_at_step_0_naming_the_item_and_both_values(runs):
  rc, rep, out, _ = runs("family")
  assert rc == 1 and rep is not None, out[-3000:]
  first = rep["verdict"]["first_failure"]
  assert first["metric"] == "semantics" and first["step"] == 0 and first["sides"] == ["jax", "torch"]
  detail = _checks(rep)["semantics jax~torch"]["detail"]
  assert detail.startswith("semantics: attention.softcap jax=2.0 torch=50.0; forward.probe_loss jax="), detail
  s = rep["sides"]["torch"]
  assert s["status"] == "crashed" and s["series"]["step"] == [] and "attention.softcap jax=2.0 torch=50.0" in s["error"]
  rows = {r["item"]: r for r in rep["semantics"]["rows"]}
  assert rows["attention.window"]["agree"] and rows["attention.window"]["values"]["torch"] == [8, "full"]
  assert rows["embedding.scale"]["values"] == {"jax": 8.0, "torch": 8.0}
