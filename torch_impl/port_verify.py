"""DeepSpeed side of `parity port --verify`: runs DeepSpeed's own scheduler and optimizer, writes the values.

    python -m torch_impl.port_verify REQUEST.json OUT.npz
    python -m torch_impl.port_verify --accepts CONFIGS.json OUT.json   (the DeepSpeed acceptance oracle, `accepts`)

REQUEST (written by parity.migrate.verify): {"ds_config": {...}, "steps": N, "seed": S, "shapes": [[..], ..],
"base_lr": float}. The model is a list of parameters p_i with loss sum_i <p_i, G_i[step]>, so the gradient
DeepSpeed sees at each step is exactly G[step] (numpy, seeded; the JAX side draws the same). Runs
`deepspeed.initialize` (one gloo rank on CPU) so the engine picks the optimizer class, clipping, ZeRO
wrapper and scheduler stepping itself. If DeepSpeed cannot build the optimizer on this machine (FusedLamb is
CUDA-only), it records the reason and falls back to DeepSpeed's scheduler class alone.

With fp16 enabled in the config the engine runs it as configured (fp16 module, DeepSpeed's loss scaler and
overflow skips; CPU fp16 allowed as `parity compare` allows it, torch_impl.engine.allow_fp16_on_cpu): the
gradient of the fp16 params is then fp16(G[step] * scale), so large scales overflow and exercise the scaler.

Writes OUT.npz: lr (N,), beta1 (N,), params (N, P) fp32 master params after each step (engine mode only),
scale (N,) the loss scale each step ran with and skipped (N,) bool, the step overflowed and was skipped (fp16; 1 and
False otherwise), mode ('engine'|'schedule'), note (str).
"""
from __future__ import annotations

import json
import sys
import traceback

import numpy as np
import torch

from torch_impl.engine import setup_distributed  # the workers' environment: DS_ACCELERATOR, ninja, ops dir
from torch_impl.engine import allow_fp16_on_cpu, initialize
from torch_impl.baseline import build_optimizer
from parity.spec import TrainSpec


def draws(shapes: list[list[int]], steps: int, seed: int) -> tuple[list[np.ndarray], np.ndarray]:
  """Initial params (list of fp32 arrays) and gradients (steps, total) fp32 — identical on both sides."""
  rng = np.random.default_rng(seed)
  params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
  total = sum(int(np.prod(s)) for s in shapes)
  grads = rng.standard_normal((steps, total)).astype(np.float32)
  return params, grads


class _Probe(torch.nn.Module):
  def __init__(self, params: list[np.ndarray]):
    super().__init__()
    self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.from_numpy(p.copy())) for p in params])

  def forward(self, g_flat: torch.Tensor) -> torch.Tensor:
    out, off = 0.0, 0
    for p in self.ps:
      n = p.numel()
      out = out + (p.float().reshape(-1) * g_flat[off:off + n]).sum()
      off += n
    return out


def _master_params(engine, model: _Probe) -> np.ndarray:
  """The fp32 master params, flat in the probe's order: ZeRO's partitions gathered, FP16_Optimizer's flat fp32 group
  (stage 0 fp16; one param group), or the params themselves (stage 0 fp32)."""
  from deepspeed.utils import safe_get_full_fp32_param  # deepspeed: after setup_distributed set DS_ACCELERATOR
  opt = engine.optimizer
  if engine.zero_optimization():
    ps = [safe_get_full_fp32_param(p) for p in model.ps]
  elif hasattr(opt, "fp32_groups_flat"):
    ps = list(opt.fp32_groups_flat)
  elif hasattr(opt, "fp32_groups"):
    ps = [p for group in opt.fp32_groups for p in group]
  else:
    ps = list(model.ps)
  return np.concatenate([p.detach().float().reshape(-1).numpy() for p in ps])


def run_engine(req: dict) -> dict:
  """DeepSpeed itself on REQUEST's config: deepspeed.initialize over a model of the request's seeded params, one
  step per seeded gradient. Returns {'lr', 'beta1', 'params' (steps x n), 'scale', 'skipped', 'mode': 'engine',
  'note'}."""
  setup_distributed()
  import deepspeed  # deepspeed: after setup_distributed set DS_ACCELERATOR
  steps, cfg = req["steps"], req["ds_config"]
  fp16 = allow_fp16_on_cpu(cfg) or bool((cfg.get("fp16") or {}).get("enabled"))
  params, grads = draws(req["shapes"], steps, req["seed"])
  model = _Probe(params)
  engine, _, _, sched = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
  lrs, b1s, out = np.zeros(steps), np.full(steps, np.nan), []
  scales, skipped = np.ones(steps), np.zeros(steps, bool)
  for t in range(steps):
    group = engine.optimizer.param_groups[0] if hasattr(engine.optimizer, "param_groups") else None
    lrs[t] = float(engine.get_lr()[0])
    if group is not None and "betas" in group:
      b1s[t] = float(group["betas"][0])
    scales[t] = float(engine.optimizer.loss_scale) if fp16 else 1.0
    before = engine.skipped_steps
    loss = engine(torch.from_numpy(grads[t]))
    engine.backward(loss)
    engine.step()
    skipped[t] = engine.skipped_steps > before
    out.append(_master_params(engine, model))
  return {"lr": lrs, "beta1": b1s, "params": np.stack(out), "scale": scales, "skipped": skipped, "mode": "engine",
          "note": f"deepspeed.initialize: {type(engine.optimizer).__name__} over "
                  f"{type(engine.basic_optimizer).__name__}, zero stage {engine.zero_optimization_stage()}"
                  + (f", fp16 with {int(skipped.sum())} of {steps} steps skipped on overflow" if fp16 else "")}


