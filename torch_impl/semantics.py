"""The PyTorch sides' semantics card (parity.protocol.semantics), probed on the objects their steps run, after the
trainer is built and before step 1 (`torch_impl.side.TorchSide.semantics`), and the 'decay_biases' plant of their
param groups (`decay_groups_of`).

  rotary.layout        `torch_impl.layers._apply_rope` on the basis vector e_0 at a constant angle
  mlp.gelu_form        the built model's first block `MLP.act` at parity.semantics.GELU_PROBE_X
  norm.*               a copy of the first block's `ln_1` (weight 1, bias 0) on known vectors
                       (parity.semantics.norm_probe); norm.rounding: the copy in bfloat16 with the rounding probe's
                       weight (parity.semantics.classify_norm_rounding); norm.eps_all: the `eps` of every norm module
                       of the module the forward runs (`norm_eps_by_name`: each block's, the q/k norms, ln_f)
  forward.probe_loss   a fresh float32 `build_model` of the spec on the CPU (the class the side trains, this
                       process's family plants included) at parity.semantics.probe_params, its `lm_loss`
  attention.*          the first block's Attention module: its spec.scale (the `scale=` of its SDPA call); the
                       soft-caps: `torch_impl.layers.softcap` at parity.semantics.CAP_PROBE with the Attention's and
                       the model's spec caps (what forward passes it); the q/k norm: the first block's `attn.ln_q`
                       (norm_of), null when it has none; the window of each layer: the model's own `_masks` at
                       T = train.seq_len (None: SDPA's is_causal, 'full')
  rotary.per_layer     the model's own `_ropes(2)` (the (cos, sin) each block gets), row 1 (parity.semantics.rope_row)
  embedding.scale      the model's own `_embed` with a stand-in embedding table of ones
  loss.*               `torch_impl.model.micro_loss` (the loss every torch trainer computes) with a stand-in forward
                       whose logits pick input + k: the k it scores 0 is the label shift; logits 0 give the reduction
  optimizer.decay_set  the canonical names in the optimizer's param groups with weight_decay > 0: torch
                       `optimizer.param_groups`; DeepSpeed's engine optimizer groups (a ZeRO wrapper's
                       bit16_groups / fp16_groups hold the module's params of each flat group)
  eps, bias correction a fresh optimizer of the side's class and group settings (lr 1), one step on a 1-element
                       param with gradient eps (parity.numerics.adam.classify_adam)
  betas, eps, decays   the optimizer's param groups as built (`optimizer_items`): DeepSpeed's engine optimizer's
                       (under a ZeRO wrapper, the basic optimizer it steps); one value, or each group's when they differ
  clip, lr.step0       the clip threshold the torch / FSDP2 trainer's step clips with (its `grad_clip`) and its
                       scheduler (parity.numerics.schedule.train_lr at its step index); DeepSpeed's
                       engine.gradient_clipping() and its optimizer's current lr
  dtypes               the forward's module (FSDP2: the param dtype its modules cast to), the optimizer's params
                       (master), the probe's moments
  matmul, dropout      torch.get_float32_matmul_precision / allow_tf32; the largest nn.Dropout p in the module
"""
from __future__ import annotations

import copy
import inspect
import os
import types
from typing import Any

import numpy as np
import torch

from parity.numerics import schedule
from parity.numerics.adam import classify_adam
from parity import semantics as card_lib
from parity.semantics import sig
from parity.weights import decays
from torch_impl.layers import _apply_rope, softcap
from torch_impl.model import build_model, lm_loss, micro_loss
from torch_impl.trainer import Trainer

__all__ = ["semantics_card", "decay_groups_of", "gelu_form", "rotary_layout", "norm_of", "norm_rounding", "probe_loss",
           "family_items", "label_shift",
           "loss_reduction", "decay_set", "adam_form", "matmul_precision", "norm_eps_by_name", "optimizer_items"]


