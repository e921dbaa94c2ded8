"""Accelerator presets and the roofline cost model of one optimizer step (no jax, no torch).

`Hardware` is one accelerator and its host link; `HARDWARE` the presets of `parity plan --hardware`.
`flops_per_token` and `recompute_flops_per_token` count the training FLOPs (PaLM's 6·N + 12·L·H·Q·s and each remat
policy's rerun), `transfer_bytes` the host <-> device bytes of a plan, counted from the memory model's rows
(parity.sizing.memory), and `step_time` puts them together: max(compute, transfer) on one device. docs/plans.md
says where the model is measured and where it is only a bound.
"""
from __future__ import annotations

import dataclasses
import math

from parity.sizing import memory
from parity.spec import ModelSpec, RunSpec, SpecError

__all__ = ["Hardware", "HARDWARE", "GB", "GiB", "attention_width", "flops_per_token", "recompute_flops_per_token",
           "matmul_params", "strict_flops_per_token", "attention_counted", "transfer_bytes", "step_time"]


# ----------------------------------------------------------------------------- hardware

@dataclasses.dataclass(frozen=True, slots=True)
class Hardware:
  """One accelerator and its link to host memory."""

  name: str
  device_bytes: int
  """Accelerator memory, bytes."""
  peak_flops: float
  """Dense bf16/fp16 peak (GPU tensor cores, TPU MXUs), FLOP/s (no sparsity)."""
  host_link_bytes_per_s: float
  """Host <-> device bandwidth per direction, bytes/s (PCIe, or NVLink-C2C on GH200)."""
  host_bytes: int
  """Host memory of a typical node, bytes (override with --host-memory)."""
  peak_flops_fp32: float = 0.0
  """fp32 peak without TF32, FLOP/s: what an fp32 run gets (JAX matmul precision 'highest', torch TF32 off)."""
  kind: str = "gpu"
  """'gpu' or 'tpu': XLA's GPU pinned-host pool (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB) applies to 'gpu' only."""
  hidden_transfer: float = 1.0
  """Share of the host<->device copy time that overlaps compute (1: a step takes max(compute, transfer); 0: compute
  + transfer). GPU presets keep the planner's assumption of full overlap (not measured here); the TPU v5e measured
  none for parity's JAX offload layouts (benchmarks/results/2026-12-06-tpu-v5e-offload.md: 0-5% hidden), nor for a
  copy loop and a matmul loop with nothing between them in one program (benchmarks/results/
  2026-12-06-tpu-v5e-kernels.md: 0-2%, with or without the XLA:TPU host-offload flags)."""
  unmeasured: tuple[str, ...] = ()
  """The fields of this preset carried unmeasured from another chip's measurement (`borrowed_from`): v5p and v6e
  carry the v5e's host link and hidden_transfer. `custom_hardware` drops a field the user gives."""
  borrowed_from: str = ""
  """The chip whose measured figures `unmeasured` names ('v5e'); '' when none are borrowed."""

  def peak(self, precision: str) -> float:
    """FLOP/s for a run at this precision (fp32: peak_flops_fp32 when known, else the bf16 peak)."""
    return self.peak_flops_fp32 if precision == "fp32" and self.peak_flops_fp32 > 0 else self.peak_flops

  def unmeasured_label(self, field: str) -> str:
    """'unmeasured (v5e's)' when `field` is carried from another chip (`unmeasured`), else ''."""
    return f"unmeasured ({self.borrowed_from}'s)" if field in self.unmeasured else ""


