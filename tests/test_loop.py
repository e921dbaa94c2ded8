"""The one training loop (`parity.protocol.loop.run_train`), driven in-process by `FakeSide`, a numpy side.

FakeSide (tests/fake_side.py) implements every method of the `Side` protocol with a few lines of numpy, and is a
side of its own, `fake`, registered through one record (fake_side.RECORD). It is the side to copy when adding one
(docs/adding-a-side.md): write its methods for the new framework, then run these tests against it. Each run here
takes milliseconds; the real sides keep their own end-to-end worker tests (tests/test_jax_step.py,
test_torch_engine.py, test_resume.py).
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from parity import weights
from parity.data import batch_dtype
from parity.numerics import schedule
from parity.presets import preset
from parity.protocol import (CHECKPOINT_META, FINAL_MOMENTS, REQUEST_SCHEMA, derive_request, main_guard, read_moments,
                             read_steps, read_summary)
from parity.protocol.loop import EXIT_CRASHED, EXIT_NAN, EXIT_OK, Side, run_train
from parity.protocol.ranks import MULTIRANK_CHECKPOINTS
from parity.overrides import apply_overrides
from parity.spec import to_dict

import fake_side
from fake_side import FakeSide

SIDE = fake_side.NAME
"""The side the fake runs as (its folder is run_dir/fake); registered for this module's tests (`_fake_registered`)."""
STEPS = 6


@pytest.fixture(scope="module", autouse=True)
def _fake_registered():
  """The fake side registered (its one record) while this module's tests run."""
  with fake_side.registered():
    yield


# ----------------------------------------------------------------------------- run folders and runs


def make_run(root: Path, *, perturb: dict | None = None, **overrides) -> Path:
  """A run folder for gpt2-tiny (STEPS steps, random token ids; `overrides`: dotted spec keys); returns it."""
  run = apply_overrides(preset("gpt2-tiny"), {"train.steps": STEPS, "train.eval_every": 2, **overrides})
  t, rng = run.train, np.random.default_rng(0)
  root.mkdir(parents=True)
  weights.save(weights.init_params(run.model, t.seed), root / "init.safetensors")
  dtype = batch_dtype(run.model.vocab_size)
  np.save(root / "batches.npy", rng.integers(0, run.model.vocab_size, (t.steps, t.grad_accum_steps,
                                                                      t.micro_batch_size, t.seq_len + 1), dtype))
  np.save(root / "val_batches.npy", rng.integers(0, run.model.vocab_size, (t.eval_batches, t.micro_batch_size,
                                                                          t.seq_len + 1), dtype))
  request = {"schema": REQUEST_SCHEMA, "run_id": "loop-test", "run": to_dict(run), "init_weights": "init.safetensors",
             "batches": "batches.npy", "val_batches": "val_batches.npy", "perturb": {SIDE: perturb or {}}}
  (root / "request.json").write_text(json.dumps(request))
  return root


@dataclasses.dataclass
class Ran:
  code: int
  summary: dict
  steps: list[dict]
  fake: FakeSide
  out: Path


def train(run_dir: Path, fake: FakeSide | None = None, side: str = SIDE, world: int | None = None) -> Ran:
  """run_train in-process, as a worker runs it (main_guard: a crash becomes a 'crashed' summary, exit 1)."""
  fake = fake or FakeSide()

  def side_main(io):
    if world is not None:
      io.world = world  # the loop's view of a multi-rank side (SideIO's own rank set-up is not wanted in-process)
    return run_train(io, fake)
  code = main_guard(side_main, [str(run_dir / "request.json"), "--side", side])
  out = run_dir / side
  return Ran(code, read_summary(out / "summary.json"), read_steps(out / "steps.jsonl"), fake, out)


RECORD = ("step", "loss", "grad_norm", "lr", "loss_scale", "skipped", "val_loss", "tokens")


def records(steps: list[dict]) -> list[dict]:
  """The step records without their timing (step_time_s)."""
  return [{k: r[k] for k in RECORD if k in r} for r in steps]


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> Ran:
  """One uninterrupted fake run (STEPS steps, eval every 2), shared by the tests that compare against it."""
  return train(make_run(tmp_path_factory.mktemp("loop") / "full"))


# ----------------------------------------------------------------------------- tests


def test_fake_side_implements_the_protocol():
  assert isinstance(FakeSide(), Side)