def decay_groups_of(model: torch.nn.Module, weight_decay: float, plants: frozenset = frozenset(),
                    mask: str = "matrices") -> list[dict]:
  """The param groups of `parity.weights.decays` under `mask` (train.decay_mask; 'matrices' is
  `torch_impl.model.decay_groups`): [decayed with weight_decay, the rest with 0.0], empty groups dropped, so 'all'
  is one group over every parameter. With the planted bug 'decay_biases' (parity.protocol.layout.PLANT_KEYS): every
  '*.bias' moved into the decayed group (the group made when there was none)."""
  named = list(model.named_parameters())
  groups = [g for g in ({"params": [p for n, p in named if decays(n, mask)], "weight_decay": float(weight_decay)},
                        {"params": [p for n, p in named if not decays(n, mask)], "weight_decay": 0.0}) if g["params"]]
  if "decay_biases" not in plants:
    return groups
  names = {id(p): n for n, p in model.named_parameters()}
  moved = [p for g in groups if g["weight_decay"] == 0.0 for p in g["params"] if names[id(p)].endswith(".bias")]
  keep = [dict(g, params=[p for p in g["params"] if not any(p is m for m in moved)]) if g["weight_decay"] == 0.0
          else dict(g, params=list(g["params"]) + (moved if g["weight_decay"] > 0 else [])) for g in groups]
  if not any(g["weight_decay"] > 0 for g in keep):
    keep.insert(0, {"params": moved, "weight_decay": float(weight_decay)})
  return [g for g in keep if g["params"]]


def gelu_form(act: Any) -> str:
  """'tanh' | 'erf' | 'silu' | 'other' of a nonlinearity module or function, at parity.semantics.GELU_PROBE_X."""
  return card_lib.classify_gelu(act(torch.tensor(card_lib.GELU_PROBE_X, dtype=torch.float32)).double().tolist())


def rotary_layout(apply_rope: Any, head_dim: int) -> str:
  """The layout of apply_rope(x (1, 1, 1, H), cos, sin (1, H)) on e_0 at angle 0.5."""
  x = torch.zeros(1, 1, 1, head_dim)
  x[..., 0] = 1.0
  c, s = torch.full((1, head_dim), float(np.cos(0.5))), torch.full((1, head_dim), float(np.sin(0.5)))
  return card_lib.classify_rotary(apply_rope(x, c, s).reshape(-1).detach().numpy())


def _probe_copy(module: torch.nn.Module) -> torch.nn.Module:
  """A float32 CPU copy of a norm module to probe (its class, eps and form). A ZeRO-3 partitioned module (its params
  carry ds_shape) or an FSDP2-sharded one (DTensor params, whose shape is the whole one) is rebuilt as its class with
  its own eps and full width instead: a copy would carry DeepSpeed's partitioned params and hooks, or DTensors a plain
  input cannot meet."""
  full = ([tuple(p.ds_shape) for p in module.parameters() if hasattr(p, "ds_shape")] or
          [tuple(p.shape) for p in module.parameters() if hasattr(p, "device_mesh")])  # an FSDP2 DTensor: its shape
  if not full:
    probe = copy.deepcopy(module)
  elif isinstance(module, torch.nn.LayerNorm):
    probe = torch.nn.LayerNorm(full[0], eps=module.eps, bias=module.bias is not None)
  else:  # torch_impl's RMSNorm: its (1 + w) form kept
    probe = type(module)(full[0][0], module.eps, getattr(module, "plus_one", False))
  return probe.float().cpu()


def norm_of(module: torch.nn.Module) -> dict[str, Any]:
  """{form, eps, stats_dtype} of a norm module (a copy of it, `_probe_copy`, weight 1 and bias 0, probed on known
  vectors)."""
  probe = _probe_copy(module)
  with torch.no_grad():
    for name, p in probe.named_parameters():
      p.fill_(0.0 if name == "bias" else 1.0)

  def apply(x: np.ndarray) -> np.ndarray:
    m = probe.half() if x.dtype == np.float16 else probe.float()
    with torch.no_grad():
      return m(torch.from_numpy(x)[None]).double().reshape(-1).numpy()
  d = next(probe.parameters()).shape[0]
  return card_lib.norm_probe(apply, d)