GB, GiB = 10**9, 2**30
_V5E_TRANSFER = ("host_link_bytes_per_s", "hidden_transfer")
"""The host-transfer figures measured on the v5e only, which the v5p and v6e presets carry unmeasured."""
HARDWARE: dict[str, Hardware] = {
    # NVIDIA data sheets: A100 (PCIe gen4 x16: 32 GB/s per direction), H100 SXM / H200 (PCIe gen5 x16:
    # 64 GB/s), GH200 (NVLink-C2C 900 GB/s total = 450 GB/s per direction, 480 GB LPDDR5X).
    # fp32 (no TF32): A100 19.5 TFLOP/s, H100/H200/GH200 SXM 67 TFLOP/s.
    "A100-40": Hardware("A100-40", 40 * GiB, 312e12, 32 * GB, 512 * GiB, 19.5e12),
    "A100-80": Hardware("A100-80", 80 * GiB, 312e12, 32 * GB, 512 * GiB, 19.5e12),
    "H100": Hardware("H100", 80 * GiB, 989e12, 64 * GB, 512 * GiB, 67e12),
    "H200": Hardware("H200", 141 * GB, 989e12, 64 * GB, 1024 * GiB, 67e12),
    "GH200": Hardware("GH200", 96 * GiB, 989e12, 450 * GB, 480 * GB, 67e12),
    # Google Cloud TPU pages (docs.cloud.google.com/tpu/docs/v5e, /v5p, /v6e): bf16 peak per chip v5e 197, v5p 459,
    # v6e 918 TFLOP/s; HBM per chip "16 GB", "95 GB", "32 GB", read as GiB: the v5e measured here
    # (tests/data/tpu_v5e/doctor.json, accelerator.bytes_limit 16,909,336,064 = 15.75 GiB usable) has more than
    # 16 GB, and the planner's 10% reserve leaves 14.4 GiB of it.
    # fp32: no data sheet gives an fp32 matmul peak; the MXUs multiply bf16 only, and an fp32 matmul at precision
    # 'highest' (what parity's JAX step sets for fp32) runs as 6 bf16 passes (XLA's BF16_BF16_F32_X6 dot algorithm;
    # 'high' is 3). Assumed, not measured: fp32 peak = bf16 peak / 6.
    # Host link: bytes moved both ways together per second inside a jitted step, measured on the v5e: 18.8 GB/s
    # (benchmarks/results/2026-12-06-tpu-v5e-offload.md: a 512 MiB donated pinned_host buffer read and written by
    # one program; one way alone 12.2 GB/s in, 13.5 GB/s out; a train step moving 4.34 GB of Adam moments added
    # 220-241 ms, the same rate). The doctor's earlier 13.1 GB/s round trip used a smaller buffer; a fresh pinned
    # output (0.44-0.88 GB/s) times the host allocator. v5p and v6e carry the v5e's link and its hidden_transfer 0
    # unmeasured (v5e's): `Hardware.unmeasured` names them and `parity plan` prints it beside the link.
    # Host memory per chip: v5e measured 45 GiB on a 1-chip VM (doctor.json host.mem_total_bytes; the ct5lp-hightpu-1t
    # machine type lists 48 GB); v5p from its VM, 448 GB for 4 chips (112 GB per chip); v6e from its pod table,
    # 1536 GiB DRAM per 8-chip host (192 GiB per chip). v5p and v6e are the documented figures, not measured.
    "TPU-v5e": Hardware("TPU-v5e", 16 * GiB, 197e12, 18.8 * GB, 48318382080, 197e12 / 6, kind="tpu",
                        hidden_transfer=0.0),
    "TPU-v5p": Hardware("TPU-v5p", 95 * GiB, 459e12, 18.8 * GB, 112 * GB, 459e12 / 6, kind="tpu", hidden_transfer=0.0,
                        unmeasured=_V5E_TRANSFER, borrowed_from="v5e"),
    "TPU-v6e": Hardware("TPU-v6e", 32 * GiB, 918e12, 18.8 * GB, 192 * GiB, 918e12 / 6, kind="tpu",
                        hidden_transfer=0.0, unmeasured=_V5E_TRANSFER, borrowed_from="v5e"),
}
"""Accelerator presets of `parity plan --hardware`."""


# ----------------------------------------------------------------------------- cost model

def attention_width(model: ModelSpec) -> int:
  """H·Q of PaLM's attention term: query heads × head_dim (= d_model unless d_head is decoupled: Qwen3, Gemma)."""
  return model.n_heads * model.head_dim


def flops_per_token(model: ModelSpec, seq_len: int) -> float:
  """Training FLOPs per token: 6·N + 12·L·H·Q·s, H·Q = n_heads·head_dim (PaLM, Chowdhery et al. 2022, app. B;
  causal masking and sliding windows ignored: both sides compute dense scores)."""
  return 6 * memory.param_count(model) + 12 * model.n_layers * attention_width(model) * seq_len


def matmul_params(model: ModelSpec) -> int:
  """Params a token multiplies in a matmul: each block's weight matrices and the output head (a tied embedding once,
  as the head). Left out, as work no matmul does: an untied input embedding and learned positions (gathers: a row
  read per token), biases and norm scales (elementwise)."""
  return model.n_layers * memory.block_matrix_params(model) + model.vocab_size * model.d_model


