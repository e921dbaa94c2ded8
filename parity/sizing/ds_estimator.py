"""DeepSpeed's own ZeRO memory estimators, reproduced exactly (numpy-free, no deepspeed import).

`ds_zero2_model_states` and `ds_zero3_model_states` return what deepspeed 0.19.8's
`estimate_zero{2,3}_model_states_mem_needs` return for the same inputs, and `ds_estimate_table` the text its
`*_all_cold` / `*_all_live` functions print. tests/test_memory.py imports deepspeed and compares them integer for
integer. parity.sizing.memory's per-category model differs from these on purpose (docs/plans.md says where and why)
and quotes them beside its own figures.
"""
from __future__ import annotations

import enum
from typing import Iterable

__all__ = ["ds_zero2_model_states", "ds_zero3_model_states", "ds_estimate_table"]


def ds_zero2_model_states(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                          cpu_offload: bool = True, additional_buffer_factor: float = 1.5) -> tuple[int, int]:
  """(cpu bytes, gpu bytes) exactly as deepspeed `estimate_zero2_model_states_mem_needs` (0.19.8).

  Offload: gpu 2·N (fp16 params); cpu N·max(4·gpus, 16)·buffer. Otherwise gpu 2·N + int(18·N / gpus)
  (2 fp16 grads + 4 fp32 grads + 4 fp32 params + 8 Adam moments), cpu N·4·gpus_per_node·buffer.
  References: deepspeed/runtime/zero/stage_1_and_2.py.
  """
  total_gpus = num_nodes * num_gpus_per_node
  if cpu_offload:
    gpu_mem = 2 * total_params
    cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
  else:
    gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
    cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
  return int(cpu_mem), int(gpu_mem)


def ds_zero3_model_states(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                          num_nodes: int = 1, cpu_offload: bool = True, cpu_offload_params: bool = True,
                          zero_init: bool = True, additional_buffer_factor: float = 1.5) -> tuple[int, int, int]:
  """(cpu bytes, gpu bytes, largest layer bytes) exactly as deepspeed `estimate_zero3_model_states_mem_needs`.

  The gpu always holds 4·largest_layer_params (one gathered layer); params, grads and optimizer state
  cost 18 bytes per param (16 without the fp16 params when only the optimizer is offloaded), divided
  over nodes on the host, over all gpus on the device. References: deepspeed/runtime/zero/stage3.py.
  """
  total_gpus = num_nodes * num_gpus_per_node
  gpus_factor = 1 / num_nodes
  largest_layer_memory = 4 * largest_layer_params
  buf = additional_buffer_factor
  if cpu_offload:
    per_param = 18 if cpu_offload_params else 16
    gpu_mem = largest_layer_memory + (0 if cpu_offload_params else int(2 * total_params / total_gpus))
    if zero_init:
      cpu_mem = total_params * per_param * gpus_factor * buf
    else:
      cpu_mem = total_params * max(4 * num_gpus_per_node, per_param * gpus_factor) * buf
  else:
    gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
    cpu_mem = (largest_layer_params if zero_init else total_params) * 4 * num_gpus_per_node * buf
  return int(cpu_mem), int(gpu_mem), largest_layer_memory


def _ds_zero3_options() -> Iterable[tuple[bool, bool, bool]]:
  """(cpu_offload, cpu_offload_params, zero_init) in the order `*_all_cold` prints them."""
  for cpu_offload in (True, False):
    for cpu_offload_params in (True, False):
      if not cpu_offload and cpu_offload_params:
        continue
      for zero_init in (True, False):
        yield cpu_offload, cpu_offload_params, zero_init


class _OffloadDeviceEnum(str, enum.Enum):
  """Mirror of deepspeed.runtime.zero.offload_config.OffloadDeviceEnum, whose `f'{x:4}'` the tables print
  (its text depends on the Python version's Enum.__format__, so it is reproduced, not written out)."""
  none = "none"
  cpu = "cpu"
  nvme = "nvme"


_OffloadDeviceEnum.__name__ = _OffloadDeviceEnum.__qualname__ = "OffloadDeviceEnum"


def ds_estimate_table(stage: int, total_params: int, largest_layer_params: int = 0, num_gpus_per_node: int = 1,
                      num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> str:
  """The exact text deepspeed `estimate_zero{2,3}_model_states_mem_needs_all_cold` prints (stage 2 or 3)."""
  nodes_str = "nodes" if num_nodes > 1 else "node"
  gpus_str = "GPUs" if num_gpus_per_node > 1 else "GPU"
  cpu = f"{_OffloadDeviceEnum.cpu:4}"  # as DeepSpeed formats it: 'OffloadDeviceEnum.cpu' on Python 3.11
  head = ("Estimated memory needed for params, optim states and gradients for a:\n"
          f"HW: Setup with {num_nodes} {nodes_str}, {num_gpus_per_node} {gpus_str} per node.\n")
  lines = []
  if stage == 2:
    head += f"SW: Model with {int(total_params/1e6)}M total params."
    for off in (True, False):
      c, g = ds_zero2_model_states(total_params, num_gpus_per_node, num_nodes, off, additional_buffer_factor)
      lines.append(f" {c/2**30:7.2f}GB | {g/2**30:6.2f}GB | offload_optimizer={cpu if off else 'none'}")
  else:
    head += (f"SW: Model with {int(total_params/1e6)}M total params, "
             f"{int(largest_layer_params/1e6)}M largest layer params.")
    for off, offp, zi in _ds_zero3_options():
      c, g, _ = ds_zero3_model_states(total_params, largest_layer_params, num_gpus_per_node, num_nodes, off,
                                      offp, zi, additional_buffer_factor)
      lines.append(f" {c/2**30:7.2f}GB | {g/2**30:6.2f}GB | offload_param={cpu if offp else 'none'}, "
                   f"offload_optimizer={cpu if off else 'none'}, zero_init={1 if zi else 0}")
  return "\n".join([head, "  per CPU  |  per GPU |   Options", *lines]) + "\n"