def norm_rounding(module: torch.nn.Module, form: str) -> str:
  """norm.rounding of a norm module (parity.semantics.classify_norm_rounding): a probe copy (`_probe_copy`) in
  bfloat16, its weight the rounding probe's and bias 0, on the probe's bfloat16 input; `form` is its norm.form."""
  probe = _probe_copy(module)
  d = next(probe.parameters()).shape[0]
  x, w = card_lib.rounding_probe(d, form == "rmsnorm(1+w)")
  with torch.no_grad():
    for name, p in probe.named_parameters():
      p.copy_(torch.zeros_like(p) if name == "bias" else torch.from_numpy(w))
    y = probe.to(torch.bfloat16)(torch.from_numpy(x).to(torch.bfloat16)).float().numpy()
  return card_lib.classify_norm_rounding(x, w, y, form, getattr(module, "eps", None))


def norm_eps_by_name(model: torch.nn.Module) -> dict[str, float | None]:
  """{module name ('h.0.ln_1', 'h.0.attn.ln_q', 'ln_f'): its eps} of every norm module of `model` (a class named
  '...Norm' with an `eps`: torch's LayerNorm and RMSNorm, torch_impl's RMSNorm; the eps its forward adds; None:
  torch.nn.RMSNorm's dtype default). The module names are the canonical ones (torch_impl.layers)."""
  return {name: (None if m.eps is None else float(m.eps)) for name, m in model.named_modules()
          if "norm" in type(m).__name__.lower() and hasattr(m, "eps")}


def optimizer_items(groups: list[dict]) -> dict[str, Any]:
  """optimizer.betas, optimizer.eps and optimizer.weight_decay_groups of an optimizer's param groups as built: the
  betas and eps every group holds (`parity.semantics.one_or_each`: each group's when they differ; None where the
  groups hold none, SGD), and the distinct weight decays of the groups, ascending."""
  betas = [[float(b) for b in g["betas"]] for g in groups if g.get("betas") is not None]
  eps = [float(g["eps"]) for g in groups if g.get("eps") is not None]
  return {"optimizer.betas": card_lib.one_or_each(betas), "optimizer.eps": card_lib.one_or_each(eps),
          "optimizer.weight_decay_groups": sorted({sig(float(g.get("weight_decay", 0.0)), 6) for g in groups})
          if groups else None}


def probe_loss(spec) -> float | None:
  """forward.probe_loss: the loss of a fresh torch_impl model of parity.semantics.probe_spec(spec) (the class every
  torch side trains, with any planted family bug of this process) in float32 on the CPU, at probe_params on
  probe_tokens; None where probe_spec is None."""
  spec = card_lib.probe_spec(spec)
  if spec is None:
    return None
  tokens = torch.from_numpy(card_lib.probe_tokens(spec))
  model = build_model(spec, card_lib.probe_params(spec), device="cpu")
  with torch.no_grad():
    return float(lm_loss(model(tokens[:, :-1]), tokens[:, 1:]))


def family_items(model: torch.nn.Module, seq_len: int) -> dict[str, Any]:
  """The model-family items of the module docstring: rotary.per_layer, attention.qk_norm(_eps),
  attention.softcap, attention.window, embedding.scale, logits.final_softcap, of a torch_impl GPT (a DeepSpeed
  engine's module too: only its spec, modules and own methods are used, no parameter values). seq_len: the rows' T."""
  cpu = torch.device("cpu")
  ropes = model._ropes(2, None, cpu)
  rope = None if model.spec.position != "rope" else [
      card_lib.rope_row(c[1].double().numpy(), s[1].double().numpy()) for c, s in ropes]
  window = [("full" if m is None else card_lib.window_of((m[0, 0] == 0).numpy()))
            for m in model._masks(seq_len, None, torch.float32, cpu)]
  ln_q = getattr(model.h[0].attn, "ln_q", None)
  qk = norm_of(ln_q) if ln_q is not None else None
  cap = lambda c: None if c is None else sig(float(softcap(
      torch.full((1,), card_lib.CAP_PROBE, dtype=torch.float32), c)[0]), 6)
  table = types.SimpleNamespace(spec=model.spec, wte=lambda t: torch.ones(*t.shape, 1),
                                wpe=lambda p: torch.zeros(*p.shape, 1))
  scale = float(type(model)._embed(table, torch.zeros(1, 1, dtype=torch.long), None)[0, 0, 0])
  return {"rotary.per_layer": rope, "attention.qk_norm": qk["form"] if qk else None,
          "attention.qk_norm_eps": qk["eps"] if qk else None,
          "attention.softcap": cap(model.h[0].attn.spec.attn_softcap), "attention.window": window,
          "embedding.scale": sig(scale, 6), "logits.final_softcap": cap(model.spec.final_softcap)}


