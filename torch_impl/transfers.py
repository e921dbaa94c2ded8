"""Host<->device bytes per optimizer step of a DeepSpeed engine under ZeRO-Offload, and CPU Adam's own time per step.

The DeepSpeed side's counterpart of the JAX side's `placement.json` `bytes_per_step` (`summary.json` key
`transfers`). `TransferProbe` wraps, on the live engine's own objects (never DeepSpeed's classes),
the methods through which DeepSpeed 0.19.8 moves offloaded tensors, and adds each call's bytes, read from the
DeepSpeed buffer the call copies, to the step it runs in (`TransferProbe.step`, opened by
`torch_impl.engine.DeepSpeedTrainer.step`). What each wrapped method copies (deepspeed/runtime/zero/...):

  ZeRO-1/2, offload_optimizer cpu (stage_1_and_2.py, `DeepSpeedZeroOptimizer`):
    async_accumulate_grad_in_cpu_via_gpu   the param's gradient to its host buffer `accumulated_grads_in_cpu[id]`
                                           (d2h, the param's whole numel in its dtype), and first that buffer back
                                           to the device to add to (h2d) when `micro_step_id > 0`
    async_inplace_copy_grad_to_fp32_buffer_from_gpu   the partition's slice `grad_position[id]` into
                                           `single_partition_of_fp32_groups[i].grad` (d2h, master dtype)
    copy_grads_in_partition (compact fp32-accumulation path, at the boundary)   the same slice, d2h
    _restore_cpu_offload_grad_to_gpu       `accumulated_grads_in_cpu[id]` back to the device (h2d; unmanaged mode)
    step (no overflow)                     `param_buffer_of_bit16_for_cpu_offload_groups[i]` (the updated fp32
                                           partition cast on the host) into the device's bit16 partition (h2d)
  ZeRO-3 (stage3.py, `DeepSpeedZeroOptimizer_Stage3`; partition_parameters.py):
    partition_grads                        each gradient partition into its host slice of `grad_partitions_flat_buffer`
                                           (d2h at micro step 0); where that buffer is not on the accelerator,
                                           `.to(device)` back (h2d) every micro step and a copy out again (d2h) on
                                           the later ones; on an accelerator that holds it (the CPU one) the later
                                           micro steps add in place
    _offload_grad_partition_at_boundary    the accumulated partition into `fp32_partitioned_groups_flat[i].grad`
                                           (d2h, master dtype)
    _reassign_or_swap_out_partitioned_parameters   `fp32_partitioned_groups_flat[i]` into
                                           `fp16_partitioned_groups_flat[i]`: h2d, d2h or neither by where each lives
    param.all_gather_coalesced / param.all_gather   each fetched (NOT_AVAILABLE) param's host partition
                                           `param.ds_tensor` to the device (`.to(device)`, h2d), under offload_param

Where a tensor lives: on an accelerator, its `.device`; on the CPU accelerator (DS_ACCELERATOR=cpu) every tensor is
host memory, so the role the config gives it (the offload_optimizer buffers above, the offload_param partitions in
`param_groups_fp16_flat_cpu_memory`) is 'host' and the rest 'device' (torch_impl.memory's rule); the copies are then
host-to-host, and a `.to('cpu')` of a host tensor returns that tensor (no copy) while counting as the transfer it is
on an accelerator. Not counted: the batch (token ids to the device each micro step), scalars (norms, overflow flags),
NVMe swapping. Imports torch and deepspeed (after torch_impl.distributed.setup_distributed).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter, defaultdict
from typing import Any, Callable, Iterator

import torch

__all__ = ["SOURCE", "TransferProbe", "no_offload"]

SOURCE = "DeepSpeed config and the engine's partitioned buffers"
"""The `source` string of every `transfers` block (SCHEMA.md)."""


def _nbytes(t: torch.Tensor | None) -> int:
  return 0 if t is None else int(t.numel()) * int(t.element_size())


def _dtype(t: torch.Tensor) -> str:
  return str(t.dtype).replace("torch.", "").replace("float32", "fp32").replace("bfloat16", "bf16").replace(
      "float16", "fp16")


def _offload_device(cfg: Any) -> str:
  """'cpu' / 'nvme' / 'none' of a DeepSpeed offload config object (None: 'none')."""
  if cfg is None:
    return "none"
  device = getattr(cfg, "device", "none")
  return str(getattr(device, "value", device))


def no_offload(source: str, notes: list[str]) -> dict[str, Any]:
  """The `transfers` block of a side that offloads nothing: zero bytes, no items (SCHEMA.md)."""
  return {"source": source, "offload_optimizer": "none", "offload_param": "none", "zero_stage": None,
          "bytes_per_step": {"h2d": 0, "d2h": 0}, "items": [], "cpu_adam_s": None, "notes": list(notes)}


class _Item:
  """One transfer kind: tensor label, direction, provenance and the bytes of one full pass (from the buffers)."""

  def __init__(self, tensor: str, direction: str, source: str, one_pass: Callable[[], int]):
    self.tensor, self.direction, self.source, self.one_pass = tensor, direction, source, one_pass


class TransferProbe:
  """Counts the host<->device bytes DeepSpeed's offload paths move per optimizer step, and times CPU Adam's step.

  Args:
    engine: a live `deepspeed.DeepSpeedEngine` (built by torch_impl.engine.build_engine).
  Use `with probe.step(): torch_step(...)` around every optimizer step; `summary()` gives the `transfers` block.
  Installing wraps methods on the engine's own objects (instance attributes that shadow the class methods DeepSpeed
  calls through `self`); it changes no value DeepSpeed computes.
  """

  def __init__(self, engine):
    from deepspeed.accelerator import get_accelerator  # deepspeed: after setup_distributed set DS_ACCELERATOR
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    self.engine, self.opt = engine, engine.optimizer
    self.accelerator = get_accelerator()
    self.on_cpu = self.accelerator.device_name() == "cpu"
    self.stage = int(engine.zero_optimization_stage())
    self.offload_optimizer = _offload_device(engine.zero_offload_optimizer())
    self.offload_param = _offload_device(engine.zero_offload_param()) if self.stage == 3 else "none"
    self.basic = getattr(self.opt, "optimizer", self.opt)
    self.cpu_adam = isinstance(self.basic, DeepSpeedCPUAdam)
    self.items: dict[str, _Item] = {}
    self.steps: list[Counter] = []
    self.adam_s: list[float] = []
    self.adam_calls: list[int] = []
    self._now: Counter | None = None
    self._adam_now = [0.0, 0]
    self._phase = "forward"
    self._names = {id(p): n for n, p in engine.module.named_parameters()}
    if self.offload_optimizer == "cpu" and self.stage in (1, 2):
      self._install_zero12()
    if self.stage == 3:
      self._install_zero3()
    if self.cpu_adam:
      self._wrap(self.basic, "step", timed=True)
    self._wrap_phases()

  # ------------------------------------------------------------------ recording

  @contextlib.contextmanager
  def step(self) -> Iterator[None]:
    """The window of one optimizer step: bytes and CPU Adam time inside it are that step's."""
    self._now, self._adam_now, self._phase = Counter(), [0.0, 0], "forward"
    try:
      yield
    finally:
      self.steps.append(self._now)
      if self._adam_now[1]:
        self.adam_s.append(self._adam_now[0])
        self.adam_calls.append(self._adam_now[1])
      self._now = None

  def _add(self, key: str, nbytes: int) -> None:
    if self._now is not None and nbytes:
      self._now[key] += int(nbytes)

  def _wrap(self, obj: Any, name: str, before: Callable | None = None, after: Callable | None = None,
            timed: bool = False) -> None:
    """Shadows `obj.name` with a wrapper calling `before(*args)` / `after(*args)` around it (inside a step only)."""
    orig = getattr(obj, name)

    def wrapper(*args, **kwargs):
      live = self._now is not None
      if live and before is not None:
        before(*args, **kwargs)
      t0 = time.perf_counter()
      out = orig(*args, **kwargs)
      if live and timed:
        self._adam_now[0] += time.perf_counter() - t0
        self._adam_now[1] += 1
      if live and after is not None:
        after(*args, **kwargs)
      return out

    setattr(obj, name, wrapper)

  def _wrap_phases(self) -> None:
    """engine.backward / engine.step set the phase fetches are filed under ('forward' otherwise)."""
    for name in ("backward", "step"):
      orig = getattr(self.engine, name)

      def wrapper(*args, _orig=orig, _name=name, **kwargs):
        before, self._phase = self._phase, _name
        try:
          return _orig(*args, **kwargs)
        finally:
          self._phase = before if _name == "backward" else "forward"

      setattr(self.engine, name, wrapper)

  def _item(self, key: str, tensor: str, direction: str, source: str, one_pass: Callable[[], int]) -> str:
    if key not in self.items:
      self.items[key] = _Item(tensor, direction, source, one_pass)
    return key

  def _host(self, t: torch.Tensor, role: bool) -> bool:
    """Whether `t` is host memory: its device on an accelerator, the config's role on the CPU one (module doc)."""
    return role if self.on_cpu else t.device.type == "cpu"

  # ------------------------------------------------------------------ ZeRO-1/2

  def _install_zero12(self) -> None:
    """The ZeRO-1/2 offload copies (module doc), on `engine.optimizer` (DeepSpeedZeroOptimizer)."""
    opt = self.opt
    fp32 = opt.single_partition_of_fp32_groups[0]
    accum = self._item("z12.accum.d2h", f"gradient accumulation buffers ({_dtype(opt.bit16_groups[0][0])}, "
                       "whole params)", "d2h", "engine.optimizer.accumulated_grads_in_cpu "
                       "(async_accumulate_grad_in_cpu_via_gpu)", self._accum_bytes)
    back = self._item("z12.accum.h2d", self.items[accum].tensor, "h2d", "engine.optimizer.accumulated_grads_in_cpu "
                      "(async_accumulate_grad_in_cpu_via_gpu, micro_step_id > 0; _restore_cpu_offload_grad_to_gpu)",
                      self._accum_bytes)
    grads = self._item("z12.grad.d2h", f"gradients ({_dtype(fp32)} partition)", "d2h",
                       "engine.optimizer.single_partition_of_fp32_groups[i].grad, grad_position slices "
                       "(async_inplace_copy_grad_to_fp32_buffer_from_gpu; copy_grads_in_partition)",
                       lambda: sum(pos[3] * opt.single_partition_of_fp32_groups[pos[0]].element_size()
                                   for pos in opt.grad_position.values()))
    params = self._item("z12.params.h2d", "updated params "
                                          f"({_dtype(opt.param_buffer_of_bit16_for_cpu_offload_groups[0])}"
                        " partition)", "h2d", "engine.optimizer.param_buffer_of_bit16_for_cpu_offload_groups[i] -> "
                        "parallel_partitioned_bit16_groups[i][rank] (step)",
                        lambda: sum(_nbytes(b) for b in opt.param_buffer_of_bit16_for_cpu_offload_groups))

    def accumulated(param, *_a, **_k):
      buf = opt.accumulated_grads_in_cpu[opt.get_param_id(param)]
      self._add(accum, _nbytes(buf))
      if opt.micro_step_id > 0:  # accumulate_gradients: the host buffer back to the device first
        self._add(back, _nbytes(buf))

    def to_fp32(param, *_a, **_k):
      i, _, _, n = opt.grad_position[opt.get_param_id(param)]
      self._add(grads, n * opt.single_partition_of_fp32_groups[i].element_size())

    def compact(param, group_idx=None, *_a, **_k):
      group_idx = opt._get_param_group_idx(param) if group_idx is None else group_idx
      if opt._use_compact_grad_partition_buffer(group_idx) and opt.is_gradient_accumulation_boundary():
        to_fp32(param)

    def restored(param, *_a, **_k):
      self._add(back, _nbytes(opt.accumulated_grads_in_cpu[opt.get_param_id(param)]))

    def stepped(*_a, **_k):
      if not opt.overflow:
        self._add(params, self.items[params].one_pass())

    self._wrap(opt, "async_accumulate_grad_in_cpu_via_gpu", after=accumulated)
    self._wrap(opt, "async_inplace_copy_grad_to_fp32_buffer_from_gpu", before=to_fp32)
    if hasattr(opt, "_use_compact_grad_partition_buffer"):
      self._wrap(opt, "copy_grads_in_partition", before=compact)
    self._wrap(opt, "_restore_cpu_offload_grad_to_gpu", before=restored)
    self._wrap(opt, "step", after=stepped)

  def _accum_bytes(self) -> int:
    """Bytes of the host accumulation buffers: the live ones, else what `buffer_to_accumulate_to_in_cpu` allocates
    (each param in this rank's partition, whole, in its dtype)."""
    opt = self.opt
    if opt.accumulated_grads_in_cpu:
      return sum(_nbytes(b) for b in opt.accumulated_grads_in_cpu.values())
    return sum(_nbytes(p) for group in opt.params_in_partition for p in group)

  # ------------------------------------------------------------------ ZeRO-3

  def _install_zero3(self) -> None:
    """The ZeRO-3 copies (module doc), on `engine.optimizer` (DeepSpeedZeroOptimizer_Stage3) and the params."""
    opt = self.opt
    if self.offload_optimizer == "cpu":
      self._install_zero3_grads()
    fp16 = [t for t in opt.fp16_partitioned_groups_flat if t is not None]
    if fp16:
      label = f"updated params ({_dtype(fp16[0])}, fp16_partitioned_groups_flat)"
      source = "engine.optimizer.fp32_partitioned_groups_flat[i] -> fp16_partitioned_groups_flat[i] " \
               "(_reassign_or_swap_out_partitioned_parameters)"
      one_pass = lambda: sum(_nbytes(t) for t in opt.fp16_partitioned_groups_flat if t is not None)
      keys = {d: self._item(f"z3.params.{d}", label, d, source, one_pass) for d in ("h2d", "d2h")}

      def reassigned(sub_group_id, *_a, **_k):
        dst = opt.fp16_partitioned_groups_flat[sub_group_id]
        if dst is None:  # NVMe: swapped out, not counted
          return
        src_host = self._host(opt.fp32_partitioned_groups_flat[sub_group_id], self.offload_optimizer == "cpu")
        dst_host = self._host(dst, self.offload_param == "cpu")
        if src_host != dst_host:
          self._add(keys["h2d" if src_host else "d2h"], _nbytes(dst))

      self._wrap(opt, "_reassign_or_swap_out_partitioned_parameters", before=reassigned)
    if self.offload_param == "cpu":
      self._install_fetches()

  def _install_zero3_grads(self) -> None:
    """partition_grads and _offload_grad_partition_at_boundary under offload_optimizer (module doc)."""
    opt = self.opt
    flat = opt.grad_partitions_flat_buffer
    label = f"gradient partitions ({_dtype(flat)}, grad_partitions_flat_buffer)"
    source = "engine.optimizer.grad_partitions_flat_buffer (partition_grads)"
    part = {d: self._item(f"z3.gradpart.{d}", label, d, source, lambda: _nbytes(opt.grad_partitions_flat_buffer))
            for d in ("d2h", "h2d")}
    fp32 = self._item("z3.grad32.d2h", f"gradients ({_dtype(opt.fp32_partitioned_groups_flat[0])} partition)", "d2h",
                      "engine.optimizer.fp32_partitioned_groups_flat[i].grad (_offload_grad_partition_at_boundary)",
                      lambda: sum(_nbytes(t) for t in opt.fp32_partitioned_groups_flat))

    def partitioned(params_to_release, grad_partitions, *_a, **_k):
      on_acc = self.accelerator.on_accelerator(opt.grad_partitions_flat_buffer)
      es = opt.grad_partitions_flat_buffer.element_size()
      for p, g in zip(params_to_release, grad_partitions):
        if p.partition_numel() * opt._get_param_partition_rank(p) >= p.ds_numel:
          continue  # an empty partition: nothing copied
        b = int(g.numel()) * es
        if opt.micro_step_id == 0:
          self._add(part["d2h"], b)  # grad_buffer.copy_(grad_partition)
          if not on_acc:
            self._add(part["h2d"], b)  # grad_buffer.to(device)
        elif not on_acc:
          self._add(part["h2d"], b)  # grad_buffer.to(device), add there ...
          self._add(part["d2h"], b)  # ... and grad_buffer.copy_ back

    def at_boundary(param, grad_buffer, *_a, **_k):
      i = opt.grad_position[opt.get_param_id(param)][0]
      if not opt._swappable_optimizer_subgroup(i):
        self._add(fp32, int(grad_buffer.numel()) * opt.fp32_partitioned_groups_flat[i].element_size())

    self._wrap(opt, "partition_grads", before=partitioned)
    self._wrap(opt, "_offload_grad_partition_at_boundary", before=at_boundary)

  def _install_fetches(self) -> None:
    """Counts each param fetched from its host partition (`ds_tensor`), filed by layer and phase."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    ranges = [(t.data_ptr(), t.data_ptr() + _nbytes(t)) for t in getattr(self.opt, "param_groups_fp16_flat_cpu_memory",
                                                                         [])]

    def host(p) -> bool:
      ptr = p.ds_tensor.data_ptr()
      return any(lo <= ptr < hi for lo, hi in ranges) if self.on_cpu else p.ds_tensor.device.type == "cpu"

    layers: dict[str, list] = defaultdict(list)
    for p in self.engine.module.parameters():
      layers[_layer(self._names.get(id(p), "?"))].append(p)

    def fetched(params) -> None:
      for p in params:
        if p.ds_status == ZeroParamStatus.NOT_AVAILABLE and host(p):
          layer = _layer(self._names.get(id(p), "?"))
          members = layers[layer]
          key = self._item(f"z3.fetch.{layer}.{self._phase}", f"params {layer} ({_dtype(p.ds_tensor)} host partitions, "
                           f"{self._phase} fetch)", "h2d", "param.ds_tensor of each fetched param "
                           "(param.all_gather_coalesced / param.all_gather)",
                           lambda ms=members: sum(_nbytes(m.ds_tensor) for m in ms if host(m)))
          self._add(key, _nbytes(p.ds_tensor))

    for p in self.engine.module.parameters():
      self._wrap(p, "all_gather_coalesced", before=lambda params, *_a, **_k: fetched(list(params)))
      self._wrap(p, "all_gather", before=lambda param_list=None, *_a, _p=p, **_k: fetched(
          [_p] if param_list is None else list(param_list)))

  # ------------------------------------------------------------------ the summary block

  def summary(self) -> dict[str, Any]:
    """The `transfers` block of summary.json (SCHEMA.md), JSON-ready.

    Returns:
      source, offload_optimizer / offload_param ('cpu' / 'nvme' / 'none'), zero_stage; bytes_per_step {'h2d', 'd2h'}:
      bytes this rank moved in the last measured optimizer step (0 and 0 before any step); items: per transfer kind
      `tensor`, `direction`, `bytes` (one full pass over the DeepSpeed buffer named in `from`) and `times_per_step`
      (the step's counted bytes / `bytes`: 2 when the buffer went over twice, a fraction when only part of it did);
      cpu_adam_s: {n, min, median, max} wall seconds of DeepSpeedCPUAdam.step per optimizer step (the sum of the
      calls DeepSpeed makes in it), or None when the optimizer is not DeepSpeedCPUAdam or no step ran; notes.
    """
    last = self.steps[-1] if self.steps else Counter()
    items, totals = [], {"h2d": 0, "d2h": 0}
    for key, item in self.items.items():
      if not last[key]:
        continue
      one = int(item.one_pass())
      times = last[key] / one if one else 0.0
      items.append({"tensor": item.tensor, "direction": item.direction, "bytes": one,
                    "times_per_step": int(times) if float(times).is_integer() else round(times, 3),
                    "from": item.source})
      totals[item.direction] += int(last[key])
    return {"source": SOURCE, "offload_optimizer": self.offload_optimizer, "offload_param": self.offload_param,
            "zero_stage": self.stage, "bytes_per_step": totals, "items": items, "cpu_adam_s": self._adam_summary(),
            "notes": self._notes(items)}

  def _adam_summary(self) -> dict[str, Any] | None:
    if not self.adam_s:
      return None
    return {"n": len(self.adam_s), "min": min(self.adam_s), "median": float(statistics.median(self.adam_s)),
            "max": max(self.adam_s)}

  def _per_step(self, direction: str) -> list[int]:
    return [sum(n for k, n in s.items() if self.items[k].direction == direction) for s in self.steps]

  def _notes(self, items: list[dict[str, Any]]) -> list[str]:
    """What the numbers are and are not (module doc), in words, for this engine."""
    gas = int(self.engine.gradient_accumulation_steps())
    notes = [f"per rank, per optimizer step ({gas} micro step(s) each): the bytes of DeepSpeed's own copy calls "
             f"counted inside the step (last of {len(self.steps)} measured steps); each item's bytes are one full "
             "pass over the buffer named in 'from', read from that live buffer; no count is derived from the config"]
    if self.offload_optimizer == "none" and self.offload_param == "none":
      notes.append(f"nothing is offloaded (zero_stage {self.stage}, offload_optimizer none, offload_param none): no "
                   "tensor of the training state crosses host<->device in a step")
    if "nvme" in (self.offload_optimizer, self.offload_param):
      notes.append("NVMe offload: the swaps to and from NVMe are not counted")
    if len(self.steps) > 1 and len({tuple(s.items()) for s in self.steps}) > 1:
      notes.append(f"the counted bytes varied between steps (h2d per step {sorted(set(self._per_step('h2d')))}, d2h "
                   f"{sorted(set(self._per_step('d2h')))}); items and bytes_per_step are the last step's")
    if self.on_cpu and items:
      notes.append("DS_ACCELERATOR=cpu: 'device' and 'host' are the same memory; a tensor is 'host' by the role the "
                   "config gives it, the counted copies are host-to-host, and a .to('cpu') of a host tensor (the "
                   "ZeRO-3 fetch, the gradient partition's return) is that tensor, no copy")
    if self.stage == 3 and self.offload_optimizer == "cpu" and self.accelerator.on_accelerator(
        self.opt.grad_partitions_flat_buffer) and gas > 1:
      notes.append("grad_partitions_flat_buffer is on the accelerator DeepSpeed runs on (the CPU one), so "
                   "partition_grads adds micro steps after the first in place; on a CUDA device it would move the "
                   "partitions h2d every micro step and d2h again after the first")
    if self.stage == 3 and self.offload_optimizer == "cpu" and self.offload_param == "cpu":
      notes.append("the updated params go host-to-host (fp32_partitioned_groups_flat -> fp16_partitioned_groups_flat, "
                   "both offloaded), so no update item: they reach the device with the fetches")
    if self.offload_param == "cpu":
      params = list(self.engine.module.parameters())
      persist = sum(bool(getattr(p, "ds_persist", False)) for p in params)
      notes.append(f"{persist} of {len(params)} param tensors are persistent (stage3_param_persistence_threshold): "
                   "DeepSpeed fetches them once per step, after the update (phase 'step'), not per layer")
    notes.append("not counted: the batch's token ids (to the device each micro step), scalars (norms, overflow "
                 "flags)")
    notes.append(self._adam_note())
    return notes

  def _adam_note(self) -> str:
    if not self.cpu_adam:
      return (f"cpu_adam_s is null: the optimizer is {type(self.basic).__name__}, not DeepSpeedCPUAdam "
              f"(offload_optimizer {self.offload_optimizer})")
    if not self.adam_s:
      return "cpu_adam_s is null: no optimizer step has run"
    calls = sorted(set(self.adam_calls))
    n = str(calls[0]) if len(calls) == 1 else f"{calls[0]} to {calls[-1]}"
    return (f"cpu_adam_s: wall seconds (time.perf_counter) of DeepSpeedCPUAdam.step alone, summed over the {n} "
            f"call{'' if calls == [1] else 's'} DeepSpeed makes per optimizer step (one per param group or ZeRO-3 "
            "sub-group)")


def _layer(name: str) -> str:
  """The layer a param name belongs to: up to its first numeric component ('h.0.attn.qkv.weight' -> 'h.0'), else its
  first component ('wte.weight' -> 'wte')."""
  parts = name.split(".")
  for j, part in enumerate(parts):
    if part.isdigit():
      return ".".join(parts[:j + 1])
  return parts[0]