def test_an_ok_run_writes_every_record_and_its_summary(full):
  assert full.code == EXIT_OK and full.summary["status"] == "ok" and full.summary["error"] is None
  assert [r["step"] for r in full.steps] == list(range(STEPS))
  assert all(r["step_time_s"] >= 0 and r["tokens"] == preset("gpt2-tiny").train.tokens_per_step for r in full.steps)
  s = full.summary
  assert s["steps_completed"] == STEPS and s["compile_s"] == 0.25 and s["versions"]["numpy"] == np.__version__
  assert s["device"] == "cpu" and s["state_bytes_by_memory_kind"]["host"] > 0 and s["fake_updates"] == STEPS
  assert "moments_error" not in s and "checkpoint" not in s
  final = weights.load(full.out / "final.safetensors")
  assert all(np.array_equal(final[k], v) for k, v in full.fake.canonical_params().items())
  moments = read_moments(full.out / FINAL_MOMENTS)
  assert set(moments) == {"grad_rms", "sensitivity"}
  assert all(np.array_equal(moments["grad_rms"][k], v) for k, v in full.fake.canonical_moments().items())
  # every step: sync, step, sync (the timed part), in this order, inside side.training(); one probe, the first step
  assert full.fake.calls[:2] == ["build", "compile (1, 4, 33) (2, 4, 33)"]
  assert full.fake.calls[2:6] == ["sync", "step", "sync", "sync"] and full.fake.probes == [0]
  assert full.fake.calls[-1] == "close" and full.fake.calls.count("close") == 1  # after the summary, once


def test_close_runs_after_a_nan_and_never_after_a_crash(tmp_path):
  nan = train(make_run(tmp_path / "nan", perturb={"nan_at_step": 1}))
  assert nan.code == EXIT_NAN and nan.fake.calls[-1] == "close"
  crash = train(make_run(tmp_path / "crash", perturb={"raise_at_step": 1}))  # a barrier could wait on a dead rank
  assert crash.code == EXIT_CRASHED and "close" not in crash.fake.calls


def test_eval_cadence_every_n_and_the_last_step(tmp_path, full):
  assert [r["step"] for r in full.steps if "val_loss" in r] == [1, 3, 5]
  ran = train(make_run(tmp_path / "r", **{"train.eval_every": 4}))
  assert [r["step"] for r in ran.steps if "val_loss" in r] == [3, 5]  # every 4th, and the last
  off = train(make_run(tmp_path / "off", **{"train.eval_every": 0}))
  assert not any("val_loss" in r for r in off.steps) and "eval" not in off.fake.calls
  assert off.fake.calls[1] == "compile (1, 4, 33) None"  # no eval to compile


def test_nan_stops_the_run_with_the_same_summary_fields(tmp_path, full):
  ran = train(make_run(tmp_path / "r", perturb={"nan_at_step": 2}))
  assert ran.code == EXIT_NAN and ran.summary["status"] == "nan" and ran.summary["steps_completed"] == 3
  assert ran.summary["perturbed"] == {"nan_at_step": 2}
  assert [r["step"] for r in ran.steps] == [0, 1, 2] and math.isnan(ran.steps[2]["loss"])
  assert records(ran.steps[:2]) == records(full.steps[:2])
  assert ran.summary["error"].startswith("non-finite loss or grad norm at step 2: {'loss': nan")
  assert not (ran.out / "final.safetensors").exists() and not (ran.out / FINAL_MOMENTS).exists()
  # the side's summary fields are written on the NaN path too (both workers: versions, device, memory, extra)
  assert set(full.summary) - set(ran.summary) == set() and ran.summary["fake_updates"] == 3


def test_resume_continues_at_the_checkpoints_step_plus_one(tmp_path, full):
  root = make_run(tmp_path / "r")
  derive_request(root, "stop", stop_after_step=2, save_checkpoint_at_step=2)
  derive_request(root, "resume", resume_from="../stop/{side}/checkpoint")
  stop, resume = train(root / "stop"), train(root / "resume")
  assert records(stop.steps) == records(full.steps[:3]) and stop.summary["stopped_after_step"] == 2
  assert stop.summary["checkpoint"]["step"] == 2 and stop.fake.calls[-2:] == ["save 2", "close"]
  meta = json.loads((stop.out / "checkpoint" / CHECKPOINT_META).read_text())
  assert (meta["side"], meta["step"], meta["format"], meta["versions"]["numpy"]) \
      == (SIDE, 2, "fake npz", np.__version__)
  assert resume.fake.calls[:2] == ["build", "restore 2"]
  assert [r["step"] for r in resume.steps] == [3, 4, 5] and records(resume.steps) == records(full.steps[3:])
  assert resume.summary["resumed_from_step"] == 2 and resume.summary["steps_completed"] == STEPS
  assert resume.fake.probes == [0]  # the first step this process runs (step 3) is the probe
  final, want = weights.load(resume.out / "final.safetensors"), weights.load(full.out / "final.safetensors")
  assert all(np.array_equal(final[k], want[k]) for k in want)


