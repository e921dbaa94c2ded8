"""The plain-PyTorch side: DeepSpeed's optimizer (`build_optimizer`), schedule, accumulation and clipping.

It reproduces what the DeepSpeed engine does, with no DeepSpeed import:
  * the same param groups (`parity.weights.decays`), AdamW hyper-parameters passed explicitly;
  * the learning rate of step k is `parity.numerics.schedule.train_lr(train, k)` (WarmupCosineLR as
    the engine applies it: step 0 runs with lr 0);
  * gradient accumulation by backpropagating loss / grad_accum_steps per micro batch;
  * clipping by DeepSpeed ZeRO-1/2's formula, not torch's `clip_grad_norm_` (see `clip_like_deepspeed`).
With precision 'bf16' it runs DeepSpeed's bf16 layout: forward and backward on a bfloat16 copy of the
whole module (`self.half_model`), gradients copied to the float32 masters, AdamW on the masters, which
start rounded to bfloat16 as DeepSpeed's do (`parity.weights.master_weights`). Measured against
DeepSpeed bf16 on gpt2-small-cpu (200 steps), `torch.autocast` instead (fp32 LayerNorm, embeddings
and residual stream) drifted from DeepSpeed 2.8x its reduction-order noise (median per window), and
missed the loss spike DeepSpeed takes at step 24.

With precision 'fp16' it does what DeepSpeed's fp16 engine does, not torch's GradScaler:
  * the float32 master weights start as the initial weights rounded to float16: DeepSpeed casts the
    module to half first and copies the ZeRO optimizer's fp32 master partition from it
    (`DeepSpeedZeroOptimizer.__init__`: `single_partition_of_fp32_groups` from the bit16 groups;
    `parity.weights.master_weights`);
  * `self.model` keeps the float32 master weights (AdamW updates them); forward and backward run
    on `self.half_model`, a float16 copy of the whole module (LayerNorm and embeddings included),
    refreshed from the masters after every applied update. This is DeepSpeed's layout
    (`fp16.enabled` casts the module to half; the ZeRO optimizer owns an fp32 master partition and
    copies it back into the half params after each step), chosen over `torch.autocast(float16)`
    because autocast keeps the residual stream, embeddings and LayerNorm weights in float32 and
    computes float32 parameter gradients, so it would overflow at other scales than DeepSpeed
    (and JAX, whose fp16 residual stream is float16 too);
  * the loss is multiplied by the scale of `self.loss_scaler` (`parity.numerics.loss_scale.LossScaler`,
    DeepSpeed's DynamicLossScaler) before backward; the float16 gradients are accumulated over the
    micro batches, then copied to float32;
  * any non-finite gradient skips the step: no AdamW step, `step_index` (the LR schedule position)
    not advanced, grad_norm reported as inf (DeepSpeed's `_global_grad_norm` on overflow);
  * otherwise the gradients are divided by the scale *after* its update, as DeepSpeed's
    `unscale_and_clip_grads` does (see `jax_impl.optim.loss_scaled`), then clipped and applied.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any

import numpy as np
import torch

from parity import weights

from parity.numerics import schedule
from parity.numerics.loss_scale import LossScaler
from parity.spec import RunSpec
from torch_impl import memory
from torch_impl.model import build_model, micro_loss, to_canonical
from torch_impl.semantics import decay_groups_of
from torch_impl.distributed import init_process_group

__all__ = ["clip_like_deepspeed", "global_grad_norm", "TorchTrainer", "build_optimizer", "Lamb", "set_hparams",
           "adam_grad_rms"]

CLIP_EPS = 1e-6
"""Added to the gradient norm before dividing by the clip threshold (DeepSpeed ZeRO-1/2)."""


def global_grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
  """Global L2 norm of the gradients, accumulated in float64 as DeepSpeed ZeRO does.

  Args:
    params: tensors whose `.grad` is set (None grads are skipped).
  Returns:
    A float32 scalar tensor: sqrt(sum_i ||g_i||^2), per-tensor norms in float64.
  References:
    deepspeed/runtime/zero/stage_1_and_2.py `complete_grad_norm_calculation_for_cpu_offload`.
  """
  sq = sum(float(p.grad.double().norm(2)) ** 2 for p in params if p.grad is not None)
  return torch.tensor(sq ** 0.5, dtype=torch.float32)


def clip_like_deepspeed(params: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> float:
  """Scales gradients in place by DeepSpeed's clipping rule.

  g <- g * (1 / max(1, (||g|| + 1e-6) / max_norm)), computed in float32 tensors in
  DeepSpeed's order. torch's `clip_grad_norm_` instead multiplies by
  min(1, max_norm / (||g|| + 1e-6)); the two differ in rounding only, but this side
  reproduces DeepSpeed.

  Args:
    params: tensors whose `.grad` is scaled.
    max_norm: clip threshold (train.grad_clip); 0 disables clipping.
    total_norm: float32 scalar, the pre-clip global norm.
  Returns:
    The divisor applied (1.0 when no clipping happened).
  References:
    deepspeed/runtime/zero/stage_1_and_2.py `unscale_and_clip_grads` (loss scale 1).
  """
  if max_norm <= 0:
    return 1.0
  divisor = torch.clamp(((total_norm / 1.0) + CLIP_EPS) / max_norm, min=1.0)
  inv = 1.0 / divisor
  for p in params:
    if p.grad is not None:
      p.grad.mul_(inv.to(p.grad.device))
  return float(divisor)


class Lamb(torch.optim.Optimizer):
  """DeepSpeed's FusedLamb update in plain torch (FusedLamb itself is CUDA-only), per param group.

      m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;  u = m / (sqrt(v) + eps) + wd p   (eps_inside_sqrt:
      sqrt(v + eps));  p <- p - lr * sqrt(1 - b2^t) / (1 - b1^t) * clamp(||p|| / ||u||, min_coeff, max_coeff) * u
  The trust ratio is 1 when ||p|| or ||u|| is 0. Same formula as parity.migrate.reference.numpy_update and
  jax_impl.optim.optimizer_update. State per param: step (int), exp_avg, exp_avg_sq (float32, param's shape).
  References: deepspeed/ops/lamb/fused_lamb.py, csrc/lamb/fused_lamb_cuda_kernel.cu.
  """

  def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
               max_coeff: float = 10.0, min_coeff: float = 0.01, eps_inside_sqrt: bool = False):
    super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, max_coeff=max_coeff,
                                  min_coeff=min_coeff, eps_inside_sqrt=eps_inside_sqrt))

  @torch.no_grad()
  def step(self, closure=None):
    """One Lamb update of every param with a gradient (the class docstring's formula); `closure` is not supported
    and ignored (the trainers never pass one). Returns None."""
    for group in self.param_groups:
      b1, b2 = group["betas"]
      for p in group["params"]:
        if p.grad is None:
          continue
        st = self.state[p]
        if not st:
          st.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        st["step"] += 1
        t = st["step"]
        m, v = st["exp_avg"], st["exp_avg_sq"]
        m.mul_(b1).add_(p.grad, alpha=1 - b1)
        v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
        denom = (v + group["eps"]).sqrt() if group["eps_inside_sqrt"] else v.sqrt() + group["eps"]
        u = m / denom + group["weight_decay"] * p
        wn, un = float(p.norm()), float(u.norm())
        coeff = min(max(wn / un, group["min_coeff"]), group["max_coeff"]) if wn != 0 and un != 0 else 1.0
        step_size = group["lr"] * (1 - b2 ** t) ** 0.5 / (1 - b1 ** t)
        p.add_(u, alpha=-step_size * coeff)
    return None


def build_optimizer(groups: list[dict[str, Any]], train, lr: float = 0.0) -> torch.optim.Optimizer:
  """The one torch builder of the optimizer a TrainSpec describes (`parity.numerics.schedule.optimizer_of`).

  adamw -> torch.optim.AdamW, adam -> torch.optim.Adam (L2: weight_decay joins the gradient, DeepSpeed's
  adam_w_mode false), lamb -> `Lamb`, sgd -> torch.optim.SGD; foreach off. Each param group keeps its own
  weight_decay (`decay_groups`); the other hyper-parameters come from `train`.
  Args:
    groups: torch param groups with their weight_decay; train: the TrainSpec; lr: the initial learning rate
      (the baseline sets each step's own, `TorchTrainer.step`).
  Raises:
    ValueError: unknown train.optimizer.
  """
  o = schedule.optimizer_of(train)
  p = o["params"]
  if o["type"] == "sgd":
    return torch.optim.SGD(groups, lr=lr, momentum=p["momentum"], dampening=p["dampening"], nesterov=p["nesterov"],
                           weight_decay=p["weight_decay"], foreach=False)
  betas = tuple(schedule.train_betas(train, 0))
  if o["type"] == "lamb":
    return Lamb(groups, lr=lr, betas=betas, eps=p["eps"], weight_decay=p["weight_decay"], max_coeff=p["max_coeff"],
                min_coeff=p["min_coeff"], eps_inside_sqrt=p["eps_inside_sqrt"])
  cls = torch.optim.AdamW if o["type"] == "adamw" else torch.optim.Adam
  return cls(groups, lr=lr, betas=betas, eps=p["eps"], weight_decay=p["weight_decay"], foreach=False)


def set_hparams(optimizer: torch.optim.Optimizer, train, step_index: int) -> float:
  """Writes the lr of update `step_index` (0-based count of applied updates) into every param group, and OneCycle's
  cycled betas where the schedule cycles momentum, as DeepSpeed's scheduler does; returns the lr.

  The lr is `parity.numerics.schedule.train_lr(train, step_index)` (DeepSpeed's formula for train.lr_schedule)."""
  lr = schedule.train_lr(train, step_index)
  cycled = schedule.cycles_momentum(train)
  for g in optimizer.param_groups:
    g["lr"] = lr
    if cycled:
      g["betas"] = schedule.train_betas(train, step_index)
  return lr


def adam_grad_rms(run: RunSpec, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  whole=lambda t: t) -> dict[str, np.ndarray]:
  """Adam's bias-corrected per-element gradient RMS sqrt(exp_avg_sq / (1 - beta2^step)) of every canonical param of
  `model` under a torch.optim Adam/AdamW `optimizer`: canonical name -> float32 array of the param's shape; zeros for
  a param no update has touched yet. `whole` turns a state tensor into the whole tensor (FSDP2: the all-gather of a
  DTensor shard, torch_impl.fsdp.full_tensor; a collective).
  Raises:
    KeyError: run.train.optimizer is not an Adam (Lamb, SGD: the params rule's per-element Adam bound does not hold
      for them; parity.verdict.params.param_checks falls back per tensor).
  """
  if run.train.optimizer not in ("adam", "adamw"):
    raise KeyError(f"train.optimizer {run.train.optimizer!r} keeps no Adam second moment the params rule can use")
  beta2 = float(schedule.adam_beta2(run.train))
  own = dict(model.named_parameters())
  out = {}
  for name in weights.param_shapes(run.model):
    st = optimizer.state.get(own[name], {})
    if not st:
      out[name] = np.zeros(tuple(own[name].shape), dtype=np.float32)
      continue
    t = int(st["step"])
    v = whole(st["exp_avg_sq"].detach()).double().cpu().numpy()
    out[name] = np.sqrt(v / (1.0 - beta2 ** t if t > 0 else 1.0)).astype(np.float32)
  return out


class TorchTrainer:
  """Plain torch training of the same model, behind the interface the worker drives (torch_impl.side.TorchSide).

  Args:
    run: the resolved run spec.
    params: canonical float32 initial weights.
    plants: planted data bugs (parity.protocol.layout.PLANT_KEYS) its steps and evals apply (`micro_loss`).
  """

  side = "torch"

  def __init__(self, run: RunSpec, params: dict[str, np.ndarray], plants: frozenset = frozenset()):
    t = run.train
    self.run = run
    self.plants = plants
    self.world = init_process_group()  # 1 unless torchrun started this process as one of several ranks
    self.device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    # bf16/fp16: the fp32 masters start rounded to the compute dtype, as DeepSpeed's do
    self.model = build_model(run.model, weights.master_weights(params, t.precision), device=self.device)
    self.optimizer = build_optimizer(decay_groups_of(self.model, t.weight_decay, plants, t.decay_mask), t)
    self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
    self.grad_clip = float(t.grad_clip)
    """The clip threshold every step clips with (`clip_like_deepspeed`; 0: none); the semantics card reads it."""
    self.step_index = 0
    """Optimizer updates applied = the LR schedule position (skipped fp16 steps do not count)."""
    self._snapshots: list[memory.StateBytes] = []
    self.loss_scaler: LossScaler | None = None
    """fp16 only: DeepSpeed's loss scaler (state_dict / load_state_dict); its cur_iter counts every step run."""
    self.half_model = None
    """bf16/fp16: the whole module cast to the compute dtype (DeepSpeed's layout); forward and backward run on it."""
    if t.precision in ("bf16", "fp16"):
      if t.precision == "fp16":
        self.loss_scaler = LossScaler.from_train(t, raise_at_min=True)
      self.half_model = copy.deepcopy(self.model).to(torch.float16 if t.precision == "fp16" else torch.bfloat16)
      halves = dict(self.half_model.named_parameters())
      names = {id(p): n for n, p in self.model.named_parameters()}
      self._half_params = [halves[names[id(p)]] for p in self.params]  # aligned with self.params
    self.ddp = self._data_parallel()
    """With several ranks (torchrun): DistributedDataParallel around the module forward and backward run on, which
    averages the gradients over ranks in backward (docs/multirank.md); None with one rank."""

  def _data_parallel(self):
    """DDP of the compute module when this process is one of several ranks (torch.distributed set up first)."""
    if self.world == 1:
      return None
    from torch.nn.parallel import DistributedDataParallel  # DDP: only with several ranks
    return DistributedDataParallel(self.half_model if self.half_model is not None else self.model)

  def _sync(self, last: bool):
    """Context of one micro batch's backward: DDP reduces the gradients only after the last one (`no_sync` before)."""
    return self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()


  def step(self, micro_batches: np.ndarray, *, probe: bool = False,
           force_overflow: bool = False, arrays=None) -> dict[str, float | bool]:
    """One optimizer step over (grad_accum_steps, micro_batch_size, seq_len + 1) uint16 or uint32 tokens.

    Args:
      micro_batches: uint16 or uint32 token ids (A, M, T + 1).
      arrays: padded/packed: this rank's parity.protocol.side.ExampleArrays (weights A*W*w), `micro_loss`.
      probe: measure state bytes before and after the update.
      force_overflow: fp16 only: multiply the scaled loss by inf, so every gradient is non-finite
        and the step is skipped (debug `overflow_at_steps`).
    Returns:
      loss (mean over micro batches, nats), grad_norm (pre-clip; inf on a skipped step) and lr (the
      rate of this step's update); fp16 adds loss_scale (the scale this step used) and skipped.
    Raises:
      ValueError: the number of micro batches differs from train.grad_accum_steps, or
        force_overflow on a run that is not fp16.
      parity.numerics.loss_scale.LossScaleAtMinimum: an overflow at train.min_loss_scale (DeepSpeed raises).
    """
    t = self.run.train
    if len(micro_batches) != t.grad_accum_steps:
      raise ValueError(f"got {len(micro_batches)} micro batches; train.grad_accum_steps={t.grad_accum_steps}")
    if force_overflow and self.loss_scaler is None:
      raise ValueError(f"force_overflow (debug overflow_at_steps) needs train.precision='fp16' (loss scaling); "
                       f"this run has train.precision={t.precision!r}")
    if self.half_model is not None:
      return self._step_cast_module(micro_batches, probe=probe, force_overflow=force_overflow, arrays=arrays)
    lr = self._set_hparams()
    self.optimizer.zero_grad(set_to_none=True)
    losses = []
    forward = self.ddp or self.model
    for i, mb in enumerate(micro_batches):
      with self._sync(i == len(micro_batches) - 1):
        loss = micro_loss(forward, mb, self.device, arrays, i, self.plants)
        (loss / t.grad_accum_steps).backward()
      losses.append(float(loss.detach()))
    norm = global_grad_norm(self.params)
    clip_like_deepspeed(self.params, self.grad_clip, norm)
    if probe:
      self._snapshots.append(self._measure())
    self.optimizer.step()
    if probe:
      self._snapshots.append(self._measure())
    self.step_index += 1
    return {"loss": sum(losses) / len(losses), "grad_norm": float(norm), "lr": lr}

  def _step_cast_module(self, micro_batches: np.ndarray, *, probe: bool, force_overflow: bool, arrays=None
                        ) -> dict[str, float | bool]:
    """`step` for bf16/fp16: DeepSpeed's step on the bfloat16/float16 module copy (fp16: loss-scaled)."""
    t, scaler = self.run.train, self.loss_scaler
    lr = schedule.train_lr(t, self.step_index)
    scale = scaler.scale if scaler is not None else 1.0
    multiplier = scale * (float("inf") if force_overflow else 1.0)
    self.half_model.zero_grad(set_to_none=True)
    losses = []
    forward = self.ddp or self.half_model
    for i, mb in enumerate(micro_batches):
      with self._sync(i == len(micro_batches) - 1):
        loss = micro_loss(forward, mb, self.device, arrays, i, self.plants)  # float32 (logits cast up)
        ((loss / t.grad_accum_steps) * multiplier).backward()  # DeepSpeed: loss / GAS, then .float() * scale
      losses.append(float(loss.detach()))
    grads16 = [h.grad for h in self._half_params]
    self.half_model.zero_grad(set_to_none=True)
    out = {"loss": sum(losses) / len(losses), "lr": lr, "loss_scale": scale, "skipped": False}
    divisor = 1.0
    if scaler is not None:
      overflow = any(g is not None and not bool(torch.isfinite(g).all()) for g in grads16)
      scaler.update(overflow)  # raises LossScaleAtMinimum where DeepSpeed raises
      if overflow:
        return {**out, "skipped": True, "grad_norm": float("inf")}
      divisor = scaler.scale  # DeepSpeed unscales with the updated scale (unscale_and_clip_grads after _update_scale)
    for p, g in zip(self.params, grads16):
      p.grad = None if g is None else g.float() / divisor
    norm = global_grad_norm(self.params)
    clip_like_deepspeed(self.params, self.grad_clip, norm)
    self._set_hparams()
    if probe:
      self._snapshots.append(self._measure())
    self.optimizer.step()
    self.optimizer.zero_grad(set_to_none=True)
    if probe:
      self._snapshots.append(self._measure())
    self.refresh_half_model()
    self.step_index += 1
    return {**out, "grad_norm": float(norm) * divisor / scale}  # the true norm (scaled norm / used scale)

  def _set_hparams(self) -> float:
    """Writes this step's lr (and OneCycle's cycled betas) into every param group, as DeepSpeed's scheduler does;
    returns the lr (`set_hparams`)."""
    return set_hparams(self.optimizer, self.run.train, self.step_index)

  @torch.no_grad()
  def refresh_half_model(self) -> None:
    """bf16/fp16: copies the float32 masters (`self.model`) into the compute copy; call after loading them."""
    if self.half_model is not None:
      for p, h in zip(self.params, self._half_params):
        h.copy_(p)

  @torch.no_grad()
  def eval_loss(self, val_batches: np.ndarray, arrays=None) -> float:
    """Mean token cross-entropy over held-out micro batches, nats (bf16/fp16: on the compute copy); padded/packed
    (arrays: ExampleArrays (E, M, T), weights summing to 1 per batch): the mean over batches of sum(w * ce)."""
    losses = []
    model = self.half_model if self.half_model is not None else self.model
    for i, mb in enumerate(val_batches):
      losses.append(float(micro_loss(model, mb, self.device, arrays, i, self.plants)))
    return sum(losses) / len(losses)

  def poison(self) -> None:
    """Fills the token embedding with NaN; the next loss is NaN."""
    with torch.no_grad():
      self.model.wte.weight.fill_(float("nan"))
      if self.half_model is not None:
        self.half_model.wte.weight.fill_(float("nan"))

  def canonical_params(self) -> dict[str, np.ndarray]:
    return to_canonical(self.model)

  def canonical_moments(self) -> dict[str, np.ndarray]:
    """Adam's bias-corrected per-element gradient RMS sqrt(exp_avg_sq / (1 - beta2^step)), canonical, float32.

    Zeros for a param no update has touched yet. Raises KeyError when the optimizer is not an Adam (Lamb, SGD: the
    params rule's per-element Adam bound does not hold for them; parity.verdict.params.param_checks falls back per
    tensor).
    """
    return adam_grad_rms(self.run, self.model, self.optimizer)

  def _measure(self) -> memory.StateBytes:
    return memory.state_bytes(self.model, self.optimizer)

  def state_bytes(self) -> memory.StateBytes:
    return memory.merge_max(*(self._snapshots or [self._measure()]))

  def describe(self) -> dict[str, Any]:
    from importlib import metadata
    try:
      ds_version = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
      ds_version = None
    return {"optimizer": {"optimizer": type(self.optimizer).__name__, "foreach": False,
                          "group_weight_decay": [g["weight_decay"] for g in self.optimizer.param_groups],
                          "clipping": "deepspeed: g / max(1, (||g|| + 1e-6) / clip)"},
            "versions": {"torch": torch.__version__, "deepspeed": ds_version}}
