"""`parity port --verify`: DeepSpeed (torch process) vs the ported optax optimizer (jax process), both started by
harness.launch (the one launcher: the workers' environment, a process group, a timeout).

parity never imports jax or torch: each side runs as `python -m <side>.port_verify REQUEST OUT.npz` and this
module compares the files. Criteria: learning rate (and OneCycle's beta1) equal to 1e-12 relative at every
step; parameters after every step equal up to fp32 rounding: |p_ds - p_jax| <= sum over steps of
(2 ulp(p) + r_t |update|), the rounding of the add and of the update's fp32 operations, r_t including the
conditioning of the bias corrections 1 - beta**t (see `_update_rel_rounding`).

fp16 runs as configured: DeepSpeed's engine with its loss scaler (FP16_Optimizer at ZeRO stage 0, DynamicLossScaler
at 1-3) against the port's precision.loss_scale (`jax_impl.loss_scaling.loss_scaled`), both fed the fp16 gradient
fp16(G * scale); the loss scale and the skipped steps must be equal at every step (exact: powers of two), the
params within the same bound. bf16 is not exercised: the bf16 section is dropped and the check runs in fp32 (said in
the notes and the summary).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from parity.migrate import reference
from parity.migrate._port import PortResult
from parity.migrate._reverse import optimizer_section
from parity.protocol.workers import worker_module
from harness.launch import LaunchTimeout, run_module
from parity.numerics.loss_scale import LossScaler

__all__ = ["verify", "VerifyOutcome", "VerifyTimeout", "LR_RTOL", "SHAPES", "verify_request", "DEFAULT_TIMEOUT_S",
           "loss_scale_not_exercised"]

LR_RTOL = 1e-12
"""Schedules are float64 on both sides; only libm differences (log, cos) remain."""
ULPS_PER_STEP = 2.0
"""fp32 params: each step rounds the update and the add once on each side."""
SHAPES = [[7, 5], [5], [3, 4, 2]]
BF16_NOT_EXERCISED = "bf16 compute (bf16 rounding of the gradient)"
DEFAULT_TIMEOUT_S = 900.0
"""Per side. Measured: 200 steps take ~10 s a side on 2 idle cores once DeepSpeed's ops are built; a first use
JIT-builds cpu_adam / shm_comm (~1 min each idle, several on a busy machine), hence the margin."""


class VerifyTimeout(RuntimeError):
  """A side of --verify was still running at its limit (killed with its process group). Attributes: side, timeout_s."""

  def __init__(self, side: str, timeout_s: float):
    super().__init__(f"the {side} side did not finish within {timeout_s:g} s and was stopped")
    self.side, self.timeout_s = side, timeout_s


@dataclasses.dataclass
class VerifyOutcome:
  ok: bool
  steps: int
  lr_max_rel: float
  beta1_max_rel: float
  params_max_ulp_ratio: float | None
  """max |p_ds - p_jax| / the fp32 bound (see module doc); <= 1 passes. None when DeepSpeed could not run the
  optimizer."""
  params_vs_reference_ratio: float
  """Same ratio for the JAX params against parity's float64 numpy transcription of DeepSpeed's update."""
  mode: str
  notes: list[str]
  first_failure: str | None = None

  not_exercised: list[str] = dataclasses.field(default_factory=list)
  """Parts of the config the check did not run (bf16; the fp16 loss-scale behaviours no step hit,
  `loss_scale_not_exercised`), named in the summary's first line."""
  scale_steps: int = 0
  """fp16: steps whose loss scale and skip were compared (0 without fp16)."""

  def summary(self) -> str:
    """The verdict line (naming what was not exercised), then one line per figure and the notes."""
    head = "verify: OK" if self.ok else f"verify: MISMATCH ({self.first_failure})"
    if self.ok and self.not_exercised:
      head += f" for what ran; NOT exercised: {', '.join(self.not_exercised)}"
    lines = [f"{head} over {self.steps} steps; DeepSpeed side: {self.mode}",
             f"  lr max rel diff {self.lr_max_rel:.3g} (tol {LR_RTOL:g}); beta1 {self.beta1_max_rel:.3g}",
             "  params vs DeepSpeed: " + ("n/a" if self.params_max_ulp_ratio is None else
                                           f"{self.params_max_ulp_ratio:.3g} of the fp32 bound (<= 1 passes)"),
             f"  params vs numpy reference: {self.params_vs_reference_ratio:.3g} of the fp32 bound"]
    if self.scale_steps:
      lines.append(f"  fp16 loss scale and skipped steps: equal at all {self.scale_steps} steps")
    return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def verify_request(result: PortResult, steps: int, seed: int = 0) -> tuple[dict, dict, list[str]]:
  """(DeepSpeed request, JAX request, notes) for one verification."""
  ported = result.ported.to_dict()
  ds = copy.deepcopy(result.ds_config)
  notes = []
  for key in ("bf16", "bfloat16"):
    if isinstance(ds.get(key), dict) and ds[key].get("enabled"):
      notes.append(f"{key} disabled for verification: runs in fp32 ({BF16_NOT_EXERCISED} is not exercised)")
    ds.pop(key, None)
  if ported["precision"]["compute_dtype"] == "fp16":
    notes.append("fp16 runs as configured: DeepSpeed's loss scaler and overflow skips against the port's "
                 "precision.loss_scale, both fed fp16(G * scale)")
  else:
    ds.pop("fp16", None)
  ds.update(train_batch_size=1, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
  ds.pop("data_types", None)
  ds_rev = {"optimizer": optimizer_section(result.ported)}  # written even for a client optimizer (the verify model)
  name = str(ds.get("optimizer", {}).get("type", "")).lower()
  if ("optimizer" not in ds or "type" not in ds["optimizer"]) and "DeepSpeedCPUAdam" in ported["optimizer"]["impl"]:
    ds["optimizer"] = ds_rev["optimizer"]  # an AdamW section under offload: DeepSpeed builds the same class
    notes.append("no optimizer in the config: the training stack hands DeepSpeed a DeepSpeedCPUAdam from the flags "
                 f"({ported['optimizer']['impl']}), verified as an AdamW section under the config's offload")
  elif "optimizer" not in ds or "type" not in ds["optimizer"]:
    ds["optimizer"] = ds_rev["optimizer"]
    ds["optimizer"]["params"]["torch_adam"] = True
    ds["optimizer"]["params"].pop("bias_correction", None)
    notes.append("no optimizer in the config: DeepSpeed runs the client torch.optim.AdamW from the flags")
  elif name in ("onebitadam", "zerooneadam", "onebitlamb"):
    notes.append(f"DeepSpeed 0.19.8 no longer ships {ds['optimizer']['type']}; verified the uncompressed "
                 f"{ds_rev['optimizer']['type']} it is ported to")
    ds["optimizer"] = ds_rev["optimizer"]
  ds.setdefault("steps_per_print", 10 ** 9)
  opt = ported["optimizer"]["params"]
  common = {"steps": steps, "seed": seed, "shapes": SHAPES}
  return ({**common, "ds_config": ds, "base_lr": opt["lr"], "betas": opt.get("betas", [0.9, 0.999])},
          {**common, "ported": ported}, notes)


def _run(module: str, req: dict, tmp: Path, name: str, timeout: float) -> dict[str, Any]:
  req_path, out_path = tmp / f"{name}.json", tmp / f"{name}.npz"
  req_path.write_text(json.dumps(req))
  try:
    proc = run_module(module, [str(req_path), str(out_path)], timeout_s=timeout)
  except LaunchTimeout:
    raise VerifyTimeout(name, timeout) from None
  if proc.returncode != 0 or not out_path.exists():
    raise RuntimeError(f"{module} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
  with np.load(out_path) as d:
    return {k: d[k] for k in d.files}


def _rel(a: np.ndarray, b: np.ndarray) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  mask = ~(np.isnan(a) & np.isnan(b))
  if np.any(np.isnan(a[mask]) | np.isnan(b[mask])):
    return float("inf")
  a, b = a[mask], b[mask]
  if a.size == 0:
    return 0.0
  return float(np.max(np.abs(a - b) / np.maximum(np.maximum(np.abs(a), np.abs(b)), 1e-300)))


def _update_rel_rounding(opt: dict, steps: int) -> np.ndarray:
  """Relative fp32 rounding of one update, per step: ~8 operations, plus the conditioning of the bias
  corrections 1 - beta**t (an ulp of beta**t, e.g. a running product vs pow, is amplified by
  beta**t / (1 - beta**t): 1e-5 relative at t=1 for beta2=0.999)."""
  eps32 = 2.0 ** -24
  rel = np.full(steps, 8 * eps32)
  p = opt["params"]
  if p.get("bias_correction") and "betas" in p:
    t = np.arange(1, steps + 1, dtype=np.float64)
    for b in p["betas"]:
      if 0 < b < 1:
        rel += 4 * 4 * eps32 * b ** t / (1 - b ** t)
  return rel


def _ulp_ratio(p0: np.ndarray, ref: np.ndarray, got: np.ndarray, rel: np.ndarray) -> float:
  """max |ref - got| / bound, bound_t = sum_{s<=t} (2 ulp(p_s) + rel_s |dp_s|): the fp32 rounding of t steps,
  each rounding the add (2 ulp of the param) and the update (relative to its size, see _update_rel_rounding)."""
  ref64, got64 = ref.astype(np.float64), got.astype(np.float64)
  prev = np.vstack([p0.astype(np.float64)[None, :], ref64[:-1]])
  ulp = np.spacing(np.maximum(np.abs(ref64), np.abs(got64)).astype(np.float32)).astype(np.float64)
  bound = np.cumsum(ULPS_PER_STEP * ulp + rel[:, None] * np.abs(ref64 - prev), axis=0)
  return float(np.max(np.abs(ref64 - got64) / bound))


def _reference_scaler(ported: dict):
  """parity.numerics.loss_scale.LossScaler of a ported fp16 config (None otherwise)."""
  ls = ported["precision"]["loss_scale"]
  if ported["precision"]["compute_dtype"] != "fp16" or ls is None:
    return None
  if not ls["dynamic"]:
    return LossScaler(scale=float(ls["static_scale"]), dynamic=False)
  return LossScaler(scale=float(2 ** ls["initial_scale_power"]), window=ls["window"], hysteresis=ls["hysteresis"],
                    consecutive_hysteresis=ls["consecutive_hysteresis"], min_scale=float(ls["min_scale"]),
                    raise_at_min=False)


def _fp16_grad(g: list[np.ndarray], scaler) -> tuple[list[np.ndarray] | None, float]:
  """(the unscaled gradient DeepSpeed's optimizer gets, or None on an overflow; the scale the step ran with):
  fp16(g * scale), the scaler updated, then divided by the updated scale (DeepSpeed's order)."""
  scale = scaler.scale
  with np.errstate(over="ignore"):  # past 65504 fp16 is inf: the overflow looked for
    scaled = [(x.astype(np.float32) * np.float32(scale)).astype(np.float16).astype(np.float32) for x in g]
  overflow = not all(np.isfinite(x).all() for x in scaled)
  scaler.update(overflow)
  return (None if overflow else [(x / np.float32(scaler.scale)).astype(np.float32) for x in scaled]), scale


def _scale_trace(ls: dict, max_abs: np.ndarray) -> list[tuple[float, bool]]:
  """(scale, overflowed) of each step for loss-scale settings `ls` (a ported precision.loss_scale dict) on gradients
  whose largest |g| at each step is `max_abs` (steps,): a step overflows exactly when fp16(max|g| * scale) is inf
  (the fp16 rounding is monotone, so the largest element decides), as in `_fp16_grad`."""
  scaler = _reference_scaler({"precision": {"compute_dtype": "fp16", "loss_scale": ls}})
  out = []
  for m in max_abs:
    scale = scaler.scale
    with np.errstate(over="ignore"):
      overflow = not np.isfinite(np.float16(np.float32(m) * np.float32(scale)))
    scaler.update(overflow)
    out.append((scale, overflow))
  return out


def loss_scale_not_exercised(ported: dict, steps: int, seed: int, observed: tuple | None = None) -> list[str]:
  """The fp16 loss-scale behaviours a `--verify` run of `steps` steps never exercised: each setting is replayed on
  the run's own gradient draws with a neighbouring value (hysteresis +-1, consecutive_hysteresis flipped, the window
  +-1, min_loss_scale halved); where the scale and skip of every step stay the same, a wrong value of that setting
  could not have failed the check, so it is named. Also named: no overflow at all (the skip never ran), no doubling.
  `observed` (the run's (scale, skipped) arrays, (steps,)): when the replay does not reproduce them, every setting is
  named as not shown exercised (nothing is claimed from a replay that is not the run).

  Returns:
    [] for a config that is not fp16; else phrases for VerifyOutcome.not_exercised.
  """
  ls = ported["precision"]["loss_scale"]
  if ported["precision"]["compute_dtype"] != "fp16" or ls is None:
    return []
  rng = np.random.default_rng(seed)  # the draws of _reference_params and both sides: params first, then gradients
  for s in SHAPES:
    rng.standard_normal(s)
  grads = rng.standard_normal((steps, sum(int(np.prod(s)) for s in SHAPES))).astype(np.float32)
  max_abs = np.abs(grads).max(axis=1)
  base = _scale_trace(ls, max_abs)
  if observed is not None and base != [(float(a), bool(b)) for a, b in zip(*observed)]:
    return ["the fp16 loss-scale settings (the replay of this run's gradients does not reproduce its scale trace, "
            "so which of them ran is not known)"]
  n_over = sum(o for _, o in base)
  out = [] if n_over else [f"the overflow skip (no step of {steps} overflowed)"]
  if not ls["dynamic"]:
    return out
  variants = {"hysteresis": [{"hysteresis": ls["hysteresis"] + 1}] + (
                  [{"hysteresis": ls["hysteresis"] - 1}] if ls["hysteresis"] > 1 else []),
              "consecutive_hysteresis": [{"consecutive_hysteresis": not ls["consecutive_hysteresis"]}],
              "loss_scale_window": [{"window": ls["window"] + 1}] + ([{"window": ls["window"] - 1}]
                                                                     if ls["window"] > 1 else []),
              "min_loss_scale": [{"min_scale": ls["min_scale"] / 2}]}
  for name, changes in variants.items():
    if all(_scale_trace({**ls, **c}, max_abs) == base for c in changes):
      out.append(f"fp16.{name} {ls[_LS_KEY[name]]!r} (another value gives the same scale and skip at every step)")
  if not any(b[0] > a[0] for a, b in zip(base, base[1:])):
    out.append(f"the scale doubling (no {ls['window']} overflow-free steps in a row)")
  return out


_LS_KEY = {"hysteresis": "hysteresis", "consecutive_hysteresis": "consecutive_hysteresis",
           "loss_scale_window": "window", "min_loss_scale": "min_scale"}


def _reference_params(ported: dict, steps: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(initial params, params after each step, loss scale of each step) of parity's numpy transcription."""
  rng = np.random.default_rng(seed)
  params = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
  grads = rng.standard_normal((steps, sum(int(np.prod(s)) for s in SHAPES))).astype(np.float32)
  scaler = _reference_scaler(ported)
  if scaler is not None:
    params = [p.astype(np.float16).astype(np.float32) for p in params]
  sch, opt = ported["scheduler"], ported["optimizer"]
  mom = sch["type"] == "OneCycle" and sch["params"]["cycle_momentum"] and opt["type"] != "sgd"
  if mom:
    opt = {**opt, "params": {**opt["params"], "betas": [opt["params"]["betas"][0], 0.99]}}
  if "betas" in opt["params"]:  # the kernels hold betas in fp32: 1 - beta**t inherits that rounding
    opt = {**opt, "params": {**opt["params"], "betas": [float(np.float32(b)) for b in opt["params"]["betas"]]}}
  state: dict = {}
  ps = [p.astype(np.float64) for p in params]
  out, scales, applied = [], np.ones(steps), 0
  sizes = np.cumsum([p.size for p in params])[:-1]
  for t in range(steps):
    g = [a.reshape(p.shape) for a, p in zip(np.split(grads[t], sizes), params)]
    if scaler is not None:
      g, scales[t] = _fp16_grad(g, scaler)
    if g is not None:
      lr = reference.lr_at(sch["type"], sch["params"], opt["params"]["lr"], applied)
      b1 = reference.momentum_at(sch["params"], applied) if mom else None
      ps = reference.numpy_update(opt, ps, g, state, lr=lr, beta1=b1, max_norm=ported["clipping"]["max_global_norm"])
      applied += 1
    out.append(np.concatenate([p.reshape(-1) for p in ps]))
  return np.concatenate([p.reshape(-1) for p in params]), np.stack(out), scales


def verify(result: PortResult, *, steps: int = 200, seed: int = 0, timeout: float = DEFAULT_TIMEOUT_S) -> VerifyOutcome:
  """Runs both sides (each through harness.launch, `timeout` seconds each) and compares.

  Raises:
    VerifyTimeout: a side ran past `timeout` (it was killed).
    RuntimeError: a side crashed outright.
  """
  ds_req, jax_req, notes = verify_request(result, steps, seed)
  with tempfile.TemporaryDirectory(prefix="parity-port-verify-") as tmp:
    ds = _run(worker_module("deepspeed", "port_verify"), ds_req, Path(tmp), "deepspeed", timeout)
    jx = _run(worker_module("jax", "port_verify"), jax_req, Path(tmp), "jax", timeout)
  mode = str(ds["mode"])
  notes.append(str(ds["note"]))
  lr_rel = _rel(ds["lr"], jx["lr"])
  has_b1 = ~np.isnan(ds["beta1"])
  b1_rel = _rel(ds["beta1"][has_b1], jx["beta1"][has_b1]) if has_b1.any() else 0.0
  p0, ref, ref_scale = _reference_params(jax_req["ported"], steps, seed)
  rel = _update_rel_rounding(jax_req["ported"]["optimizer"], steps)
  ref_ratio = _ulp_ratio(p0, ref, jx["params"], rel)
  ds_ratio = _ulp_ratio(p0, ds["params"], jx["params"], rel) if mode == "engine" else None
  fp16 = jax_req["ported"]["precision"]["compute_dtype"] == "fp16"
  fails = _scale_failures(ds, jx, ref_scale, engine=mode == "engine") if fp16 else []
  if lr_rel > LR_RTOL:
    k = int(np.argmax(np.abs(ds["lr"] - jx["lr"])))
    fails.append(f"lr at step {k}: DeepSpeed {ds['lr'][k]!r} vs JAX {jx['lr'][k]!r}")
  if b1_rel > LR_RTOL:
    fails.append(f"beta1 rel diff {b1_rel:.3g}")
  if ds_ratio is not None and ds_ratio > 1:
    fails.append(f"params differ from DeepSpeed by {ds_ratio:.3g}x the fp32 bound")
  if ref_ratio > 1:
    fails.append(f"params differ from the numpy reference by {ref_ratio:.3g}x the fp32 bound")
  bf16 = [BF16_NOT_EXERCISED] if jax_req["ported"]["precision"]["compute_dtype"] == "bf16" else []
  return VerifyOutcome(not fails, steps, lr_rel, b1_rel, ds_ratio, ref_ratio, mode, notes,
                       fails[0] if fails else None,
                       not_exercised=bf16 + loss_scale_not_exercised(
                           jax_req["ported"], steps, seed, (jx["scale"], jx["skipped"])),
                       scale_steps=steps if fp16 and mode == "engine" and not fails else 0)


def _scale_failures(ds: dict, jx: dict, ref_scale: np.ndarray, *, engine: bool) -> list[str]:
  """fp16: the first step where the loss scale or the skip differs, JAX against DeepSpeed (engine mode) and against
  parity's reference scaler (parity.numerics.loss_scale)."""
  fails = []
  pairs = ([("DeepSpeed", ds["scale"], ds["skipped"])] if engine else []) + [("the reference", ref_scale, None)]
  for who, scale, skipped in pairs:
    bad = np.flatnonzero(np.asarray(scale, np.float64) != np.asarray(jx["scale"], np.float64))
    if skipped is not None:
      bad = np.union1d(bad, np.flatnonzero(np.asarray(skipped, bool) != np.asarray(jx["skipped"], bool)))
    if bad.size:
      k = int(bad[0])
      fails.append(f"fp16 loss scale at step {k}: {who} {scale[k]:g}"
                   + (f" (skipped {bool(skipped[k])})" if skipped is not None else "")
                   + f" vs JAX {jx['scale'][k]:g} (skipped {bool(jx['skipped'][k])})")
  return fails
