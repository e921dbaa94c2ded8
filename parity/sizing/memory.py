"""Memory model of training state and activations, per side and memory kind (numpy only; no jax, no torch).

Two models live here:
  * DeepSpeed's own estimators, reproduced exactly (`ds_zero2_model_states`, `ds_zero3_model_states`, and
    `ds_estimate_table`, the text the `*_all_cold` / `*_all_live` functions print), in parity.sizing.ds_estimator
    and importable from here. Same inputs, same integer results: tests/test_memory.py imports deepspeed and compares.
  * A per-category model (`estimate`): bytes of params, gradients, fp32 master, Adam moments and activations,
    per rank, split into 'device' and 'host', for the DeepSpeed side and the JAX side of a RunSpec (the FSDP2
    side's in parity.sizing.fsdp_memory, the plain-torch side's here). It
    differs from DeepSpeed's estimator on purpose; docs/plans.md lists where and why.

Activation bytes (`block_activation_bytes`, `logits_bytes`, `activation_bytes`) live in parity.sizing.activations
and are importable from here.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

from parity.sizing.activations import FP32, activation_bytes, block_activation_bytes, logits_bytes
from parity.sizing.batches import is_batch_row, step_input_rows
from parity.sizing.ds_estimator import ds_estimate_table, ds_zero2_model_states, ds_zero3_model_states
from parity.sizing.fsdp_memory import fsdp_state_rows
from parity.sizing.memory_jax import opt_split
from parity.sides import all_sides, find_side, load_ref, side_record
from parity.spec import ModelSpec, RunSpec, TrainSpec
from parity.weights import param_shapes

__all__ = ["CATEGORIES", "KINDS", "Row", "param_count", "largest_layer_params", "largest_param", "block_params",
           "block_matrix_params", "ds_zero2_model_states", "ds_zero3_model_states", "ds_estimate_table",
           "block_activation_bytes", "logits_bytes", "activation_bytes", "estimate", "totals", "peak_device_bytes",
           "peak_host_bytes", "model_preset_train", "estimate_json", "estimate_sides", "estimator_relation",
           "step_rows", "DS_BUFFER_FACTOR", "deepspeed_rows", "jax_rows", "torch_rows", "fsdp_rows", "fsdp_state_bytes",
           "fsdp_peak_bytes"]

CATEGORIES = ("params", "gradients", "master_params", "optimizer_moments", "buffers", "activations")
"""Categories of the per-category model; torch_impl.memory measures all but activations."""
KINDS = ("device", "host")
"""Memory kinds: the accelerator's memory, and host RAM used for offload ('pinned_host' on the JAX side)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
  """Bytes of one category in one memory kind on one side, per rank (per device)."""

  side: str
  category: str
  kind: str
  bytes: int
  note: str = ""


# ----------------------------------------------------------------------------- parameter counts

def _one_layer(model: ModelSpec) -> dict[str, tuple[int, ...]]:
  """param_shapes of `model` cut to one block: every block has the same tensors (parity.weights.param_shapes), so
  the counts below are exact from it and cost the same for 2 layers or 10^9 (the full table took minutes)."""
  return param_shapes(dataclasses.replace(model, n_layers=1))


def param_count(model: ModelSpec) -> int:
  """Number of trainable parameters (tied head once), as DeepSpeed's `model_to_params` counts them (equal to
  parity.weights.n_params, in closed form)."""
  return sum(math.prod(s) for s in _one_layer(model).values()) + (model.n_layers - 1) * block_params(model)


def largest_layer_params(model: ModelSpec) -> int:
  """Largest number of params owned directly by one torch module (DeepSpeed stage3 `model_to_params`).

  Canonical names are torch module paths (`h.0.attn.qkv.weight`), so a module's own params are the
  names sharing the prefix before the last dot (e.g. a Linear's weight + bias; the embedding table).
  """
  per_module: dict[str, int] = {}
  for name, shape in _one_layer(model).items():  # block 0's modules stand for every block's
    prefix = name.rsplit(".", 1)[0]
    per_module[prefix] = per_module.get(prefix, 0) + math.prod(shape)
  return max(per_module.values())


def largest_param(model: ModelSpec) -> int:
  """Elements of the largest single parameter tensor (DeepSpeed stage 1/2 `largest_param_numel`, which sizes its
  offload gradient staging buffers)."""
  return max(math.prod(s) for s in _one_layer(model).values())


