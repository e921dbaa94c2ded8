"""Memory model of the FSDP2 side ('fsdp', torch_impl/fsdp.py), per rank, by category and memory kind (numpy-free,
no jax, no torch).

The side runs `fully_shard` on every block (`h.i`) and then on the root, whose own params are the rest (embeddings,
final norm, an untied head): 1 + n_layers FSDP units. Sources, torch 2.13 `torch/distributed/fsdp/_fully_shard`:

  * shards (`FSDPParam._init_sharded_param`): each param is chunked on dim 0 over the world (`_chunk_with_empty`,
    torch.chunk: ceil(dim0 / world) rows per chunk); every rank's shard storage is padded to chunk 0's size
    (`padded_sharded_param = param_data.new_zeros(chunks[0].size())`), so a rank holds
    S = sum over params of ceil(dim0 / world) x prod(other dims) elements. The shards are the fp32 master weights
    (MixedPrecisionPolicy casts only the all-gathered copy): params = 4·S, no separate master_params;
  * gradients (`foreach_reduce`, _fsdp_collectives.py): the reduce-scatter output has sum(padded unsharded numel) /
    world elements in reduce_dtype (parity: float32, `torch_impl.fsdp.policies`), and each sharded gradient is an
    `as_strided` view of it: gradients = 4·S (rank 0; under offload each view is copied to the host, rank 0's shards
    being whole chunks, the same 4·S);
  * optimizer state (torch.optim, `zeros_like` of the sharded DTensor: the unpadded shard, whole chunks on rank 0):
    AdamW / Adam / Lamb keep exp_avg and exp_avg_sq (8·S), SGD a momentum_buffer when momentum != 0 (4·S), else
    nothing; the scalar `step` tensors are not counted (torch_impl.memory counts tensors of dim > 0);
  * CPUOffloadPolicy (`FSDPParam.offload_to_cpu`): the sharded params, their gradients and therefore the optimizer
    state live in host memory ('host' rows; pinned where CUDA exists);
  * all-gather (`FSDPParam.init_all_gather_outputs` / `init_unsharded_param`): a unit's params are gathered into
    world x its padded shard elements in MixedPrecisionPolicy.param_dtype (the compute dtype: 4 bytes fp32, 2 under
    bf16/fp16). fully_shard given reshard_after_forward=True explicitly (torch_impl.fsdp.policies) is not the
    'auto' root case (`FSDPState._lazy_init` keeps only an auto root gathered), so every unit reshards after its
    forward; in the backward the root is gathered first (the head / tied embedding) and stays gathered until the
    final callback, while one block computes and the next is prefetched (`pre_backward(default_prefetch)`): the
    in-step peak is the root plus min(2, n_layers) blocks. reshard_after_forward=False keeps every unit gathered
    from its forward to its backward: root plus n_layers blocks;
  * backward transients (`foreach_reduce`): the unit being reduced holds its unsharded gradients in the compute dtype
    and a float32 reduce-scatter input of its padded unsharded size; with train.grad_accum_steps > 1 the micro
    batches before the last skip the reduce-scatter and accumulate every unit's unsharded gradient in the reduce
    dtype (`FSDPParam.to_accumulated_grad_if_needed`): 4 x the padded whole model;
  * activations and the batch: as the plain-torch side's (`parity.sizing.memory._activation_rows`: no remat, or
    'full' under fsdp.activation_checkpointing), of this rank's micro_batch_size / world sequences; under
    fsdp.activation_offload (`torch.autograd.graph. save_on_cpu`) the saved activations are host rows (the float32
    logits gradient stays an in-step device row).
Not modelled: the device copy of an offloaded shard made for its all-gather input (one unit's 4·shard at a time),
the caching allocator's rounding. torch_impl.memory measures the resident rows (params, gradients, moments).
"""
from __future__ import annotations

import math

from parity.spec import ModelSpec, RunSpec, TrainSpec
from parity.weights import param_shapes

__all__ = ["shard_numel", "unit_shapes", "optimizer_state_tensors", "fsdp_state_rows"]

FP32 = 4


def shard_numel(shape: tuple[int, ...], world: int) -> int:
  """Elements of one rank's padded dim-0 shard of a param of `shape`: ceil(dim0 / world) x prod(other dims)
  (FSDPParam's padded_sharded_param_size, chunk 0 of torch.chunk)."""
  if not shape:
    return 1
  return math.ceil(shape[0] / world) * math.prod(shape[1:])


def unit_shapes(model: ModelSpec) -> dict[str, list[tuple[int, ...]]]:
  """The FSDP units of the side's model and their params' shapes: 'root' (every param outside the blocks) and
  'h.0' .. 'h.{L-1}' (fully_shard on each block, then on the root)."""
  units: dict[str, list[tuple[int, ...]]] = {"root": []}
  for name, shape in param_shapes(model).items():
    parts = name.split(".")
    key = f"h.{parts[1]}" if parts[0] == "h" and len(parts) > 2 else "root"
    units.setdefault(key, []).append(tuple(shape))
  return units


def optimizer_state_tensors(train: TrainSpec) -> int:
  """Param-sized optimizer state tensors per param: adam / adamw / lamb 2 (exp_avg, exp_avg_sq), sgd 1 with momentum
  (momentum_buffer), 0 without (torch_impl.baseline.build_optimizer)."""
  if train.optimizer == "sgd":
    return 1 if train.momentum else 0
  return 2


def fsdp_state_rows(run: RunSpec, world: int = 1) -> list[tuple[str, str, int, str]]:
  """(category, kind, bytes, note) of rank 0 of `world` ranks: resident params, gradients and optimizer state
  (module docstring), in-step gathered params and backward gradient buffers on the device. The activations and the
  batch are parity.sizing.memory.fsdp_rows' (which makes these Rows): this module imports nothing of parity.sizing.
  Raises:
    ValueError: world < 1.
  """
  if world < 1:
    raise ValueError(f"world must be >= 1; got {world}")
  m, t, p = run.model, run.train, run.fsdp
  e = FP32 if t.precision == "fp32" else 2
  kind = "host" if p.offload else "device"
  units = unit_shapes(m)
  shard = {u: sum(shard_numel(s, world) for s in shapes) for u, shapes in units.items()}
  gathered = {u: world * n for u, n in shard.items()}  # padded unsharded numel of each unit
  s_all = sum(shard.values())
  blocks = [u for u in units if u != "root"]
  block = max((gathered[u] for u in blocks), default=0)
  biggest = max(gathered.values())
  k = optimizer_state_tensors(t)
  rows = [("params", kind, FP32 * s_all, "fp32 sharded masters (dim-0 padded shards)"),
          ("gradients", kind, FP32 * s_all, "fp32 sharded (reduce-scatter output)")]
  if k:
    rows.append(("optimizer_moments", kind, k * FP32 * s_all, ""))
  n_gathered = min(2, len(blocks)) if p.reshard_after_forward else len(blocks)
  what = f"root + {n_gathered} block{'s' * (n_gathered != 1)}"
  rows.append(("params", "device", e * (gathered["root"] + n_gathered * block),
               f"in-step (forward/backward: all-gathered units, {what}, compute dtype)"))
  rows.append(("gradients", "device", e * biggest + FP32 * biggest + (FP32 * biggest // world if p.offload else 0),
               "in-step (forward/backward: largest unit's unsharded gradients, compute dtype, and its fp32 "
               "reduce-scatter buffers)"))
  if t.grad_accum_steps > 1:
    rows.append(("gradients", "device", FP32 * sum(gathered.values()),
                 "in-step (forward/backward: unsharded fp32 gradients accumulated between micro batches)"))
  return rows