def test_save_at_k_keeps_training_to_the_end(tmp_path, full):
  root = make_run(tmp_path / "r")
  derive_request(root, "save", save_checkpoint_at_step=3)
  ran = train(root / "save")
  assert ran.code == EXIT_OK and records(ran.steps) == records(full.steps)  # saving does not disturb training
  assert ran.summary["checkpoint"]["step"] == 3 and "stopped_after_step" not in ran.summary
  at = ran.fake.calls.index("save 3")
  assert ran.fake.calls[:at].count("step") == 4 and ran.fake.calls[at:].count("step") == 2  # after step 3 (the 4th)
  with np.load(ran.out / "checkpoint" / "state.npz") as z:
    assert int(z["updates"]) == 4


def test_without_adam_moments_the_params_rule_falls_back_and_says_why(tmp_path):
  ran = train(make_run(tmp_path / "sgd", **{"train.optimizer": "sgd", "train.momentum": 0.9}))
  assert ran.code == EXIT_OK and ran.summary["moments_error"].startswith("KeyError: ")
  assert (ran.out / "final.safetensors").exists() and not (ran.out / FINAL_MOMENTS).exists()
  assert ran.fake.moment_calls == 1  # the first failure stops the accumulation


def test_moments_that_fail_midway_stop_the_accumulation(tmp_path):
  ran = train(make_run(tmp_path / "r"), FakeSide(moments_fail_at=2))
  assert ran.code == EXIT_OK and ran.summary["moments_error"] == "RuntimeError: exp_avg_sq not found"
  assert ran.fake.moment_calls == 3 and not (ran.out / FINAL_MOMENTS).exists()


def test_forced_overflow_skips_the_step_and_is_not_a_nan(tmp_path):
  ran = train(make_run(tmp_path / "r", perturb={"overflow_at_steps": [1, 2]}, **{"train.precision": "fp16"}))
  assert ran.code == EXIT_OK and [r["skipped"] for r in ran.steps] == [False, True, True, False, False, False]
  assert [math.isinf(r["grad_norm"]) for r in ran.steps] == [r["skipped"] for r in ran.steps]
  scales = [r["loss_scale"] for r in ran.steps]
  assert scales[1] == scales[0] and scales[2] == scales[1] / 2 and scales[3] == scales[2] / 2
  t = ran.fake.run.train
  assert [r["lr"] for r in ran.steps] == [schedule.train_lr(t, k) for k in (0, 1, 1, 1, 2, 3)]  # frozen on skips
  assert ran.fake.moment_calls == 4 + 1  # accumulated on the 4 applied steps, then read once at the end


def test_forced_overflow_without_fp16_is_a_crash_naming_the_setting(tmp_path):
  ran = train(make_run(tmp_path / "r", perturb={"overflow_at_steps": [1]}))
  assert ran.code == EXIT_CRASHED and ran.summary["status"] == "crashed"
  assert "force_overflow" in ran.summary["error"] and "train.precision='fp32'" in ran.summary["error"]
  assert [r["step"] for r in ran.steps] == [0]


def test_an_injected_failure_is_a_crash_with_its_records(tmp_path):
  ran = train(make_run(tmp_path / "r", perturb={"raise_at_step": 1}))
  assert ran.code == EXIT_CRASHED and ran.summary["status"] == "crashed"
  assert "injected failure at step 1" in ran.summary["error"] and len(ran.steps) == 1


def test_a_base_exception_of_a_library_is_a_crash_with_its_cause_in_one_line(tmp_path):
  """torch.distributed.checkpoint's CheckpointException derives from BaseException and carries each rank's
  traceback in its message: main_guard let it through as a bare traceback and no summary (a
  truncated DCP shard). It is a 'crashed' summary now, its error the first line and the cause; Ctrl-C still
  propagates."""

  class CheckpointException(BaseException):
    pass

  class Failing(FakeSide):
    def step(self, batch, **kw):
      raise CheckpointException("CheckpointException ranks:dict_keys([0])\nTraceback (most recent call last):\n"
                                "  File \"x.py\", line 1, in load\nEOFError: Ran out of input")

  ran = train(make_run(tmp_path / "r"), Failing())
  assert ran.code == EXIT_CRASHED and ran.summary["status"] == "crashed"
  assert ran.summary["error"] == ("CheckpointException: CheckpointException ranks:dict_keys([0]) ... "
                                  "EOFError: Ran out of input")

  class Interrupted(FakeSide):
    def step(self, batch, **kw):
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    train(make_run(tmp_path / "k"), Interrupted())