def block_params(model: ModelSpec) -> int:
  """Params of one transformer block (all blocks are the same size)."""
  return sum(math.prod(s) for n, s in _one_layer(model).items() if n.startswith("h.0."))


def block_matrix_params(model: ModelSpec) -> int:
  """Params of one block's weight matrices (its 2-D tensors: no biases or norm scales)."""
  return sum(math.prod(s) for n, s in _one_layer(model).items() if n.startswith("h.0.") and len(s) >= 2)


# ----------------------------------------------------------------------------- per-category model

def _kind(offloaded: bool) -> str:
  return "host" if offloaded else "device"


def _deepspeed_rows(run: RunSpec, ranks: int) -> list[Row]:
  """DeepSpeed side, per rank. Compute params and grads in the module dtype (e = 2 under bf16, else 4);
  ZeRO >= 1 keeps a separate fp32 master partition with its fp32 gradient (stage 0 only under bf16);
  stage s >= 2 partitions the compute gradient, s = 3 also the compute params, whose device working set is
  then the largest gathered module (DeepSpeed's 4·largest_layer_params). Offloaded master, fp32 gradient
  and moments live on the host (CPU Adam updates them there); at stages 1-2 the device then holds only the
  gradients of the module being reduced, and the host, in the compute dtype, a partition-sized staging buffer for
  the updated params, one param's gradient staging buffer and, with gradient accumulation, a partition-sized
  accumulation buffer (DeepSpeed 0.19.8 stage_1_and_2.py: param_buffer_of_bit16_for_cpu_offload_groups,
  temp_grad_buffer_for_cpu_offload, accumulated_grads_in_cpu; measured by torch_impl.memory on gpt2-tiny in fp32 and
  bf16, tests/test_memory.py; docs/plans.md)."""
  m, t, p = run.model, run.train, run.deepspeed
  n, e = param_count(m), FP32 if t.precision == "fp32" else 2
  off_opt, off_par = p.offload_optimizer == "cpu", p.offload_param == "cpu"
  opt_shard = ranks if p.zero_stage >= 1 else 1
  rows = []
  if p.zero_stage == 3:
    rows.append(Row("deepspeed", "params", _kind(off_par), e * math.ceil(n / ranks), "partition"))
    rows.append(Row("deepspeed", "params", "device", e * largest_layer_params(m), "in-step (gathered module)"))
  else:
    rows.append(Row("deepspeed", "params", "device", e * n))
  grad_shard = ranks if p.zero_stage >= 2 else 1
  if p.zero_stage in (1, 2) and off_opt:  # each module's grads are copied to the host as they are reduced
    rows.append(Row("deepspeed", "gradients", "device", e * largest_layer_params(m), "compute dtype, in flight"))
    rows.append(Row("deepspeed", "gradients", "host", e * largest_param(m),
                    "compute dtype, one param's host staging"))
    rows.append(Row("deepspeed", "buffers", "host", e * math.ceil(n / opt_shard),
                    "compute dtype, host staging of the updated params"))
    if t.grad_accum_steps > 1:
      rows.append(Row("deepspeed", "gradients", "host", e * math.ceil(n / opt_shard),
                      "compute dtype, accumulation"))
  else:
    rows.append(Row("deepspeed", "gradients", "device", e * math.ceil(n / grad_shard), "compute dtype"))
  master = p.zero_stage >= 1 or t.precision != "fp32"
  if master:
    rows.append(Row("deepspeed", "master_params", _kind(off_opt), FP32 * math.ceil(n / opt_shard)))
    if off_opt or e != FP32:
      rows.append(Row("deepspeed", "gradients", _kind(off_opt), FP32 * math.ceil(n / opt_shard), "fp32 partition"))
  rows.append(Row("deepspeed", "optimizer_moments", _kind(off_opt), 2 * FP32 * math.ceil(n / opt_shard)))
  # cpu_checkpointing: each block's checkpointed input (e·sbh, the 'full' policy's) kept in host memory
  return rows + _activation_rows("deepspeed", run, "full" if p.activation_checkpointing else "none", ranks=1,
                                 host_checkpoints=p.cpu_checkpointing)


