"""The DeepSpeed engine, the plain-torch baseline, and the torch worker end to end.

DeepSpeed runs only inside worker subprocesses (with a timeout), so no
torch.distributed state leaks between tests.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parity import data, weights  # noqa: E402

from parity.numerics import schedule  # noqa: E402
from parity.protocol import REQUEST_SCHEMA, read_steps, read_summary  # noqa: E402
from parity.presets import preset  # noqa: E402
from parity.overrides import apply_overrides, parse_overrides  # noqa: E402
from parity.spec import DeepSpeedPlan, ModelSpec, RunSpec, to_dict  # noqa: E402
from parity.verdict.tolerances import tolerance  # noqa: E402
from torch_impl.baseline import CLIP_EPS, TorchTrainer, clip_like_deepspeed, global_grad_norm  # noqa: E402
from torch_impl.engine import ds_config  # noqa: E402
from torch_impl.model import build_model, lm_loss  # noqa: E402

pytestmark = pytest.mark.requires_torch
REPO = Path(__file__).resolve().parents[1]
WORKER_TIMEOUT_S = 600  # the first DeepSpeed run on a machine JIT-builds CPU Adam (~60 s)

# Tolerances, fp32. The loss bound is the project table's (parity.verdict.tolerances). The others are
# tighter than that table's cross-framework, 200-step entries, because here both sides are
# torch, runs are <= 10 steps, and the bound must catch a single wrong setting:
LOSS_ATOL_FP32 = tolerance("fp32", "loss").atol
# Grad norm, relative: both sides accumulate per-tensor norms in float64 and round to float32;
#   measured <= 1.1e-7 apart.
GRAD_NORM_RTOL_FP32 = 1e-5
# Final params after <= 10 steps, absolute: measured <= 1.2e-7 (gpt2-tiny and LLaMA-tiny), so
#   2e-6 keeps ~16x headroom. Valid for short runs only: Adam turns rounding noise of
#   near-zero gradients into lr-sized steps over time (docs/numerics.md: 2e-5 to 1.7e-4 after 100
#   steps). The zero-gradient key-bias rows are excluded (parity.weights.zero_grad_slices).
#   A missing weight-decay mask alone moves a norm gain by lr * wd ~ 1e-4 per step.
PARAM_ATOL_FP32 = 2e-6
# NumPy AdamW reference (float64) vs torch AdamW (float32) after 3 steps, absolute.
ADAM_REF_ATOL = 1e-7

LLAMA_TINY = ModelSpec(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64,
                       norm="rmsnorm", norm_eps=1e-6, mlp="swiglu", position="rope", bias=False,
                       tie_embeddings=False)


# ----------------------------------------------------------------------------- helpers

def make_run_dir(path: Path, run: RunSpec, perturb: dict | None = None) -> Path:
  """Writes request.json, init.safetensors, batches.npy, val_batches.npy; returns request.json."""
  path.mkdir(parents=True, exist_ok=True)
  t = run.train
  weights.save(weights.init_params(run.model, t.seed), path / "init.safetensors")
  corpus = data.load_corpus("stdlib", max_bytes=2**20)
  train, val = data.make_batches(corpus, steps=t.steps, grad_accum_steps=t.grad_accum_steps,
                                 micro_batch_size=t.micro_batch_size, seq_len=t.seq_len, seed=t.data_seed,
                                 eval_batches=t.eval_batches)
  np.save(path / "batches.npy", train)
  np.save(path / "val_batches.npy", val)
  request = {"schema": REQUEST_SCHEMA, "run": to_dict(run), "init_weights": "init.safetensors",
             "batches": "batches.npy", "val_batches": "val_batches.npy", "perturb": perturb or {}}
  (path / "request.json").write_text(json.dumps(request, indent=1))
  return path / "request.json"


def run_worker(request: Path, side: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    env.pop(key, None)
  return subprocess.run([sys.executable, "-m", "torch_impl.worker", str(request), "--side", side], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)


def tiny_run(**train) -> RunSpec:
  run = preset("gpt2-tiny")
  return dataclasses.replace(run, train=dataclasses.replace(run.train, **train))


def assert_close(name: str, got: np.ndarray, want: np.ndarray, atol: float) -> None:
  assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
  nan = int(np.sum(np.isnan(got) != np.isnan(want)))
  diff = float(np.nanmax(np.abs(got - want))) if got.size else 0.0
  assert nan == 0 and diff < atol, f"{name}: {diff:.3g} (>= {atol}), NaN mismatches {nan}"


# ----------------------------------------------------------------------------- config

def test_ds_config_maps_every_spec_field():
  run = apply_overrides(preset("gpt2-tiny"), parse_overrides(["train.grad_accum_steps=3", "train.weight_decay=0.05",
                                              "train.grad_clip=0.5", "train.beta2=0.99"]))
  cfg = ds_config(run)
  t = run.train
  assert cfg["train_micro_batch_size_per_gpu"] == t.micro_batch_size
  assert cfg["gradient_accumulation_steps"] == 3
  assert cfg["optimizer"] == {"type": "AdamW", "params": {"lr": t.lr, "betas": [t.beta1, 0.99], "eps": t.eps,
                                                          "weight_decay": 0.05}}
  assert cfg["scheduler"] == {"type": "WarmupCosineLR", "params": {
      "total_num_steps": t.steps, "warmup_min_ratio": t.warmup_min_ratio, "warmup_num_steps": t.warmup_steps,
      "cos_min_ratio": t.cos_min_ratio, "warmup_type": "linear"}}
  assert cfg["gradient_clipping"] == 0.5
  assert cfg["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}}
  assert cfg["bf16"] == {"enabled": False}
  assert cfg["steps_per_print"] >= 10**6 and cfg["wall_clock_breakdown"] is False
  json.dumps(cfg)  # JSON-ready


@pytest.mark.parametrize("kind, params", [
    ("WarmupDecayLR", {"total_num_steps": 8, "warmup_num_steps": 3, "warmup_max_lr": 2e-3, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_num_steps": 4}),
])
def test_ds_config_scheduler_comes_from_parity_schedule(kind, params):
  run = apply_overrides(preset("gpt2-tiny"), parse_overrides([f"train.lr_schedule={kind}",
                                              f"train.lr_schedule_params={json.dumps(params)}"]))
  cfg = ds_config(run)
  assert cfg["scheduler"] == schedule.deepspeed_scheduler(run.train)
  assert cfg["scheduler"]["type"] == kind and cfg["scheduler"]["params"].items() >= params.items()
  constant = apply_overrides(preset("gpt2-tiny"), parse_overrides(["train.lr_schedule=Constant"]))
  assert "scheduler" not in ds_config(constant)


@pytest.mark.parametrize("plan, zero", [
    (DeepSpeedPlan(zero_stage=0, offload_optimizer="none"), {"stage": 0}),
    (DeepSpeedPlan(zero_stage=1, offload_optimizer="none"), {"stage": 1}),
    (DeepSpeedPlan(zero_stage=3, offload_param="cpu"), {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
        "offload_param": {"device": "cpu", "pin_memory": False}}),
])
def test_ds_config_zero_section(plan, zero):
  run = dataclasses.replace(preset("gpt2-tiny"), deepspeed=plan)
  assert ds_config(run)["zero_optimization"] == zero
  bf16 = dataclasses.replace(run, train=dataclasses.replace(run.train, precision="bf16"))
  assert ds_config(bf16)["bf16"] == {"enabled": True}


# ----------------------------------------------------------------------------- baseline

def test_clip_uses_deepspeed_formula():
  g = [torch.tensor([3.0, 4.0]), torch.tensor([12.0])]  # ||g|| = 13
  params = [torch.zeros(2, requires_grad=True), torch.zeros(1, requires_grad=True)]
  for p, gi in zip(params, g):
    p.grad = gi.clone()
  norm = global_grad_norm(params)
  assert float(norm) == 13.0 and norm.dtype == torch.float32
  divisor = clip_like_deepspeed(params, 2.0, norm)
  want_div = np.float32((np.float32(13.0) + np.float32(CLIP_EPS)) / np.float32(2.0))
  assert divisor == pytest.approx(float(want_div), rel=1e-7)
  for p, gi in zip(params, g):
    expected = gi * (torch.tensor(1.0) / torch.tensor(want_div))  # g * (1 / divisor), DeepSpeed's order
    assert torch.equal(p.grad, expected)
  # below the threshold the gradient is untouched (the divisor is clamped at 1)
  for p, gi in zip(params, g):
    p.grad = gi.clone()
  assert clip_like_deepspeed(params, 20.0, norm) == 1.0
  assert all(torch.equal(p.grad, gi) for p, gi in zip(params, g))
  assert clip_like_deepspeed(params, 0.0, norm) == 1.0  # 0 disables clipping


def _numpy_adamw(params, grads_per_step, lrs, t, decayed):
  """Float64 AdamW with DeepSpeed clipping: p <- p(1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)."""
  p = {k: v.astype(np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v = {k: np.zeros_like(x) for k, x in p.items()}
  for step, (grads, lr) in enumerate(zip(grads_per_step, lrs), start=1):
    norm = math.sqrt(sum(float((g ** 2).sum()) for g in grads.values()))
    div = max(1.0, (norm + CLIP_EPS) / t.grad_clip)
    for k in p:
      g = grads[k] / div
      m[k] = t.beta1 * m[k] + (1 - t.beta1) * g
      v[k] = t.beta2 * v[k] + (1 - t.beta2) * g * g
      mhat, vhat = m[k] / (1 - t.beta1 ** step), v[k] / (1 - t.beta2 ** step)
      wd = t.weight_decay if decayed(k) else 0.0
      p[k] = p[k] * (1 - lr * wd) - lr * mhat / (np.sqrt(vhat) + t.eps)
  return p


def test_baseline_matches_numpy_adamw_reference():
  """Three steps: lr is 0 at steps 0 and 1 (DeepSpeed's schedule), so all three gradients
  are taken at the initial params, and the moments of steps 0-1 still count at step 2."""
  run = tiny_run(steps=12, grad_accum_steps=2, warmup_steps=2, lr=1e-2, weight_decay=0.3)
  t = run.train
  params = weights.init_params(run.model, 0)
  rng = np.random.default_rng(0)
  batches = rng.integers(0, 256, size=(3, t.grad_accum_steps, t.micro_batch_size, t.seq_len + 1)).astype(np.uint16)
  ref_model = build_model(run.model, params)
  grads_per_step = []
  for micro in batches:
    ref_model.zero_grad(set_to_none=True)
    for mb in micro:
      tok = torch.from_numpy(mb.astype(np.int64))
      (lm_loss(ref_model(tok[:, :-1]), tok[:, 1:]) / t.grad_accum_steps).backward()
    grads_per_step.append({n: p.grad.double().numpy().copy() for n, p in ref_model.named_parameters()})
  lrs = [schedule.train_lr(t, k) for k in range(3)]
  assert lrs[0] == lrs[1] == 0.0 and lrs[2] > 0
  want = _numpy_adamw(params, grads_per_step, lrs, t, weights.decays)

  trainer = TorchTrainer(run, params)
  metrics = [trainer.step(b) for b in batches]
  assert [m["lr"] for m in metrics] == lrs
  norm0 = math.sqrt(sum(float((g ** 2).sum()) for g in grads_per_step[0].values()))
  assert metrics[0]["grad_norm"] == pytest.approx(norm0, rel=1e-6)
  assert norm0 > t.grad_clip, "the test must exercise clipping"
  got = trainer.canonical_params()
  for k in want:
    assert_close(k, got[k].astype(np.float64), want[k], ADAM_REF_ATOL)
  moved = max(float(np.abs(got[k] - params[k]).max()) for k in params)
  assert moved > 1e-3, "step 2 must change the params (lr > 0)"


def test_baseline_state_bytes():
  run = tiny_run(steps=2)
  t = run.train
  trainer = TorchTrainer(run, weights.init_params(run.model, 0))
  trainer.step(np.zeros((t.grad_accum_steps, t.micro_batch_size, t.seq_len + 1), np.uint16), probe=True)
  n = weights.n_params(run.model)
  assert trainer.state_bytes() == {"params": {"device": 4 * n, "host": 0}, "gradients": {"device": 4 * n, "host": 0},
                                   "master_params": {"device": 0, "host": 0},
                                   "optimizer_moments": {"device": 8 * n, "host": 0},
                                   "buffers": {"device": 0, "host": 0}}


def test_baseline_nan_poison_gives_nan_loss():
  run = tiny_run(steps=2)
  t = run.train
  trainer = TorchTrainer(run, weights.init_params(run.model, 0))
  trainer.poison()
  batch = np.zeros((t.grad_accum_steps, t.micro_batch_size, t.seq_len + 1), np.uint16)
  assert math.isnan(trainer.step(batch)["loss"])


# ----------------------------------------------------------------------------- workers (slow)

@pytest.fixture(scope="module")
def gpt2_runs(tmp_path_factory):
  """gpt2-tiny, 10 steps, 2 micro batches per step, clipping active; both torch sides."""
  pytest.importorskip("deepspeed")
  run = tiny_run(steps=10, grad_accum_steps=2, eval_every=5)
  request = make_run_dir(tmp_path_factory.mktemp("gpt2"), run)
  procs = {side: run_worker(request, side) for side in ("deepspeed", "torch")}
  return run, request.parent, procs


def _load_side(run_dir: Path, side: str, proc: subprocess.CompletedProcess):
  assert proc.returncode == 0, f"{side} worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
  steps = read_steps(run_dir / side / "steps.jsonl")
  summary = read_summary(run_dir / side / "summary.json")
  final = weights.load(run_dir / side / "final.safetensors")
  return steps, summary, final


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.requires_deepspeed
@pytest.mark.parametrize("side", ["deepspeed", "torch"])
def test_worker_writes_records_summary_and_final_weights(gpt2_runs, side):
  run, run_dir, procs = gpt2_runs
  steps, summary, final = _load_side(run_dir, side, procs[side])
  t = run.train
  assert [r["step"] for r in steps] == list(range(t.steps))
  for r in steps:
    assert set(r) >= {"step", "loss", "grad_norm", "lr", "loss_scale", "skipped", "step_time_s", "tokens"}
    assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["step_time_s"] > 0
    assert r["tokens"] == t.tokens_per_step and r["loss_scale"] == 1.0 and r["skipped"] is False
  assert [r["step"] for r in steps if "val_loss" in r] == [4, 9]
  assert summary["status"] == "ok" and summary["side"] == side and summary["steps_completed"] == t.steps
  assert summary["versions"]["torch"] == torch.__version__ and summary["versions"]["deepspeed"]
  assert summary["device"] == "cpu" and summary["peak_device_bytes"] is None
  th = summary["threads"]  # what the worker ran with: the conftest's choice (harness.env), torch's own count
  assert th["torch_num_threads"] == int(th["OMP_NUM_THREADS"]) and th["torch_interop_threads"] >= 1
  # None: unset (idle)
  assert th["OMP_WAIT_POLICY"] == os.environ.get("OMP_WAIT_POLICY") and th["set_by"] and th["reason"]
  assert set(final) == set(weights.param_shapes(run.model))
  weights.check_names_and_shapes(final, run.model, source=side)
  n = weights.n_params(run.model)
  cat = summary["state_bytes_by_category"]
  assert sum(cat["optimizer_moments"].values()) == 2 * 4 * n  # fp32 exp_avg + exp_avg_sq
  assert sum(summary["state_bytes_by_memory_kind"].values()) == sum(sum(k.values()) for k in cat.values())


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.requires_deepspeed
@pytest.mark.parametrize("side", ["deepspeed", "torch"])
def test_applied_lr_is_the_deepspeed_schedule(gpt2_runs, side):
  run, run_dir, procs = gpt2_runs
  steps, _, _ = _load_side(run_dir, side, procs[side])
  for r in steps:
    assert r["lr"] == pytest.approx(schedule.train_lr(run.train, r["step"]), rel=1e-12, abs=0), r


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.requires_deepspeed
def test_engine_is_zero2_offload_with_cpu_adam(gpt2_runs):
  run, run_dir, procs = gpt2_runs
  _, summary, _ = _load_side(run_dir, "deepspeed", procs["deepspeed"])
  opt = summary["optimizer"]
  assert opt["engine"] == "DeepSpeedEngine" and opt["wrapper"] == "DeepSpeedZeroOptimizer"
  assert opt["optimizer"] == "DeepSpeedCPUAdam" and opt["adamw_mode"] is True and opt["cpu_offload"] is True
  assert opt["scheduler"] == "WarmupCosineLR" and summary["zero_stage"] == 2 == opt["zero_stage"]
  assert opt["group_weight_decay"] == [run.train.weight_decay, 0.0]
  assert summary["ds_config"]["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
  cat, n = summary["state_bytes_by_category"], weights.n_params(run.model)
  assert cat["master_params"] == {"device": 0, "host": 4 * n}
  assert cat["optimizer_moments"] == {"device": 0, "host": 8 * n}
  assert cat["params"] == {"device": 4 * n, "host": 0}
  assert cat["gradients"]["host"] >= 4 * n  # fp32 gradient partition on the host


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.requires_deepspeed
def test_deepspeed_matches_torch_baseline(gpt2_runs):
  run, run_dir, procs = gpt2_runs
  ds_steps, _, ds_final = _load_side(run_dir, "deepspeed", procs["deepspeed"])
  pt_steps, _, pt_final = _load_side(run_dir, "torch", procs["torch"])
  assert all(r["grad_norm"] > run.train.grad_clip for r in pt_steps), "the run must exercise clipping"
  for a, b in zip(ds_steps, pt_steps):
    assert abs(a["loss"] - b["loss"]) < LOSS_ATOL_FP32, (a, b)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=GRAD_NORM_RTOL_FP32), (a, b)
    if "val_loss" in a:
      assert abs(a["val_loss"] - b["val_loss"]) < LOSS_ATOL_FP32, (a, b)
  zero = weights.zero_grad_slices(run.model)
  for k in ds_final:
    got, want = ds_final[k].copy(), pt_final[k].copy()
    if k in zero:
      lo, hi = zero[k]
      got[lo:hi] = want[lo:hi] = 0
    assert_close(k, got, want, PARAM_ATOL_FP32)


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.requires_deepspeed
def test_llama_style_deepspeed_matches_torch_baseline(tmp_path):
  pytest.importorskip("deepspeed")
  run = dataclasses.replace(tiny_run(steps=6, eval_every=0), model=LLAMA_TINY)
  request = make_run_dir(tmp_path, run)
  results = {side: _load_side(tmp_path, side, run_worker(request, side)) for side in ("deepspeed", "torch")}
  (ds_steps, _, ds_final), (pt_steps, _, pt_final) = results["deepspeed"], results["torch"]
  assert "lm_head.weight" in ds_final and "wpe.weight" not in ds_final
  for a, b in zip(ds_steps, pt_steps, strict=True):
    assert abs(a["loss"] - b["loss"]) < LOSS_ATOL_FP32, (a, b)
  for k in ds_final:
    assert_close(k, ds_final[k], pt_final[k], PARAM_ATOL_FP32)


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.requires_deepspeed
def test_ported_scheduler_lr_matches_on_both_sides(tmp_path):
  """A non-default DeepSpeed scheduler (as `parity port` produces) reaches the engine and the baseline."""
  pytest.importorskip("deepspeed")
  params = {"total_num_steps": 6, "warmup_num_steps": 3, "warmup_min_lr": 1e-4, "warmup_max_lr": 2e-3,
            "warmup_type": "log"}
  run = apply_overrides(tiny_run(steps=6, eval_every=0), parse_overrides(["train.lr_schedule=WarmupDecayLR",
                                                          f"train.lr_schedule_params={json.dumps(params)}"]))
  request = make_run_dir(tmp_path, run)
  results = {side: _load_side(tmp_path, side, run_worker(request, side)) for side in ("deepspeed", "torch")}
  want = [schedule.train_lr(run.train, k) for k in range(run.train.steps)]
  assert want[0] == 1e-4 and len(set(want)) > 3
  for side, (steps, summary, _) in results.items():
    assert [r["lr"] for r in steps] == pytest.approx(want, rel=1e-12, abs=0), side
  assert results["deepspeed"][1]["optimizer"]["scheduler"] == "WarmupDecayLR"
  for a, b in zip(results["deepspeed"][0], results["torch"][0], strict=True):
    assert abs(a["loss"] - b["loss"]) < LOSS_ATOL_FP32, (a, b)


# The NaN stop and a crash's summary are the loop's (parity.protocol.loop.run_train), the same for every side:
# tests/test_loop.py runs them in-process (FakeSide). The poison itself: test_baseline_nan_poison_gives_nan_loss.


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.requires_deepspeed
def test_setup_distributed_fills_only_missing_env():
  pytest.importorskip("deepspeed")
  code = ("import os, json, torch.distributed as dist; from torch_impl.engine import setup_distributed; "
          "b = setup_distributed(); "
          "print(json.dumps({'backend': b, 'dist': dist.get_backend(), 'world': dist.get_world_size(), "
          "**{k: os.environ.get(k) for k in ('DS_ACCELERATOR', 'MASTER_ADDR', 'MASTER_PORT', 'RANK', "
          "'WORLD_SIZE', 'LOCAL_RANK')}}))")
  env = {k: v for k, v in os.environ.items()
         if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DS_ACCELERATOR")}
  env["PYTHONPATH"] = str(REPO)
  with socket.socket() as sock:  # a free port, chosen here, that setup_distributed must keep
    sock.bind(("127.0.0.1", 0))
    port = str(sock.getsockname()[1])
  proc = subprocess.run([sys.executable, "-c", code], env=dict(env, MASTER_PORT=port), cwd=REPO,
                        capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  want_backend = "nccl" if torch.cuda.is_available() else "gloo"
  assert got["backend"] == got["dist"] == want_backend and got["world"] == 1
  assert got["MASTER_PORT"] == port  # kept, not replaced
  assert (got["MASTER_ADDR"], got["RANK"], got["WORLD_SIZE"], got["LOCAL_RANK"]) == ("127.0.0.1", "0", "1", "0")
  if not torch.cuda.is_available():
    assert got["DS_ACCELERATOR"] == "cpu"