def label_shift(loss: Any, train) -> int | None:
  """The k for which `loss(forward, tokens)` is 0 when the stand-in forward's logits pick input + k (k = 0..2)."""
  t, v = 6, 16
  tokens = np.arange(t + 1, dtype=np.int64)[None]
  for k in range(3):
    def forward(x, segment_ids=None, positions=None, k=k):
      logits = torch.zeros(*x.shape, v)
      logits.scatter_(-1, (x + k).clamp(max=v - 1)[..., None], 60.0)
      return logits
    if float(loss(forward, tokens)) < 1e-6:
      return k
  return None


def _stand_in_arrays(t: int) -> Any:
  """An ExampleArrays-shaped (A=1, M=1, T) object: one example over the row, weights 1 / T."""
  return types.SimpleNamespace(segment_ids=np.ones((1, 1, t), np.int32), positions=np.arange(t)[None, None],
                               weights=np.full((1, 1, t), 1.0 / t, np.float32))


def loss_reduction() -> str:
  """The reduction of `micro_loss` (stream) on logits 0: 'mean' | 'sum' | 'other'."""
  v, n = card_lib.REDUCTION_PROBE
  y = micro_loss(lambda x: torch.zeros(*x.shape, v), np.zeros((1, n + 1), np.int64), torch.device("cpu"))
  return card_lib.classify_reduction(float(y))


def decay_set(groups: list[dict], names: dict[int, str], bit16: list | None = None) -> tuple[list[str], float | None]:
  """(sorted canonical names in groups with weight_decay > 0, that decay); `bit16`: a ZeRO wrapper's module params
  of each group (its own params are flat partitions)."""
  out, wd = [], None
  for i, g in enumerate(groups):
    if g.get("weight_decay", 0.0) > 0:
      wd = float(g["weight_decay"])
      params = bit16[i] if bit16 is not None else g["params"]
      out += [names[id(p)] for p in params if id(p) in names]
  return sorted(out), wd


def adam_form(optimizer: torch.optim.Optimizer, dtype: torch.dtype, eps: float,
              device: torch.device | str = "cpu") -> dict[str, Any]:
  """{eps_placement, bias_correction, moments dtype} from a fresh optimizer of `optimizer`'s class and first group's
  settings (lr 1, no decay), one step on a 1-element param of `dtype` on `device` (where the side's optimizer keeps
  its params: FusedAdam steps CUDA tensors) with gradient eps."""
  g0 = optimizer.param_groups[0]
  p = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
  kw = {k: g0[k] for k in ("betas", "eps", "bias_correction", "amsgrad", "eps_inside_sqrt", "max_coeff", "min_coeff")
        if k in g0}
  takes = inspect.signature(type(optimizer).__init__).parameters
  for name in ("adamw_mode", "adam_w_mode"):  # DeepSpeedCPUAdam's and FusedAdam's names of the same switch
    if name in takes and hasattr(optimizer, "adam_w_mode"):
      kw[name] = bool(optimizer.adam_w_mode)
  if not any(p.kind == p.VAR_KEYWORD for p in takes.values()):
    kw = {k: v for k, v in kw.items() if k in takes}
  try:
    probe = type(optimizer)([p], lr=1.0, weight_decay=0.0, **kw)
    p.grad = torch.full((1,), eps, dtype=dtype, device=device)
    probe.step()
  except Exception as exc:  # an optimizer class that cannot be built or stepped again here: named, not guessed
    return {"eps_placement": None, "bias_correction": None, "moments": None,
            "note": f"{type(optimizer).__name__} not probed ({type(exc).__name__}: {exc})"}
  u = -float(p.detach()[0])
  betas = g0.get("betas", (0.0, 0.0))
  placement, bc = classify_adam(u, eps, eps, float(betas[0]), float(betas[1]), 1)
  state = probe.state.get(p, {})
  first, sq = state.get("exp_avg"), state.get("exp_avg_sq")
  return {"eps_placement": placement, "bias_correction": bc, "moments": card_lib.moments_dtype(
      [] if first is None else [_dtype(first.dtype)], [] if sq is None else [_dtype(sq.dtype)])}


