"""Checkpoint / resume parity and stopping early, through the run protocol (parity.protocol run control).

Per side (jax with the default plan: optimizer state in pinned_host; torch; deepspeed ZeRO-2 with CPU
offload), on gpt2-tiny with 8 steps, in one shared run folder:
  main/           (a) the uninterrupted run
  repeat/         (a') the same run again, saving a checkpoint after step 5 on the way: records and final
                      weights must be bit-identical to (a)'s (saving does not disturb training)
  stop/           (b) stop_after_step=3, save_checkpoint_at_step=3
  resume/         (c) a new process resuming from stop/<side>/checkpoint: its steps 4..7 and final
                      weights must equal (a)'s bit for bit
Records are compared with exact float equality; weights with np.array_equal.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import requires_deepspeed, requires_jax, requires_torch
from parity.protocol import CHECKPOINT_META, ControlError, SideIO, derive_request, read_steps

STEPS, K = 8, 3
K_LATE = 5
"""Checkpoint step of the repeat run: DeepSpeedCPUAdam's beta powers first differ by pow vs product at step 6."""
RECORD_KEYS = ("step", "loss", "grad_norm", "lr", "loss_scale", "skipped", "val_loss")
"""Step-record fields that must match exactly (val_loss: step 7 is an eval step of gpt2-tiny)."""
TIMEOUT_S = 600.0
SIDES = [pytest.param("jax", marks=requires_jax), pytest.param("torch", marks=requires_torch),
         pytest.param("deepspeed", marks=requires_deepspeed)]


class Runs:
  """One prepared gpt2-tiny run folder with derived requests; each (sub folder, side) runs at most once."""

  def __init__(self, root: Path):
    from parity.pipeline.folder import prepare_run_dir
    from parity.pipeline.resolve import resolve
    self.root = root
    self.spec = resolve("gpt2-tiny", steps=STEPS)
    prepare_run_dir(self.spec, root)
    derive_request(root, "repeat", save_checkpoint_at_step=K_LATE)
    derive_request(root, "stop", stop_after_step=K, save_checkpoint_at_step=K)
    derive_request(root, "resume", resume_from="../stop/{side}/checkpoint")
    self._done: dict[tuple[str, str], object] = {}

  def dir(self, sub: str) -> Path:
    return self.root if sub == "main" else self.root / sub

  def run(self, sub: str, side: str):
    """harness.runner.run_side on run_dir/<sub> (main: the run folder itself); cached."""
    from harness.runner import run_side
    if (sub, side) not in self._done:
      self._done[sub, side] = run_side(self.dir(sub), side, timeout_s=TIMEOUT_S)
    return self._done[sub, side]

  def ok(self, sub: str, side: str) -> tuple[dict, list[dict], dict[str, np.ndarray]]:
    """Runs and asserts status ok; returns (summary, step records, final weights)."""
    from safetensors.numpy import load_file
    res = self.run(sub, side)
    assert res.status == "ok", f"{sub}/{side}: {res.status}: {res.error}"
    out = self.dir(sub) / side
    return res.summary, read_steps(out / "steps.jsonl"), load_file(out / "final.safetensors")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
  return Runs(tmp_path_factory.mktemp("resume") / "run")


def assert_records_equal(got: list[dict], want: list[dict]) -> None:
  assert [r["step"] for r in got] == [r["step"] for r in want]
  for g, w in zip(got, want):
    diffs = {k: (g.get(k), w.get(k)) for k in RECORD_KEYS if g.get(k) != w.get(k)}
    assert not diffs, f"step {w['step']}: {diffs} (got, want)"


def assert_weights_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
  assert sorted(got) == sorted(want)
  bad = {k: float(np.abs(got[k] - want[k]).max()) for k in want if not np.array_equal(got[k], want[k])}
  assert not bad, f"final weights differ (max abs per tensor): {bad}"


# ----------------------------------------------------------------------------- protocol (no workers)


def test_derive_request_shares_the_parents_inputs(tiny_run_dir):
  rd, _ = tiny_run_dir(steps=4)
  path = derive_request(rd, "checks/stop", stop_after_step=1, save_checkpoint_at_step=1, resume_from=None)
  req = json.loads(path.read_text())
  assert path == rd / "checks" / "stop" / "request.json"
  assert req["init_weights"] == "../../init.safetensors" and req["derived_from"] == "../../request.json"
  assert req["stop_after_step"] == 1 and "resume_from" not in req
  parent, child = SideIO(rd / "request.json", "torch"), SideIO(path, "torch")
  assert all(np.array_equal(parent.init_params()[k], v) for k, v in child.init_params().items())
  assert np.array_equal(parent.batches(), child.batches())
  ctl = child.control()
  assert (ctl.first_step, ctl.last_step, ctl.save_at) == (0, 1, 1) and list(ctl.steps()) == [0, 1]
  assert "stop_after_step" not in json.loads(derive_request(rd / "checks" / "stop", "again").read_text())
  with pytest.raises(ControlError, match="unknown key.*stop_at"):
    derive_request(rd, "x", stop_at=1)
  with pytest.raises(ControlError, match="sub_dir"):
    derive_request(rd, "../outside")