def run_schedule(req: dict, why: str) -> dict:
  """DeepSpeed's lr schedule alone (deepspeed.runtime.lr_schedules over a dummy AdamW), when the engine cannot be
  built here (`why`). Returns the same keys as run_engine, params empty, mode 'schedule'."""
  from deepspeed.runtime import lr_schedules  # deepspeed: after setup_distributed set DS_ACCELERATOR
  cfg = req["ds_config"]
  steps = req["steps"]
  dummy = torch.nn.Parameter(torch.zeros(1))
  opt = torch.optim.AdamW([dummy], lr=req["base_lr"], betas=tuple(req.get("betas", (0.9, 0.999))))
  sched = None
  if "scheduler" in cfg:
    sched = getattr(lr_schedules, cfg["scheduler"]["type"])(opt, **cfg["scheduler"]["params"])
  lrs, b1s = np.zeros(steps), np.zeros(steps)
  for t in range(steps):
    lrs[t] = float(opt.param_groups[0]["lr"])
    b1s[t] = float(opt.param_groups[0]["betas"][0])
    if sched is not None:
      sched.step()
  return {"lr": lrs, "beta1": b1s, "params": np.zeros((0,)), "scale": np.ones(steps), "skipped": np.zeros(steps, bool),
          "mode": "schedule",
          "note": f"DeepSpeed's {cfg.get('scheduler', {}).get('type', 'no')} scheduler class alone; {why}"}


def accepts(configs: dict[str, dict], train: dict, clients: dict[str, str | None] | None = None) -> dict[str, dict]:
  """Asks the installed DeepSpeed whether it accepts each config, as `parity compare` would run it.

  Per config: `deepspeed.initialize` on a tiny model (two Linear layers, decay/no-decay groups) through
  torch_impl.engine.initialize (the stack's client optimizer when the config has no optimizer section), fp16 allowed
  on a CPU as compare allows it. Args: configs {name: resolved DeepSpeed config}; train {lr, beta1, beta2, eps,
  weight_decay}: TrainSpec fields over its defaults (the client optimizer is the run's, parity.spec.TrainSpec);
  clients {name: the class the config's training stack hands DeepSpeed (parity.migrate._stack: 'torch.optim.AdamW'
  for the script of a bare deepspeed.initialize, 'DeepSpeedCPUAdam' where Accelerate or Megatron passes one), or
  None}: a torch AdamW is passed as it is, whatever the offload (engine.client_optimizer would pass what an accepting
  stack passes). Returns {name: {"accepted": bool, "error": "Type: first line" or None}}.
  """
  import dataclasses
  setup_distributed()
  t = dataclasses.replace(TrainSpec(), **train)
  out = {}
  for name, cfg in configs.items():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    groups = [{"params": [m.weight for m in model], "weight_decay": t.weight_decay},
              {"params": [m.bias for m in model], "weight_decay": 0.0}]
    try:
      allow_fp16_on_cpu(cfg)
      cfg = dict(cfg, steps_per_print=10 ** 9)
      if (clients or {}).get(name) in ("torch.optim.AdamW", "FusedAdam"):  # FusedAdam: CUDA; torch AdamW stands in
        import deepspeed  # deepspeed: after setup_distributed set DS_ACCELERATOR
        engine = deepspeed.initialize(model=model, model_parameters=groups, config=cfg,
                                      optimizer=build_optimizer(groups, t, lr=t.lr))[0]
      else:
        engine = initialize(model, groups, cfg, t)
      out[name] = {"accepted": True, "error": None, "optimizer": type(engine.optimizer).__name__}
      engine.destroy()
    except Exception as e:  # the answer: DeepSpeed refused this config
      msg = str(e).strip().splitlines()
      out[name] = {"accepted": False, "error": f"{type(e).__name__}: {msg[0] if msg else ''}"}
  return out


def main(argv: list[str]) -> int:
  """`python -m torch_impl.port_verify REQUEST OUT` (or `--accepts CONFIGS OUT`): the DeepSpeed reference for
  parity.migrate.verify, written to OUT (.npz; JSON for --accepts). Returns 0."""
  if argv and argv[0] == "--accepts":
    req = json.loads(open(argv[1]).read())
    with open(argv[2], "w") as f:
      json.dump(accepts(req["configs"], req["train"], req.get("clients")), f)
    return 0
  req_path, out_path = argv
  with open(req_path) as f:
    req = json.load(f)
  try:
    res = run_schedule(req, "schedule-only request") if req.get("schedule_only") else run_engine(req)
  except Exception as e:  # DeepSpeed could not build this optimizer here: record why, verify the schedule only
    why = f"deepspeed.initialize failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    traceback.print_exc(file=sys.stderr)
    res = run_schedule(req, why)
  np.savez(out_path, lr=res["lr"], beta1=res["beta1"], params=res["params"], scale=res["scale"],
           skipped=res["skipped"], mode=res["mode"], note=res["note"])
  return 0


if __name__ == "__main__":
  raise SystemExit(main(sys.argv[1:]))
