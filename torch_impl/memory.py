"""Byte accounting of training state by category and by memory kind, measured on live tensors.

Categories (bytes of distinct storages; views into one flat buffer count once):
  params             the parameters the forward pass computes with (module dtype)
  gradients          gradient storage: `.grad` of params and master partitions,
                     DeepSpeed accumulation and reduction buffers
  master_params      a separate fp32 copy of the params (0 when the compute params are the master)
  optimizer_moments  Adam exp_avg and exp_avg_sq
  buffers            other tensors an optimizer wrapper holds (staging copies for offload)

Memory kinds are 'device' (the accelerator the model computes on) and 'host'
(CPU memory used for offload). On a CUDA machine a tensor's kind is where it
lives. On a CPU-only machine every tensor lives in host RAM, so the kind is the
role the configuration gives it: offloaded state (master params, their
gradients and the Adam moments under `offload_optimizer`, the params under
`offload_param`, and DeepSpeed's `*cpu*` buffers) is 'host', everything else is
'device'. This module imports torch only.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import torch

__all__ = ["CATEGORIES", "StateBytes", "state_bytes", "merge_max", "by_memory_kind"]

CATEGORIES = ("params", "gradients", "master_params", "optimizer_moments", "buffers")

StateBytes = dict[str, dict[str, int]]
"""category -> memory kind ('device' / 'host') -> bytes."""


class _Ledger:
  """Counts each storage once, under the first category that claims it."""

  def __init__(self, cuda: bool):
    self.cuda = cuda
    self.seen: set[int] = set()
    self.bytes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

  def add(self, t: torch.Tensor | None, category: str, offloaded: bool) -> None:
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
      return
    storage = t.untyped_storage()
    key = storage.data_ptr()
    if key == 0 or key in self.seen:
      return
    self.seen.add(key)
    if self.cuda:
      kind = "host" if t.device.type == "cpu" else "device"
    else:
      kind = "host" if offloaded else "device"
    self.bytes[category][kind] += storage.nbytes()

  def result(self) -> StateBytes:
    return {c: {"device": self.bytes[c]["device"], "host": self.bytes[c]["host"]} for c in CATEGORIES}


def _walk(obj: Any, name: str, depth: int = 0) -> Iterable[tuple[str, torch.Tensor]]:
  """Yields (dotted attribute path, tensor) for tensors inside lists, tuples and dicts."""
  if isinstance(obj, torch.Tensor):
    yield name, obj
    if obj.grad is not None:
      yield f"{name}.grad", obj.grad
  elif depth < 4 and isinstance(obj, (list, tuple)):
    for i, x in enumerate(obj):
      yield from _walk(x, f"{name}[{i}]", depth + 1)
  elif depth < 4 and isinstance(obj, dict):
    for k, x in obj.items():
      yield from _walk(x, f"{name}[{k}]", depth + 1)


def state_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, wrapper: Any = None,
                offload_optimizer: bool = False, offload_param: bool = False) -> StateBytes:
  """Measures the bytes of training state held right now.

  Args:
    module: the model whose forward runs (DeepSpeed: `engine.module`).
    optimizer: the basic optimizer that owns the Adam moments (e.g. DeepSpeedCPUAdam, torch AdamW).
      Its param-group tensors that are not module params are the fp32 master copy.
    wrapper: a DeepSpeed ZeRO/BF16 optimizer wrapping `optimizer`, or None. Its tensor
      attributes are classified by name: '*grad*' -> gradients, '*fp32*' -> master_params
      (ZeRO-3 keeps its fp32 partitions there), else buffers.
    offload_optimizer: master params, their gradients and moments are offloaded (CPU-only rule).
    offload_param: the compute params are offloaded (ZeRO-3 offload_param; CPU-only rule).
  Returns:
    category -> {'device': bytes, 'host': bytes}, every category and kind present.
  """
  ledger = _Ledger(cuda=any(p.device.type == "cuda" for p in module.parameters()))
  params = list(module.parameters())
  for p in params:
    ledger.add(getattr(p, "ds_tensor", None), "params", offload_param)  # ZeRO-3 partition
    ledger.add(p, "params", offload_param)
  for p in params:
    ledger.add(p.grad, "gradients", False)
  masters = [t for g in optimizer.param_groups for t in g["params"]]
  for t in masters:
    ledger.add(t, "master_params", offload_optimizer)
  for t in masters:
    ledger.add(t.grad, "gradients", offload_optimizer)
  for st in optimizer.state.values():
    for v in st.values():
      if isinstance(v, torch.Tensor) and v.dim() > 0:
        ledger.add(v, "optimizer_moments", offload_optimizer)
  if wrapper is not None and wrapper is not optimizer:
    for attr, value in vars(wrapper).items():
      if attr == "optimizer" or attr.startswith("__"):
        continue
      for path, t in _walk(value, attr):
        low = path.lower()
        category = "gradients" if "grad" in low else "master_params" if "fp32" in low else "buffers"
        ledger.add(t, category, "cpu" in low or (offload_optimizer and "fp32" in low))
  return ledger.result()


def merge_max(*snapshots: StateBytes) -> StateBytes:
  """Per (category, kind) maximum over snapshots taken at different moments of a step."""
  out: dict[str, dict[str, int]] = {}
  for snap in snapshots:
    for cat, kinds in snap.items():
      for kind, n in kinds.items():
        out.setdefault(cat, {})[kind] = max(out.get(cat, {}).get(kind, 0), n)
  return out


def by_memory_kind(snapshot: StateBytes) -> dict[str, int]:
  """Totals per memory kind: {'device': bytes, 'host': bytes} (both keys always present)."""
  out = {"device": 0, "host": 0}
  for kinds in snapshot.values():
    for kind, n in kinds.items():
      out[kind] = out.get(kind, 0) + n
  return out