def matmul_precision() -> str:
  """'highest' | 'high' (TF32) | 'medium' of torch's float32 matmuls."""
  prec = torch.get_float32_matmul_precision()
  if torch.backends.cuda.matmul.allow_tf32 and prec == "highest":
    return "high"
  return prec


def _dtype(t: torch.dtype) -> str:
  return str(t).replace("torch.", "")


def _engine_parts(trainer) -> dict[str, Any]:
  """The DeepSpeed engine's objects the card reads: module, optimizer (with its groups' module params), lr, clip."""
  engine = trainer.engine
  wrapper = engine.optimizer
  basic = getattr(wrapper, "optimizer", wrapper)
  bit16 = getattr(wrapper, "bit16_groups", None) or getattr(wrapper, "fp16_groups", None)
  own = [p for g in basic.param_groups for p in g["params"]]  # ZeRO-3 keeps its fp32 partitions outside the groups
  flat = getattr(wrapper, "fp32_partitioned_groups_flat", None) or []
  master = (own or flat)[0]
  clip = float(engine.gradient_clipping() or 0.0)
  return {"module": engine.module, "forward_module": engine.module, "optimizer": basic, "bit16": bit16,
          "master": master.dtype, "device": master.device, "lr": float(wrapper.param_groups[0]["lr"]), "clip": clip,
          "optimizer_name": f"{type(wrapper).__name__}/{type(basic).__name__}"}


def _baseline_parts(trainer) -> dict[str, Any]:
  """The plain-torch trainer's objects the card reads (its scheduler: parity.numerics.schedule.train_lr)."""
  t = trainer.run.train
  return {"module": trainer.model, "forward_module": trainer.half_model or trainer.model,
          "optimizer": trainer.optimizer, "bit16": None, "master": trainer.params[0].dtype,
          "device": trainer.params[0].device,
          "lr": float(schedule.train_lr(t, trainer.step_index)), "clip": float(trainer.grad_clip),
          "optimizer_name": type(trainer.optimizer).__name__}


def _fsdp_parts(trainer) -> dict[str, Any]:
  """The FSDP2 trainer's objects (torch_impl.fsdp.FsdpTrainer): the plain-torch side's optimizer, scheduler and clip;
  the forward's param dtype is the one its FSDP2 modules cast to (MixedPrecisionPolicy.param_dtype, read from their
  FSDPParams: `trainer.describe()['fsdp']`), which with the reduce dtype and the offload goes into the card's info.
  dtypes.grads is the lower of the master dtype and the gradient reduce dtype (MixedPrecisionPolicy.reduce_dtype):
  the sharded gradients the optimizer reads are float32, but a 16-bit reduce rounds them first, so they carry that
  precision (the planted 'fsdp_reduce_dtype_low' shows here at step 0); a correct policy reduces in float32."""
  t, built = trainer.run.train, trainer.describe()["fsdp"]
  return {"module": trainer.model, "forward_module": trainer.model, "forward_dtype": built["param_dtype"],
          "optimizer": trainer.optimizer, "bit16": None, "master": trainer.params[0].dtype,
          "device": trainer.device, "lr": float(schedule.train_lr(t, trainer.step_index)),
          "clip": float(trainer.grad_clip),
          "optimizer_name": type(trainer.optimizer).__name__, "grads_dtype": _lower(built["reduce_dtype"],
                                                                                      _dtype(trainer.params[0].dtype)),
          "info": {f"fsdp.{k}": v for k, v in built.items()}}


def _lower(reduce: str | list[str], master: str) -> str:
  """The lowest-precision dtype name of the reduce dtype(s) (a name, or the sorted list of several) and the master's."""
  names = ([reduce] if isinstance(reduce, str) else list(reduce)) + [master]
  return max(names, key=lambda n: torch.finfo(getattr(torch, n)).eps)  # the largest eps: the coarsest


