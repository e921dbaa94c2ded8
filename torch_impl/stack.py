"""The training stack's side of the DeepSpeed engine (parity.migrate._stack): the client optimizer a stack hands
`deepspeed.initialize` for a config without an optimizer section (`client_class`, `client_optimizer`), and the check
that the optimizer DeepSpeed built decays exactly the tensors train.decay_mask names (`decay_problems`).
Imports torch and deepspeed only.
"""
from __future__ import annotations

from typing import Any

import torch

from parity.spec import RunSpec
from parity.weights import decays
from torch_impl.baseline import build_optimizer  # the one torch builder of the optimizer
from torch_impl.ds_config import has_optimizer_section
from torch_impl.semantics import decay_set

__all__ = ["client_class", "client_optimizer", "decay_problems"]


def client_class(config: dict[str, Any]) -> str | None:
  """The class of the client optimizer a config without an optimizer section runs with (None: it has one).

  Under offload_optimizer cpu/nvme with zero_force_ds_cpu_optimizer not false, DeepSpeedCPUAdam: the only client
  DeepSpeed accepts there (engine._configure_optimizer raises ZeRORuntimeException for any other), and what every
  stack that runs such a config passes (parity.migrate._stack: Accelerate swaps the Trainer's torch AdamW for
  DeepSpeedCPUAdam, Megatron's --cpu-optimizer builds one); a bare script passing torch AdamW is refused by the
  port beforehand. Otherwise the HF Trainer's torch.optim.AdamW ('AdamW')."""
  if has_optimizer_section(config):
    return None
  zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), dict) else {}
  off = (zero.get("offload_optimizer") or {}).get("device", "none") if isinstance(zero, dict) else "none"
  forced = config.get("zero_force_ds_cpu_optimizer", True) is not False
  return "DeepSpeedCPUAdam" if off in ("cpu", "nvme") and forced else "AdamW"


def client_optimizer(groups: list[dict[str, Any]], train, config: dict[str, Any] | None = None
                     ) -> torch.optim.Optimizer:
  """The optimizer a training stack passes to deepspeed.initialize for a config without an optimizer section:
  torch.optim.AdamW with the run's lr, betas and eps, each param group keeping its own weight_decay (the HF
  Trainer's `create_optimizer`); where `client_class` says DeepSpeedCPUAdam, that AdamW's param groups handed to
  DeepSpeedCPUAdam with the AdamW's lr and weight_decay, as accelerate 1.16.0 `map_pytorch_optim_to_deepspeed`
  does (adamw_mode true for AdamW, false for Adam; each group keeps its own betas, eps and weight_decay: torch's
  add_param_group only fills a group's missing keys)."""
  opt = build_optimizer(groups, train, lr=train.lr)
  if config is None or client_class(config) != "DeepSpeedCPUAdam":
    return opt
  from deepspeed.ops.adam import DeepSpeedCPUAdam  # deepspeed: after setup_distributed set DS_ACCELERATOR
  return DeepSpeedCPUAdam(opt.param_groups, lr=opt.defaults["lr"], weight_decay=opt.defaults["weight_decay"],
                          adamw_mode=isinstance(opt, torch.optim.AdamW))


def decay_problems(engine, run: RunSpec, plants: frozenset = frozenset()) -> list[str]:
  """The difference between the tensors DeepSpeed's optimizer decays (its param groups with weight_decay > 0, read
  back through the ZeRO wrapper's module params) and the ones train.decay_mask names (with the 'decay_biases' plant:
  and every bias), as one message per side that has extra names; [] when they agree."""
  wrapper = engine.optimizer
  bit16 = getattr(wrapper, "bit16_groups", None) or getattr(wrapper, "fp16_groups", None)
  names = {id(p): n for n, p in engine.module.named_parameters()}
  built, wd = decay_set(getattr(wrapper, "optimizer", wrapper).param_groups, names, bit16)
  t = run.train
  want = sorted(n for n in names.values() if t.weight_decay > 0 and (
      decays(n, t.decay_mask) or ("decay_biases" in plants and n.endswith(".bias"))))
  mask, out = f"train.decay_mask {t.decay_mask!r}", []
  for extra, text in ((sorted(set(built) - set(want)), f"decayed by DeepSpeed but not by {mask}"),
                      (sorted(set(want) - set(built)), f"decayed by {mask} but not by DeepSpeed")):
    if extra:
      out.append(f"{len(extra)} tensor(s) {text}: {', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''}")
  if built and wd != t.weight_decay:
    out.append(f"the decayed group's weight_decay is {wd}, train.weight_decay {t.weight_decay}")
  return out