@pytest.mark.parametrize("keys, message", [
    ({"stop_after_step": 4}, r"stop_after_step=4 .* must be in \[0, 3\]"),
    ({"stop_after_step": "2"}, r"stop_after_step in .* takes a step number"),
    ({"stop_after_step": 1, "save_checkpoint_at_step": 2}, r"save_checkpoint_at_step=2 .* never reached"),
])
def test_malformed_control_keys_name_the_key(tiny_run_dir, keys, message):
  rd, _ = tiny_run_dir(steps=4)
  request = json.loads((rd / "request.json").read_text())
  (rd / "bad").mkdir()
  (rd / "bad" / "request.json").write_text(json.dumps({**request, **keys, "init_weights": "../init.safetensors"}))
  with pytest.raises(ControlError, match=message):
    SideIO(rd / "bad" / "request.json", "jax").control()


# ----------------------------------------------------------------------------- per side, with workers


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("side", SIDES)
def test_repeat_run_is_bit_identical(runs, side):
  _, steps_a, final_a = runs.ok("main", side)
  _, steps_r, final_r = runs.ok("repeat", side)
  assert len(steps_a) == STEPS
  assert_records_equal(steps_r, steps_a)
  assert_weights_equal(final_r, final_a)


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("side", SIDES)
def test_stop_after_step_is_a_prefix_and_saves_a_checkpoint(runs, side):
  _, steps_a, _ = runs.ok("main", side)
  summary, steps_b, final_b = runs.ok("stop", side)
  assert_records_equal(steps_b, steps_a[:K + 1])  # the lr schedule still spans train.steps
  assert summary["steps_completed"] == K + 1 and summary["stopped_after_step"] == K
  assert summary["checkpoint"]["step"] == K and final_b
  meta = json.loads((runs.dir("stop") / side / "checkpoint" / CHECKPOINT_META).read_text())
  assert (meta["side"], meta["step"], meta["run"]["train"]["steps"]) == (side, K, STEPS)


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("side", SIDES)
def test_resume_continues_bit_for_bit(runs, side):
  _, steps_a, final_a = runs.ok("main", side)
  runs.ok("stop", side)
  summary, steps_c, final_c = runs.ok("resume", side)
  assert [r["step"] for r in steps_c] == list(range(K + 1, STEPS))
  assert_records_equal(steps_c, steps_a[K + 1:])
  assert_weights_equal(final_c, final_a)
  assert summary["resumed_from_step"] == K and summary["steps_completed"] == STEPS
  if side == "jax":  # the restored state is where the default plan puts it
    assert summary["state_memory_kinds"] == {"params": "device", "opt_state": "pinned_host"}


@pytest.mark.process
@pytest.mark.slow
@requires_deepspeed
def test_deepspeed_resume_restores_cpu_adams_beta_powers(runs):
  """Resuming after step 5 (the repeat run's checkpoint): DeepSpeedCPUAdam's C++ beta2^6 from std::pow differs
  from the product a fresh run builds (beta2 0.95 in float32; at steps <= 5 they agree), so without
  `torch_impl.checkpoint._replay_cpu_adam_steps` step 7's loss and ~10^4 weights differ by an ulp (measured)."""
  derive_request(runs.root, "resume_late", resume_from="../repeat/{side}/checkpoint")
  _, steps_a, final_a = runs.ok("main", "deepspeed")
  assert runs.ok("repeat", "deepspeed")[0]["checkpoint"]["step"] == K_LATE
  summary, steps_c, final_c = runs.ok("resume_late", "deepspeed")
  assert summary["resumed_from_step"] == K_LATE
  assert_records_equal(steps_c, steps_a[K_LATE + 1:])
  assert_weights_equal(final_c, final_a)


# The refusals of a resume (a missing folder, another side's checkpoint, another train spec) are the protocol's, not
# a side's: tests/test_loop.py runs them in-process (FakeSide), in milliseconds.


def test_derive_request_can_give_the_rerun_its_own_batches_and_perturbations(tmp_path):
  from parity.protocol import REQUEST_SCHEMA, derive_request
  (tmp_path / "request.json").write_text(json.dumps({"schema": REQUEST_SCHEMA, "batches": "batches.npy",
                                                     "init_weights": "init.safetensors",
                                                     "perturb": {"jax": {"train.lr": 0.002}}}))
  kept = json.loads(derive_request(tmp_path, "noise", batches="batches.npy").read_text())
  assert kept["batches"] == "batches.npy" and kept["init_weights"] == "../init.safetensors"
  assert kept["perturb"] == {"jax": {"train.lr": 0.002}}
  bug = json.loads(derive_request(tmp_path, "bug0", perturb={"torch": {"train.weight_decay": 0.0}}).read_text())
  assert bug["batches"] == "../batches.npy" and bug["perturb"] == {"torch": {"train.weight_decay": 0.0}}