def strict_flops_per_token(model: ModelSpec, seq_len: int, *, causal_skip: bool = False) -> float:
  """Training FLOPs per token counting matmul work only: 6 · `matmul_params` (where `flops_per_token`'s 6·N also
  counts the embedding gathers), plus attention's scores and values as the kernel computes them: the causal half,
  6·L·H·Q·s, when it skips the blocks the causal mask removes (`causal_skip`: the Pallas TPU flash kernel does),
  else dense, 12·L·H·Q·s (parity's exact kernel and torch's SDPA with a mask compute every score, then mask them).
  Sliding windows ignored, as in `flops_per_token`."""
  attention = (6 if causal_skip else 12) * model.n_layers * attention_width(model) * seq_len
  return 6 * matmul_params(model) + attention


def attention_counted(causal_skip: bool) -> str:
  """How `strict_flops_per_token` counted attention, in words a report prints beside the figure."""
  return ("causal half (the kernel skips masked blocks)" if causal_skip else
          "dense (the kernel computes every score, then masks)")


def recompute_flops_per_token(model: ModelSpec, seq_len: int, policy: str) -> float:
  """Extra FLOPs per token of a remat policy: 'full' reruns the forward (2·N + 4·L·H·Q·s); the *_no_batch
  policies rerun the attention score/value matmuls (4·L·H·Q·s); none and save_dots rerun no matmul."""
  attention = 4 * model.n_layers * attention_width(model) * seq_len
  if policy == "full":
    return 2 * memory.param_count(model) + attention
  if policy in ("save_dots_no_batch", "offload_dots_no_batch", "offload_names"):
    return attention
  return 0.0


def transfer_bytes(run: RunSpec, side: str, rows: list[memory.Row], ranks: int = 1) -> int:
  """Host <-> device bytes per optimizer step over one device's link (both directions summed).

  DeepSpeed on W ranks: offload_optimizer sends each rank's gradient partition down and its updated param
  partition up (2·e·N/W; stage 0 has no offload); offload_param (stage 3) also fetches each rank's param
  partition for every micro batch's forward and backward (2·e·N/W·GAS; the rest of each layer arrives by
  all-gather over the device interconnect, not the host link). JAX (rows per device, so already sharded):
  offloaded moments go in and out (2·8·N/D), offloaded params in and out (2·4·N/D); offloaded activations
  out and back (2·bytes) per micro batch, as are DeepSpeed's (cpu_checkpointing) and FSDP2's (activation_offload)
  host activation rows; a host-resident layer stack's per-micro-batch moves (`_jax_layer_moves`). FSDP2 with
  CPUOffloadPolicy on W ranks: each rank's fp32 param shards come to the device for the forward and the backward
  of every micro batch (4·N/W·2·GAS; once per micro batch without reshard_after_forward), its fp32 gradient shards
  go back once (4·N/W); without offload, nothing.
  """
  t = run.train
  n = memory.param_count(run.model)
  host_acts = 2 * t.grad_accum_steps * sum(r.bytes for r in rows if r.side == side and r.category == "activations"
                                           and r.kind == "host")  # saved on the host, back for the backward
  if side == "deepspeed":
    p, e = run.deepspeed, 4 if t.precision == "fp32" else 2
    part = math.ceil(n / (ranks if p.zero_stage >= 1 else 1))
    out = 2 * e * part if p.offload_optimizer == "cpu" else 0
    return out + (2 * e * part * t.grad_accum_steps if p.offload_param == "cpu" else 0) + host_acts
  if side == "fsdp":  # CPUOffloadPolicy: the fp32 shards go to the device for each unit's all-gather, in the forward
    if not run.fsdp.offload:  # and again in the backward (reshard_after_forward) of every micro batch; the fp32
      return host_acts  # gradient shards come back once per step (FSDPParam.offload_to_cpu, torch 2.13)
    part = math.ceil(n / ranks)
    fetches = 2 if run.fsdp.reshard_after_forward else 1
    return 4 * part * fetches * t.grad_accum_steps + 4 * part + host_acts
  resident = [r for r in rows if r.side == "jax" and r.kind == "host" and not r.note.startswith("in-step")]
  host = sum(r.bytes for r in resident)
  moments = sum(r.bytes for r in resident if r.category == "optimizer_moments")
  params = sum(r.bytes for r in resident if r.category == "params")
  acts = host - moments - params
  return 2 * moments + 2 * params + 2 * acts * t.grad_accum_steps + _jax_layer_moves(run)