def _jax_rows(run: RunSpec) -> list[Row]:
  """JAX side, per device of the data axis (D = jax.data_parallel). Params are the fp32 masters, sharded
  over D at zero_stage 3; gradients fp32, sharded at >= 2; Adam moments sharded at >= 1. Offloaded state is
  in host memory between steps. Rows noted 'in-step' are what exists only during the step, by phase
  (`peak_device_bytes`):

  * forward/backward: offloaded params brought to the device (all of them; with scan_layers the non-layer
    params and 2 layers: the slice in use and the one XLA prefetches); under bf16/fp16 the compute-dtype
    copy the step casts (the whole tree, or per layer with scan_layers and offloaded params); with scan_layers
    and offloaded params under remat 'none', every layer's weight matrices in the compute dtype, which the
    backward pass reads (saved, not fetched again). The layer gradient is born on the device
    (`jax_impl.offload.anchored_loss`), not in host memory;
  * update: offloaded params and moments brought in (all; or, streamed by `jax_impl.stream` with
    scan_layers, the non-layer state and 2 layers), and the streamed update's new layer stacks, which are
    scan outputs beside the donated old ones, in each group's own memory kind; none when the params are
    offloaded too, where the update writes each layer back into the carried stacks
    (`jax_impl.stream.updates_in_place`).

  The moments are split as `_jax_moment_rows` says (jax.offload_opt_ratio < 1: part on the host, part on the device).
  """
  m, t, p = run.model, run.train, run.jax
  n, d = param_count(m), p.data_parallel
  shard = {name: (d if p.zero_stage >= stage else 1) for name, stage in
           (("params", 3), ("gradients", 2), ("optimizer_moments", 1))}
  par = FP32 * math.ceil(n / shard["params"])
  streamed = p.scan_layers and (p.offload_params or p.offload_opt_state)
  beside = streamed and not p.offload_params  # with the params offloaded the update writes in place (one host copy)
  resident, fetched_moments, moment_stacks = _jax_moment_rows(run, shard["optimizer_moments"], beside)
  rows = [Row("jax", "params", _kind(p.offload_params), par),
          Row("jax", "gradients", "device", FP32 * math.ceil(n / shard["gradients"])), *resident]
  layers = m.n_layers * block_params(m)
  outside = n - layers  # embeddings, final norm (and an untied head)
  window = lambda k: math.ceil(outside / shard[k]) + min(2, m.n_layers) * math.ceil(block_params(m) / shard[k])
  if p.offload_params:
    fetched = FP32 * window("params") if p.scan_layers else par
    what = "non-layer + 2 layers" if p.scan_layers else "all"
    rows.append(Row("jax", "params", "device", fetched, f"in-step (forward/backward: fetched, {what})"))
    rows.append(Row("jax", "params", "device", fetched, f"in-step (update: fetched, {what})"))
  if p.scan_layers and p.offload_params and p.remat == "none":  # jax.ad_checkpoint.print_saved_residuals lists them
    e = FP32 if t.precision == "fp32" else 2
    saved = e * math.ceil(m.n_layers * block_matrix_params(m) / shard["params"])
    rows.append(Row("jax", "params", "device", saved, "in-step (forward/backward: every layer's weight matrices in "
                    "the compute dtype, saved for the backward pass: nothing is recomputed)"))
  if t.precision != "fp32":
    e = 2
    per_layer = p.scan_layers and p.offload_params
    copy = e * window("params") if per_layer else e * math.ceil(n / shard["params"])
    rows.append(Row("jax", "params", "device", copy, f"in-step (forward/backward: {t.precision} compute copy"
                                                      f"{', per layer' if per_layer else ''})"))
  rows += fetched_moments
  if beside:
    rows.append(Row("jax", "params", _kind(p.offload_params), FP32 * math.ceil(layers / shard["params"]),
                    "in-step (update: new layer stack)"))
  return rows + moment_stacks + _activation_rows("jax", run, p.remat, ranks=d)