def test_multirank_checkpoints_are_refused_before_the_side_is_built(tmp_path):
  from parity.errors import SpecError
  from parity.pipeline.compare import RunOptions, check_run_options
  root = make_run(tmp_path / "r")
  derive_request(root, "save", save_checkpoint_at_step=1)
  ran = train(root / "save", world=2)
  assert ran.code == EXIT_CRASHED and MULTIRANK_CHECKPOINTS in ran.summary["error"]
  assert "save_checkpoint_at_step/resume_from (2 ranks per side)" in ran.summary["error"]
  assert ran.fake.calls == [] and ran.steps == []
  with pytest.raises(SpecError) as refused:  # the harness refuses it first, with the same text
    check_run_options(preset("gpt2-tiny"), {}, RunOptions(nproc=2, resume_at=1))
  assert MULTIRANK_CHECKPOINTS in str(refused.value)


@pytest.mark.parametrize("resume_from, needles", [
    ("../nowhere/{side}/checkpoint", ["resume_from='../nowhere/{side}/checkpoint'", f"nowhere/{SIDE}/checkpoint",
                                      "missing/request.json"]),
    ("../jax_stop/jax/checkpoint", ["checkpoint of side 'jax'", f"this is side '{SIDE}'"]),
])
def test_a_refused_resume_writes_no_records(tmp_path, resume_from, needles):
  root = make_run(tmp_path / "r")
  if "jax_stop" in resume_from:  # a checkpoint saved by another side
    derive_request(root, "jax_stop", stop_after_step=1, save_checkpoint_at_step=1)
    assert train(root / "jax_stop", side="jax").code == EXIT_OK
  derive_request(root, "missing", resume_from=resume_from)
  ran = train(root / "missing")
  assert ran.code == EXIT_CRASHED and ran.steps == [] and not (ran.out / "final.safetensors").exists()
  assert all(n in ran.summary["error"] for n in needles), ran.summary["error"]
  assert ran.fake.calls == []


def test_resume_with_another_train_spec_is_refused(tmp_path):
  root = make_run(tmp_path / "r")
  derive_request(root, "stop", stop_after_step=1, save_checkpoint_at_step=1)
  assert train(root / "stop").code == EXIT_OK
  path = derive_request(root, "other_lr", resume_from="../stop/{side}/checkpoint")
  request = json.loads(path.read_text())
  request["perturb"] = {SIDE: {"train.lr": 2e-3}}
  path.write_text(json.dumps(request))
  ran = train(root / "other_lr")
  assert ran.code == EXIT_CRASHED and "train.lr: checkpoint 0.001 != this run 0.002" in ran.summary["error"]


def _reached(module: str) -> set[str]:
  """Project modules importing `module` imports, transitively: module-level imports (what `import` runs; a
  function's own imports run only when it is called), with every package's __init__ (parsed, not run)."""
  import ast
  root, seen, todo = Path(__file__).resolve().parents[1], set(), [module]
  while todo:
    name = todo.pop()
    path = next((p for p in (root / (name.replace(".", "/") + ".py"), root / name.replace(".", "/") / "__init__.py")
                 if p.is_file()), None)
    if name in seen or path is None:
      continue
    seen.add(name)
    todo += [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]  # its packages
    for node in ast.parse(path.read_text()).body:
      for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
        names = [a.name for a in sub.names] if isinstance(sub, ast.Import) else \
            [sub.module, *(f"{sub.module}.{a.name}" for a in sub.names)] if isinstance(sub, ast.ImportFrom) and \
            sub.module and sub.level == 0 else []
        todo += [n for n in names if n.split(".")[0] in ("parity", "harness", "jax_impl", "torch_impl")]
  return seen


@pytest.mark.parametrize("worker", ["jax_impl.worker", "jax_impl.diagnose", "torch_impl.worker", "torch_impl.diagnose"])
def test_workers_reach_neither_the_diagnose_driver_nor_the_pipeline(worker):
  reached = _reached(worker)
  assert "parity.protocol.loop" in reached or "parity.protocol.diagnose" in reached
  assert not {m for m in reached if m.startswith(("parity.diagnose", "parity.pipeline", "parity.report",
                                                  "harness.runner"))}, worker
  if worker.startswith("jax_impl"):  # the launcher is not a worker's: nothing of harness at all
    assert not {m for m in reached if m.startswith("harness")}, worker