def _jax_layer_moves(run: RunSpec) -> int:
  """Per micro batch, the moves of a JAX step whose layer stack lives in host memory (scan_layers, offload_params):
  each layer's fp32 params come to the device in the forward pass, and again in the backward pass unless every
  residual is saved (remat 'none': the recompute of any other policy moves them again). The layer gradient is born
  on the device (`jax_impl.offload.anchored_loss`). Measured on a TPU v5e with a step that still sent each layer's
  gradient through host memory and back (29 layers at d_model 1600, remat none): 2.15 s, and the model with these
  moves and that round trip 1.89 s at the chip's in-step rate, without either 1.32 (tests/test_memory_chip.py)."""
  p, t = run.jax, run.train
  if not (p.scan_layers and p.offload_params):
    return 0
  shard = p.data_parallel if p.zero_stage >= 3 else 1
  layer_params = 4 * math.ceil(run.model.n_layers * memory.block_params(run.model) / shard)  # fp32
  return (1 if p.remat == "none" else 2) * layer_params * t.grad_accum_steps


def step_time(run: RunSpec, side: str, hw: Hardware, rows: list[memory.Row], *,
              mfu: float = 0.4, ranks: int = 1) -> tuple[float, float, float]:
  """(step, compute, transfer) seconds of one optimizer step on one rank: compute = FLOPs / (peak · mfu) with
  the precision's peak (`Hardware.peak`),
  transfer = bytes / bandwidth, step = max(compute, transfer, compute + (1 - h) * transfer) with h the hardware's
  `hidden_transfer` (1: transfers overlap compute; 0: they add to it)."""
  t = run.train
  per = run.jax.data_parallel if side == "jax" else ranks if side == "fsdp" else 1  # jax, fsdp: global micro batch
  tokens = t.micro_batch_size * t.seq_len * t.grad_accum_steps / per
  policy = (run.jax.remat if side == "jax" else
            ("full" if run.fsdp.activation_checkpointing else "none") if side == "fsdp" else
            "full" if run.deepspeed.activation_checkpointing else "none")
  flops = tokens * (flops_per_token(run.model, t.seq_len) + recompute_flops_per_token(run.model, t.seq_len,
                                                                                           policy))
  compute = flops / (hw.peak(t.precision) * mfu)
  transfer = transfer_bytes(run, side, rows, ranks) / hw.host_link_bytes_per_s
  return max(compute, transfer, compute + (1.0 - hw.hidden_transfer) * transfer), compute, transfer


def custom_hardware(hw: Hardware, *, device_gib: float | None = None, host_gib: float | None = None,
                    bandwidth_gbs: float | None = None, peak_tflops: float | None = None) -> Hardware:
  """`hw` with the given figures replaced: device and host memory in GiB, host link in GB/s per direction, peak in
  TFLOP/s (used for every precision). Raises SpecError naming a figure that is not a finite number > 0."""
  given = {"device_gib": device_gib, "host_gib": host_gib, "bandwidth_gbs": bandwidth_gbs, "peak_tflops": peak_tflops}
  for key, v in given.items():
    if v is not None and not (math.isfinite(v) and v > 0):
      flag = {"device_gib": "--device-memory", "host_gib": "--host-memory", "bandwidth_gbs": "--bandwidth",
              "peak_tflops": "--peak-tflops"}[key]
      raise SpecError(f"{flag} {v:g}: must be a number > 0")
  changes = {k: v for k, v in (
      ("device_bytes", None if device_gib is None else int(device_gib * GiB)),
      ("host_bytes", None if host_gib is None else int(host_gib * GiB)),
      ("host_link_bytes_per_s", None if bandwidth_gbs is None else bandwidth_gbs * GB),
      ("peak_flops", None if peak_tflops is None else peak_tflops * 1e12),
      ("peak_flops_fp32", None if peak_tflops is None else peak_tflops * 1e12)) if v is not None}
  changes["unmeasured"] = tuple(f for f in hw.unmeasured if f not in changes)  # the user's figure is not borrowed
  return dataclasses.replace(hw, **changes)