def semantics_card(trainer: Trainer, side: str, plants: frozenset) -> dict[str, Any]:
  """{'items', 'info'} of a built DeepSpeedTrainer (side 'deepspeed'), TorchTrainer ('torch') or FsdpTrainer ('fsdp':
  the FSDP2 param and reduce dtypes, offload and mesh are info, not diffed: the other sides have no such items)."""
  run = trainer.run
  spec, train = run.model, run.train
  parts = (_engine_parts(trainer) if side == "deepspeed" else _fsdp_parts(trainer) if side == "fsdp" else
           _baseline_parts(trainer))
  model = parts["module"]
  block = model.h[0]
  names = {id(p): n for n, p in model.named_parameters()}
  decayed, wd = decay_set(parts["optimizer"].param_groups, names, parts["bit16"])
  adam = adam_form(parts["optimizer"], parts["master"], float(train.eps), parts["device"])
  norm = norm_of(block.ln_1)
  dev = torch.device("cpu")
  loss = ((lambda f, x: micro_loss(f, x, dev)) if train.layout == "stream" else
          (lambda f, x: micro_loss(f, x, dev, _stand_in_arrays(x.shape[1] - 1), plants=plants)))
  dropout = max([float(m.p) for m in model.modules() if isinstance(m, torch.nn.Dropout)] or [0.0])
  attn = block.attn
  items = {
      "rotary.layout": rotary_layout(_apply_rope, spec.head_dim) if spec.position == "rope" else None,
      "rotary.import_permutation": card_lib.IMPORT_PERMUTATION,
      "mlp.gelu_form": gelu_form(block.mlp.act),
      "norm.form": norm["form"], "norm.eps": norm["eps"], "norm.stats_dtype": norm["stats_dtype"],
      "norm.eps_all": card_lib.norm_eps_item(norm_eps_by_name(parts["forward_module"])),
      "norm.rounding": norm_rounding(block.ln_1, norm["form"]), "forward.probe_loss": probe_loss(spec),
      "attention.scale": sig(attn.spec.scale, 6), **family_items(model, train.seq_len),
      "loss.label_shift": label_shift(loss, train), "loss.reduction": loss_reduction(),
      "optimizer.decay_set": decayed, "optimizer.weight_decay": wd if train.optimizer == "adamw" else None,
      **optimizer_items(parts["optimizer"].param_groups),
      "optimizer.eps_placement": adam["eps_placement"], "optimizer.bias_correction": adam["bias_correction"],
      "clip.rule": "global-l2" if parts["clip"] > 0 else "none",
      "clip.max_norm": parts["clip"] if parts["clip"] > 0 else None,
      "lr.step0": sig(parts["lr"], 6),
      "dtypes.params": parts.get("forward_dtype") or _dtype(next(parts["forward_module"].parameters()).dtype),
      "dtypes.master": _dtype(parts["master"]),
      "dtypes.moments": adam["moments"], "dtypes.grads": parts.get("grads_dtype") or _dtype(parts["master"]),
      "matmul.precision": matmul_precision(), "dropout": dropout}
  info = {"optimizer": parts["optimizer_name"], "foreach": parts["optimizer"].param_groups[0].get("foreach"),
          "fused": parts["optimizer"].param_groups[0].get("fused"),
          "attention.scale_source": "the first block's Attention spec.scale (its SDPA scale=)",
          "rotary.import_permutation_source": "parity.hf maps tensors by name and transposes only",
          "optimizer.hyper_source": f"{parts['optimizer_name']} param_groups (betas, eps, weight_decay)",
          "clip.max_norm_source": ("engine.gradient_clipping()" if side == "deepspeed" else
                                   "the trainer's grad_clip (what its step passes clip_like_deepspeed)"),
          **({"optimizer_probe": adam["note"]} if "note" in adam else {}), **parts.get("info", {}),
          "precision_settings": _precision_settings(parts)}
  return {"items": items, "info": info}


def _precision_settings(parts: dict) -> dict:
  """This side's precision settings (parity.semantics.precision_settings): the device of its forward module and
  torch's float32 matmul switches."""
  param = next(parts["forward_module"].parameters(), None)
  dev = param.device if param is not None else torch.device("cpu")
  name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type  # 'cpu', as JAX's device_kind
  matmul = (f"float32_matmul_precision={torch.get_float32_matmul_precision()}, "
            f"cuda.matmul.allow_tf32={torch.backends.cuda.matmul.allow_tf32}, "
            f"cudnn.allow_tf32={torch.backends.cudnn.allow_tf32}")
  return card_lib.precision_settings(os.environ, dev.type, name, matmul)