def _jax_moment_rows(run: RunSpec, shard: int, beside: bool) -> tuple[list[Row], list[Row], list[Row]]:
  """(resident, fetched, new stacks) rows of the JAX side's Adam moments (2 fp32 per param, over `shard` devices).
  Resident: in the host memory with offload_opt_state, else on the device; with jax.offload_opt_ratio < 1 the
  offloaded part (parity.sizing.memory_jax.opt_split: the last param leaves, its realised share) on the host and the
  rest on the device. Fetched for the update: the offloaded part, all of it or, streamed (scan_layers), its
  non-layer leaves and 2 layers of its block tensors. `beside` (a streamed update that stacks its outputs beside the
  old stacks, `_jax_rows`): the update's new layer stacks, each part's in its kind."""
  m, p = run.model, run.jax
  split = opt_split(run)
  size = lambda elements: 2 * FP32 * math.ceil(elements / shard)
  n, layers = param_count(m), m.n_layers * block_params(m)
  host, host_layers = split.host_elements, split.layer_elements
  if split.partial:
    note = f"offload_opt_ratio {p.offload_opt_ratio:g}: {split.share:.1%} of the moment bytes on the host"
    resident = [Row("jax", "optimizer_moments", "host", size(host), note),
                Row("jax", "optimizer_moments", "device", size(n) - size(host), note)]
  else:
    resident = [Row("jax", "optimizer_moments", _kind(p.offload_opt_state), size(n))]
  fetched, stacks = [], []
  part = ", the offloaded part" if split.partial else ""
  if p.offload_opt_state and p.scan_layers:
    window = 2 * FP32 * (math.ceil((host - host_layers) / shard)
                         + min(2, m.n_layers) * math.ceil(host_layers // m.n_layers / shard))
    fetched.append(Row("jax", "optimizer_moments", "device", window,
                       f"in-step (update: fetched, non-layer + 2 layers{part})"))
  elif p.offload_opt_state:
    fetched.append(Row("jax", "optimizer_moments", "device", size(host), f"in-step (update: fetched, all{part})"))
  if beside:
    stacks = [Row("jax", "optimizer_moments", k, b, "in-step (update: new layer stacks)")
              for k, b in (("host", size(host_layers)), ("device", size(layers) - size(host_layers))) if b]
  return resident, fetched, stacks


def _activation_rows(side: str, run: RunSpec, policy: str, ranks: int, host_checkpoints: bool = False) -> list[Row]:
  """The side's saved activations (`activation_bytes`; the torch sides repeat K/V to n_heads) and, in-step, the
  float32 gradient w.r.t. the logits at the start of the backward pass (`logits_bytes`). `host_checkpoints`
  (DeepSpeed's cpu_checkpointing): the blocks' checkpoints are a host row; the recompute working set, the
  embedding output and the logits stay on the device."""
  t = run.train
  elem = FP32 if t.precision == "fp32" else 2
  micro = math.ceil(t.micro_batch_size / ranks)
  dev, host = activation_bytes(run.model, micro, t.seq_len, elem, policy,
                               kv_repeated=side_record(side).framework == "torch", host_checkpoints=host_checkpoints)
  note = f"remat {policy}, checkpoints on the host" if host_checkpoints else f"remat {policy}"
  rows = [Row(side, "activations", "device", dev, note),
          Row(side, "activations", "device", logits_bytes(run.model, micro, t.seq_len, elem)[1],
              "in-step (forward/backward: float32 gradient of the logits)")]
  if host:
    rows.append(Row(side, "activations", "host", host,
                    "cpu_checkpointing: each block's checkpoint" if host_checkpoints else f"remat {policy}"))
  return rows


def estimate(run: RunSpec, *, ranks: int = 1, sides: Iterable[str] = ("deepspeed", "jax")) -> list[Row]:
  """Predicted bytes per (side, category, kind), per rank / device: each side's record's `memory_rows`
  (parity.sides): `deepspeed_rows`, `jax_rows`, `torch_rows` (plain AdamW, fp32, no sharding), `fsdp_rows` (FSDP2,
  parity.sizing.fsdp_memory, rank 0 of `ranks`).

  Args:
    run: model, train and both plans.
    ranks: data-parallel ranks of the DeepSpeed and the FSDP2 side (the JAX side uses run.jax.data_parallel).
    sides: which sides to estimate.
  Returns:
    Rows; rows noted 'in-step' exist only while the step runs: transient copies of offloaded state, and the batch
    (token ids in their stored dtype, the mask arrays and attention mask of a padded/packed run:
    parity.sizing.batches.step_input_rows).
  Raises:
    ValueError: a side without a memory model (the message names the sides with one).
  """
  rows: list[Row] = []
  for side in sides:
    record = find_side(side)
    if record is None or record.memory_rows is None:
      known = [r.name for r in all_sides() if r.memory_rows is not None]
      raise ValueError(f"unknown side {side!r}; expected {', '.join(known[:-1])} or {known[-1]}")
    rows += load_ref(record.memory_rows)(run, ranks)
  return rows


def deepspeed_rows(run: RunSpec, ranks: int = 1) -> list[Row]:
  """The DeepSpeed side's rows (`estimate`): ZeRO state, activations and one micro batch per rank."""
  return _deepspeed_rows(run, ranks) + _batch_rows("deepspeed", run, 1)


def jax_rows(run: RunSpec, ranks: int = 1) -> list[Row]:
  """The JAX side's rows per device (`estimate`; its devices are run.jax.data_parallel, not `ranks`)."""
  return _jax_rows(run) + _batch_rows("jax", run, run.jax.data_parallel)


def torch_rows(run: RunSpec, ranks: int = 1) -> list[Row]:
  """The plain-torch side's rows (`estimate`): plain AdamW, fp32, no sharding, one micro batch."""
  n = param_count(run.model)
  rows = [Row("torch", "params", "device", FP32 * n), Row("torch", "gradients", "device", FP32 * n),
          Row("torch", "optimizer_moments", "device", 2 * FP32 * n)]
  return rows + _activation_rows("torch", run, "none", ranks=1) + _batch_rows("torch", run, 1)


def _batch_rows(side: str, run: RunSpec, ranks: int) -> list[Row]:
  """The side's batch during a step as device rows (parity.sizing.batches.step_input_rows)."""
  return [Row(side, cat, "device", b, note) for cat, note, b, _ in step_input_rows(run, side, ranks)]


def estimate_sides() -> tuple[str, ...]:
  """The sides `parity estimate` prints, in its column order: every registered side whose record is `estimated`
  (deepspeed, jax, fsdp; fsdp: FSDP2 on `ranks` ranks, parity.sizing.fsdp_memory)."""
  return tuple(r.name for r in all_sides() if r.estimated)


def totals(rows: Iterable[Row], side: str) -> dict[str, dict[str, int]]:
  """category -> kind -> bytes of one side, resident state only (in-step rows left out)."""
  out = {c: {k: 0 for k in KINDS} for c in CATEGORIES}
  for r in rows:
    if r.side == side and not r.note.startswith("in-step"):
      out[r.category][r.kind] += r.bytes
  return out


def _phase(note: str) -> str:
  """'forward', 'update' or 'both' for an in-step row (by its note), 'resident' otherwise."""
  if not note.startswith("in-step"):
    return "resident"
  if note.startswith("in-step (forward"):
    return "forward"
  return "update" if note.startswith("in-step (update") else "both"


def peak_device_bytes(rows: Iterable[Row], side: str) -> int:
  """Peak device bytes of one side: resident state + max(forward/backward phase, update phase).

  The forward/backward phase holds the activations (they peak at the end of the forward pass) and the
  in-step rows noted 'forward/backward'; the update phase, after the activations are freed, holds the rows
  noted 'update'; other in-step rows (e.g. DeepSpeed's gathered module) count in both. The gradients are
  counted as resident: they exist from the first backward to the end of the update.
  """
  rows = [r for r in rows if r.side == side and r.kind == "device"]
  by = {ph: sum(r.bytes for r in rows if _phase(r.note) == ph and r.category != "activations")
        for ph in ("resident", "forward", "update", "both")}
  acts = sum(r.bytes for r in rows if r.category == "activations")
  return by["resident"] + by["both"] + max(acts + by["forward"], by["update"])


def peak_host_bytes(rows: Iterable[Row], side: str) -> int:
  """Peak host bytes of one side: resident host state + the in-step host rows (the streamed update's new
  layer stacks of host-resident groups; activations offloaded by a remat policy are resident rows)."""
  return sum(r.bytes for r in rows if r.side == side and r.kind == "host")


# ----------------------------------------------------------------------------- what `parity estimate` shows

def model_preset_train(model: ModelSpec) -> TrainSpec:
  """Training defaults for a model-size preset (parity.hf.MODEL_PRESETS;
  parity.pipeline.resolve.resolve_run(model=...)): micro batch 1, seq_len min(2048, max_seq_len), bf16 (how such models
  are trained); other fields TrainSpec's."""
  return TrainSpec(micro_batch_size=1, seq_len=min(2048, model.max_seq_len), precision="bf16")


DS_BUFFER_FACTOR = 1.5
"""DeepSpeed's default `additional_buffer_factor`: its estimators multiply every host figure by it (a safety margin)."""


def _ds_formula(run: RunSpec, ranks: int) -> dict[str, Any]:
  """DeepSpeed's own estimator for the run's DeepSpeed plan on one node of `ranks` GPUs (zero_init, buffer factor
  1.5), with what each of its terms counts. Stages 0 and 1 have no estimator of their own: the stage-2 one is used.

  Returns {'function', 'call', 'gpu_bytes', 'cpu_bytes', 'gpu_formula', 'cpu_formula'} (bytes: int)."""
  n, big, p = param_count(run.model), largest_layer_params(run.model), run.deepspeed
  off_opt, off_par, g = p.offload_optimizer == "cpu", p.offload_param == "cpu", ranks
  if p.zero_stage == 3:
    cpu, gpu, _ = ds_zero3_model_states(n, big, g, 1, off_opt, off_par)
    call = (f"estimate_zero3_model_states_mem_needs(total_params={n}, largest_layer_params={big}, num_gpus_per_node="
            f"{g}, cpu_offload={off_opt}, cpu_offload_params={off_par})")
    layer = "4·L (the largest layer gathered, fp32 size)"
    if off_opt and off_par:
      gf, cf = layer, "1.5 × 18·N (fp16 params 2 + fp32 master 4 + fp32 gradients 4 + Adam moments 8 bytes/param)"
    elif off_opt:
      gf = f"{layer} + 2·N/{g} (fp16 param partition)"
      cf = "1.5 × 16·N (fp32 master 4 + fp32 gradients 4 + Adam moments 8 bytes/param)"
    else:
      gf = f"{layer} + 18·N/{g} (fp16 params 2 + fp32 master 4 + fp32 gradients 4 + Adam moments 8, partitioned)"
      cf = f"1.5 × 4·L·{g} (a host copy of the largest layer per GPU)"
  else:
    cpu, gpu = ds_zero2_model_states(n, g, 1, off_opt)
    call = f"estimate_zero2_model_states_mem_needs(total_params={n}, num_gpus_per_node={g}, cpu_offload={off_opt})"
    if off_opt:
      gf = "2·N (fp16 params)"
      cf = ("1.5 × 16·N (fp32 master 4 + fp32 gradients 4 + Adam moments 8 bytes/param)" if 4 * g <= 16 else
            f"1.5 × 4·N·{g} (an fp32 model copy per GPU while loading)")
    else:
      gf = f"2·N + 18·N/{g} (fp16 params 2; fp16 + fp32 gradients 6, fp32 master 4, Adam moments 8, partitioned)"
      cf = f"1.5 × 4·N·{g} (an fp32 model copy per GPU while loading)"
  name = call.split("(")[0]
  return {"function": name, "call": call, "gpu_bytes": gpu, "cpu_bytes": cpu, "gpu_formula": gf, "cpu_formula": cf}


def estimator_relation(rows: Iterable[Row], ds: dict[str, Any], ranks: int) -> dict[str, Any]:
  """How this model's DeepSpeed figures relate to DeepSpeed's own estimator (`_ds_formula`): the same scope (model
  states: resident rows without activations or the batch, the in-step gathered module included on the device), per
  node (host x ranks), and the host figure set against the estimator's without its 1.5 factor.

  Returns {'device_bytes', 'host_bytes', 'estimator_host_unfactored_bytes', 'host_minus_unfactored_bytes', 'rows'}
  (bytes: int); rows: {kind, category, note, bytes} of this model, the terms of its two sums."""
  states = [r for r in rows if r.side == "deepspeed" and r.category != "activations" and not is_batch_row(r.note)]
  dev = sum(r.bytes for r in states if r.kind == "device")
  host = ranks * sum(r.bytes for r in states if r.kind == "host")
  unfactored = round(ds["cpu_bytes"] / DS_BUFFER_FACTOR)
  return {"device_bytes": dev, "host_bytes": host, "estimator_host_unfactored_bytes": unfactored,
          "host_minus_unfactored_bytes": host - unfactored,
          "rows": [{"kind": r.kind, "category": r.category, "note": r.note,
                    "bytes": r.bytes * (ranks if r.kind == "host" else 1)}
                   for r in sorted(states, key=lambda r: -r.bytes) if r.bytes]}


def estimate_json(run: RunSpec, ranks: int = 1) -> dict[str, Any]:
  """Everything `parity estimate` prints, JSON-ready: rows (`estimate_sides`), peaks, and DeepSpeed's own estimator
  figures with how this model's DeepSpeed figures relate to them (`estimator_relation`)."""
  sides = estimate_sides()
  rows = estimate(run, ranks=ranks, sides=sides)
  ds = _ds_formula(run, ranks)
  return {"total_params": param_count(run.model), "largest_layer_params": largest_layer_params(run.model),
          "ranks": ranks, "rows": [dataclasses.asdict(r) for r in rows],
          "peak_device_bytes": {s: peak_device_bytes(rows, s) for s in sides},
          "peak_host_bytes": {s: peak_host_bytes(rows, s) for s in sides},
          "deepspeed_estimator": {**ds, "additional_buffer_factor": DS_BUFFER_FACTOR,
                                  "relation": estimator_relation(rows, ds, ranks)}}


def step_rows(rows: Iterable[Row], sides: Iterable[str] = ("deepspeed", "jax")) -> list[tuple[str, list[int]]]:
  """The in-step rows of `parity estimate`'s table: (label, bytes per [side device, side host] of each of `sides`:
  deepspeed device, deepspeed host, jax device, jax host by default) for the forward/backward, update and
  whole-step phases that hold any bytes."""
  sides = tuple(sides)
  rows = list(rows)
  out = []
  for phase, label in (("forward", "in step: forward/backward"), ("update", "in step: update"),
                       ("both", "in step: whole step")):
    cells = [sum(r.bytes for r in rows if r.side == s and r.kind == k and _phase(r.note) == phase)
             for s in sides for k in KINDS]
    if any(cells):
      out.append((label, cells))
  return out


# ----------------------------------------------------------------------------- FSDP2 (parity.sizing.fsdp_memory)

def fsdp_rows(run: RunSpec, world: int = 1) -> list[Row]:
  """Rows (side 'fsdp') of rank 0 of `world` ranks: parity.sizing.fsdp_memory.fsdp_state_rows (resident state and
  in-step gathered params and gradient buffers), the activations as the plain-torch side's (`_activation_rows`, no
  remat, or 'full' under fsdp.activation_checkpointing; micro_batch_size / world sequences; under
  fsdp.activation_offload, `save_on_cpu`, the saved activations are host rows and the float32 logits gradient stays an
  in-step device row) and the batch.
  Raises:
    ValueError: world < 1.
  """
  rows = [Row("fsdp", cat, kind, b, note) for cat, kind, b, note in fsdp_state_rows(run, world)]
  acts = _activation_rows("fsdp", run, "full" if run.fsdp.activation_checkpointing else "none", ranks=world)
  if run.fsdp.activation_offload:  # what autograd saves lives in host memory until the backward needs it
    acts = [Row("fsdp", r.category, "host", r.bytes, "saved for the backward in host memory (save_on_cpu)")
            if r.category == "activations" and r.kind == "device" and not r.note.startswith("in-step") else r
            for r in acts]
  return rows + acts + _batch_rows("fsdp", run, world)


def _fsdp_run(model: ModelSpec, train: TrainSpec, plan) -> RunSpec:
  return RunSpec(model=model, train=train, fsdp=plan, sides=("fsdp",))


def fsdp_state_bytes(model: ModelSpec, train: TrainSpec, fsdp_plan, world: int = 1) -> dict[str, dict[str, int]]:
  """Resident training state of one FSDP2 rank (rank 0, the largest), category -> kind -> bytes: what
  torch_impl.fsdp.FsdpTrainer.measure counts (params, gradients, optimizer_moments; master_params and buffers 0),
  activations included as `totals` has them (resident rows only). `fsdp_plan`: a parity.spec.FsdpPlan."""
  return totals(fsdp_rows(_fsdp_run(model, train, fsdp_plan), world), "fsdp")


def fsdp_peak_bytes(model: ModelSpec, train: TrainSpec, fsdp_plan, world: int = 1) -> dict[str, int]:
  """{'device', 'host'}: peak bytes of one FSDP2 rank (`peak_device_bytes` / `peak_host_bytes` of `fsdp_rows`)."""
  rows = fsdp_rows(_fsdp_run(model, train, fsdp_plan), world)
  return {"device": peak_device_bytes(rows, "fsdp"), "host": peak_host_bytes(rows, "fsdp")}