def _padded_run(root: Path, **overrides) -> Path:
  """A padded sft-tiny run folder written by the real contract code (prepare_run_dir; the demo examples)."""
  from parity.pipeline.folder import prepare_run_dir
  spec = apply_overrides(preset("sft-tiny"), {"train.steps": 3, "train.eval_every": 3, **overrides}).validate()
  prepare_run_dir(spec, root)
  return root


class _DataTerm(FakeSide):
  """FakeSide recording the data term of each loss (the mean over micro batches of sum(weights * target) / V)."""

  def __init__(self):
    super().__init__()
    self.terms, self.val_terms = [], []

  def _term(self, tokens, arrays) -> float:
    return float(np.mean(np.sum(arrays.weights * tokens[..., 1:], axis=(1, 2)))) / self.run.model.vocab_size

  def step(self, batch, *, probe, force_overflow, arrays=None):
    self.terms.append(self._term(batch, arrays))
    return super().step(batch, probe=probe, force_overflow=force_overflow, arrays=arrays)

  def eval_loss(self, val, arrays=None):
    self.val_terms.append(self._term(val, arrays))
    return super().eval_loss(val, arrays)


@pytest.mark.parametrize("normalization", ["tokens", "micro_mean"])
def test_a_padded_run_gets_the_arrays_and_its_loss_is_the_step_objective(tmp_path, normalization):
  from parity.dataset import token_weights
  run_dir = _padded_run(tmp_path / "padded", **{"train.loss_normalization": normalization})
  ran = train(run_dir, _DataTerm())
  assert ran.code == EXIT_OK, ran.summary.get("error")
  assert ran.fake.calls[1].endswith(" examples")  # compile was told the step takes the arrays
  tokens, mask = np.load(run_dir / "batches.npy"), np.load(run_dir / "loss_mask.npy")
  w = token_weights(mask, normalization)
  v = preset("sft-tiny").model.vocab_size
  # the weights carry A*W: the mean over micro batches of sum(weights * x) is the step objective sum(w * x)
  want = [float(np.sum(w[s] * tokens[s, ..., 1:])) / v for s in range(len(ran.steps))]
  assert np.allclose(ran.fake.terms, want, rtol=1e-6, atol=0)  # float32 weights: rounding only
  val, vmask = np.load(run_dir / "val_batches.npy"), np.load(run_dir / "val_loss_mask.npy")
  vw = token_weights(vmask[:, None], "tokens")[:, 0]  # each validation batch's weights sum to 1
  assert np.allclose(ran.fake.val_terms, [np.mean(np.sum(vw * val[..., 1:], axis=(1, 2))) / v], rtol=1e-6)
  if normalization == "tokens":
    assert np.allclose([np.sum(w[s]) for s in range(len(ran.steps))], 1.0)


def test_a_padded_run_with_two_ranks_gives_each_rank_its_rows(tmp_path):
  run_dir = _padded_run(tmp_path / "padded2")
  seen = []

  class Recording(FakeSide):
    def step(self, batch, *, probe, force_overflow, arrays=None):
      seen.append((batch.shape, arrays.weights.shape, arrays.segment_ids.dtype))
      return super().step(batch, probe=probe, force_overflow=force_overflow, arrays=arrays)
  ran = train(run_dir, Recording(), world=2)
  assert ran.code == EXIT_OK, ran.summary.get("error")
  t = preset("sft-tiny").train
  assert seen[0] == ((t.grad_accum_steps, t.micro_batch_size // 2, t.seq_len + 1),
                     (t.grad_accum_steps, t.micro_batch_size // 2, t.seq_len), np.dtype(np.int32))


def test_example_arrays_of_the_wrong_shape_are_refused_naming_the_file(tmp_path):
  run_dir = _padded_run(tmp_path / "bad")
  seg = np.load(run_dir / "segment_ids.npy")
  (run_dir / "segment_ids.npy").unlink()
  np.save(run_dir / "segment_ids.npy", seg[..., :-1])
  ran = train(run_dir)
  assert ran.code == EXIT_CRASHED and "segment_ids.npy has shape" in ran.summary["error"]
  assert "regenerate the run folder" in ran.summary["error"]
