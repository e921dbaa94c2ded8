"""Sizes of the GPU benchmark, chosen by the project's memory model and planner (parity only: no jax, no torch).

  * `fixed_size`: one GPT (gpt2-1.5b: 48 layers x d_model 1600, seq 1024, bf16) and the smallest micro batch at
    which no plan without offload (zero0/1/2/3 on one device) fits the device on both sides while the offload
    pair `zero2-offload-scan` does (`parity.sizing.plans.choose_plan`, its 10 % device reserve, this node's
    device and host memory): the size "needs offload". The offload cost is measured at the largest micro batch
    where `zero2` (no offload) still fits on both sides, the same model.
  * `probe_run` / `predicted_largest`: the largest-model search's runs (same width, n_layers varies, micro
    batch 1) and the memory model's prediction of the largest n_layers, the doubling's start.
  * `jax_pool`: the JAX side's pinned-host pool (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB) by the planner's rule
    (parity.sizing.host_limits), set in each JAX part's environment and checked against the host in
    `predicted_fits`. A GPU's rule only: a TPU has no such pool (its pinned host memory is bounded by the host's,
    as the planner treats a `Hardware` of kind 'tpu', parity.sizing.plans._host_limits).
  * `hardware`: the planner's `Hardware` for the device the suite runs on (a TPU's preset by its device_kind, an
    H200's figures elsewhere) with the measured device and host memory.
  * `grid_run` / `grid_depth`: the JAX plan x gradient-accumulation grid of the TPU flow: one width, micro batch x
    seq = --micro-tokens, and the deepest model every plan of the grid fits by the memory model.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from benchmarks.gpu_parts.common import sizing_modules
from parity.presets import PRESETS
from parity.sizing import host_limits
from parity.hf import MODEL_PRESETS
from parity.spec import RunSpec, TrainSpec

FIXED_MODEL = "gpt2-1.5b"
"""parity.hf.MODEL_PRESETS name of the fixed GPT (a published size: GPT-2 XL)."""
OFFLOAD_PLAN, NO_OFFLOAD_PLAN = "zero2-offload-scan", "zero2"
"""Full optimizer-state offload (DeepSpeed ZeRO-2 + offload_optimizer cpu; JAX Adam moments in pinned_host,
streamed through the update one layer at a time) and the same pair without offload. The JAX side scans over
layers in both (compile time independent of depth, which the ~8 minute budget needs)."""
FSDP_OFFLOAD_PLAN, FSDP_NO_OFFLOAD_PLAN = "zero3-offload-all", "zero3"
"""The FSDP2 side's train pair. Parity's pairs with an FSDP2 plan are the ZeRO-3 ones (plans.PLANS: FSDP2 always
shards the params): `fully_shard` + `CPUOffloadPolicy` (sharded params, gradients and Adam moments in host memory,
the optimizer step on the CPU) where the fixed run needs offload, `fully_shard` alone for the offload cost's run
without it."""
TRAIN_PLANS = {"jax": (OFFLOAD_PLAN, NO_OFFLOAD_PLAN), "deepspeed": (OFFLOAD_PLAN, NO_OFFLOAD_PLAN),
               "fsdp": (FSDP_OFFLOAD_PLAN, FSDP_NO_OFFLOAD_PLAN)}
"""Side -> (its plan with offload, without) in the fixed flow's train part."""
PROBE_PLANS = {"jax": "scan-offload", "deepspeed": "zero3-offload-all", "fsdp": "zero3-offload-all"}
"""Largest-model plans: JAX params + optimizer state in pinned_host (scan over layers); DeepSpeed ZeRO-3 with
offload_optimizer and offload_param cpu; FSDP2 with CPUOffloadPolicy (the pair's FSDP2 plan)."""
NO_OFFLOAD = ("zero0", "zero1", "zero2", "zero3")
RESERVE = 0.1
"""Fraction of device memory the planner keeps for the framework and fragmentation (choose_plan's default)."""
AS_NAMED = (1.0,)
"""choose_plan's opt_ratios: each pair offloads all of its optimizer state, as the runs here run the pairs as named."""


def tiny_run():
  """gpt2-tiny in bf16 (the CPU check's model)."""
  run = PRESETS["gpt2-tiny"]
  return dataclasses.replace(run, train=dataclasses.replace(run.train, precision="bf16"))


def plan_variant(name: str) -> tuple[str, str | None]:
  """(plans.PLANS pair, JAX remat policy or None) of a benchmark plan name: a pair's name, or NAME@POLICY for the
  pair with its JAX side's jax.remat set to POLICY (e.g. zero0@full: nothing offloaded, every block recomputed, the
  no-offload plan that fits the largest model). Raises ValueError naming what is unknown and what is known."""
  from parity.spec import REMAT_POLICIES
  _, plans = sizing_modules()
  plan, _, remat = name.partition("@")
  if plan not in plans.PLANS:
    raise ValueError(f"unknown plan {plan!r}; choose from {', '.join(plans.PLANS)} (NAME@POLICY sets its jax.remat)")
  if "@" in name and remat not in REMAT_POLICIES:
    raise ValueError(f"{name!r}: unknown remat policy {remat!r}; choose from {', '.join(REMAT_POLICIES)}")
  return plan, (remat or None)


def with_plan(run, plan: str, *, micro_batch: int | None = None, n_layers: int | None = None):
  """`run` under a plans.PLANS pair (or NAME@POLICY: `plan_variant`), the JAX side scanning over layers, with micro
  batch / depth changed."""
  _, plans = sizing_modules()
  plan, remat = plan_variant(plan)
  if micro_batch is not None:
    run = dataclasses.replace(run, train=dataclasses.replace(run.train, micro_batch_size=micro_batch))
  if n_layers is not None:
    run = dataclasses.replace(run, model=dataclasses.replace(run.model, n_layers=n_layers))
  run = plans.apply_plan(run, plan)
  jax_plan = dataclasses.replace(run.jax, scan_layers=True, **({"remat": remat} if remat else {}))
  return dataclasses.replace(run, jax=jax_plan).validate()


def fixed_run(name: str = FIXED_MODEL):
  """The fixed GPT at micro batch 1: FIXED_MODEL (or `name`: a parity.hf.MODEL_PRESETS model at its max_seq_len, or
  a parity.presets.PRESETS run at its seq_len), bf16, both sides. Raises KeyError naming the known models."""
  if name in MODEL_PRESETS:
    model = MODEL_PRESETS[name]
    train = TrainSpec(micro_batch_size=1, seq_len=model.max_seq_len, precision="bf16", warmup_steps=1)
    return RunSpec(model=model, train=train, sides=("jax", "deepspeed"))
  if name in PRESETS:
    run = PRESETS[name]
    return dataclasses.replace(run, train=dataclasses.replace(run.train, precision="bf16", micro_batch_size=1),
                               sides=("jax", "deepspeed"))
  raise KeyError(f"model {name!r}: not in parity.hf.MODEL_PRESETS ({', '.join(MODEL_PRESETS)}) nor "
                 f"parity.presets.PRESETS ({', '.join(PRESETS)})")


TPU_PRESETS = (("v5 lite", "TPU-v5e"), ("v5e", "TPU-v5e"), ("v6 lite", "TPU-v6e"), ("v6e", "TPU-v6e"),
               ("v5p", "TPU-v5p"), ("v5", "TPU-v5p"))
"""device_kind (lower case) fragment -> the planner's TPU preset (parity.sizing.cost.HARDWARE), lite names first."""


def hardware(device_bytes: int, host_bytes: int, device_name: str | None = None, kind: str = "gpu"):
  """The planner's Hardware for this device with its measured memory: a TPU's preset by device_kind (v5e where the
  name is unknown: kind 'tpu' is what matters, no GPU pinned pool), else the H200's (a GPU's link and peak)."""
  _, plans = sizing_modules()
  name = "H200"
  if kind == "tpu":
    low = (device_name or "").lower()
    name = next((preset for frag, preset in TPU_PRESETS if frag in low), "TPU-v5e")
  return plans.custom_hardware(plans.HARDWARE[name], device_gib=device_bytes / 2**30, host_gib=host_bytes / 2**30)



def fixed_size(device_bytes: int, host_bytes: int, max_micro: int = 128, device_name: str | None = None,
               kind: str = "gpu") -> dict[str, Any]:
  """The fixed GPT, its needs-offload micro batch and its offload-cost micro batch, with the reasons.

  Args:
    device_bytes: accelerator memory (nvidia-smi memory.total; a TPU's bytes_limit).
    host_bytes: host memory the runs may use (MemAvailable).
    device_name, kind: the device (`hardware`: a TPU is sized with its preset and no GPU pinned pool).
  Returns:
    {'run': RunSpec at micro batch 1, 'micro_fixed', 'micro_cost' (None when none found), 'why': [lines],
     'ranking_at_fixed': plans.ranking_json}.
  """
  _, plans = sizing_modules()
  run = fixed_run()
  model, train = run.model, run.train
  hw = hardware(device_bytes, host_bytes, device_name, kind)
  cost, fixed, why, ranking = None, None, [], None
  # the sides sized on this device: on a TPU the JAX side only (DeepSpeed runs on a CUDA GPU or the host CPU, never
  # on the chip: plans.off_device_sides)
  sides = tuple(s for s in ("jax", "deepspeed") if s not in plans.off_device_sides(hw, ("jax", "deepspeed")))
  for micro in range(1, max_micro + 1):
    t = dataclasses.replace(train, micro_batch_size=micro)
    by = {s: {c.name: c for c in plans.choose_plan(model, t, hw, host_bytes=host_bytes, reserve=RESERVE,
                                                   sides=(s,), opt_ratios=AS_NAMED)[1]} for s in sides}
    if all(by[s][NO_OFFLOAD_PLAN].fits for s in sides):
      cost = micro
    if not all(by[s][OFFLOAD_PLAN].fits for s in sides):
      why = [f"micro batch {micro}: {OFFLOAD_PLAN} does not fit: " + "; ".join(
          p for s in sides for p in by[s][OFFLOAD_PLAN].problems)]
      break
    if all(not by[s][n].fits for s in sides for n in NO_OFFLOAD):
      fixed = micro
      ranking = plans.ranking_json(*plans.choose_plan(model, t, hw, host_bytes=host_bytes, reserve=RESERVE,
                                                      opt_ratios=AS_NAMED))
      why = [f"{FIXED_MODEL} ({plans.memory.param_count(model) / 1e9:.2f} B params), seq {t.seq_len}, bf16, micro "
             f"batch {micro}: by the memory model no plan without offload fits either side on "
             f"{hw.device_bytes / 2**30:.1f} GiB x {1 - RESERVE:.0%} usable:"]
      why += [f"  {n}: " + "; ".join(p for s in sides for p in by[s][n].problems) for n in NO_OFFLOAD]
      why.append(f"  {OFFLOAD_PLAN} fits: peak device " + ", ".join(
          f"{s} {by[s][OFFLOAD_PLAN].peak_device_bytes[s] / 2**30:.1f} GiB" for s in sides) + "; host " + ", ".join(
          f"{s} {by[s][OFFLOAD_PLAN].host_bytes[s] / 2**30:.1f} GiB" for s in sides))
      break
  if cost is not None:
    why.append(f"offload cost at micro batch {cost}: the largest at which {NO_OFFLOAD_PLAN} (no offload) still "
               "fits on both sides, same model")
  return {"run": run, "micro_fixed": fixed, "micro_cost": cost, "why": why, "ranking_at_fixed": ranking}


def side_run(run, side: str):
  """`run` as `side` runs it: the fsdp side's run names that side alone (its plan is the run's `fsdp` section, set by
  a pair with an FSDP2 plan); the others' as they are."""
  return dataclasses.replace(run, sides=("fsdp",)).validate() if side == "fsdp" else run


def train_run(run, side: str, offload: bool):
  """The train run of `side` from a fixed-flow config `run` (TRAIN_PLANS: its plan with or without offload, at the
  config's micro batch); the JAX and DeepSpeed configs carry their plan already and are returned as they are."""
  if side != "fsdp":
    return run
  return side_run(with_plan(run, TRAIN_PLANS[side][0 if offload else 1]), side)


def probe_run(base, side: str, n_layers: int):
  """The largest-model probe of `side` at `n_layers`: `base`'s width, micro batch 1, the side's PROBE_PLANS pair."""
  return side_run(with_plan(base, PROBE_PLANS[side], micro_batch=1, n_layers=n_layers), side)


BUILD_COPIES = 3
"""fp32 copies of the weights a probe process may hold on the host while it builds, beyond the memory model's state:
the canonical numpy weights, the master copy (parity.weights.master_weights rounds them for bf16) and the
framework's own layout (the stacked flax tree / the torch module) before placement. Conservative on purpose: a
probe past the host's memory meets the OOM killer, on a node without swap."""
FAST_BUILD_COPIES = 0
"""The same for a JAX probe that fills its state in place (`jax_train --fast-init`, `jax_train.filled_trainer`): no
weights pass through numpy; each leaf is made on the device and lands in its memory kind."""


def jax_pool(run, environ=None, kind: str = "gpu"):
  """The JAX side's pinned-host pool for `run` by the planner's rule (parity.sizing.host_limits.jax_pool: the memory
  model's pinned bytes per device, XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB kept when the user set it): (env for the part's
  process, the decision's JSON); ({}, None) on a TPU or the CPU (`kind` other than 'gpu': no such pool). Raises
  SpecError for a bad value of the variable."""
  import os
  if kind != "gpu":
    return {}, None
  decision = host_limits.jax_pool(run, os.environ if environ is None else environ,
                                  host_limits.host_bytes_per_device(run))  # a GPU node: the pool must fit its host
  return decision.env(), decision.to_json()


def predicted_fits(run, side: str, device_bytes: int | None, host_bytes: int,
                   kind: str = "gpu", copies: int = BUILD_COPIES) -> tuple[bool, str]:
  """(fits, why) of one side's probe run by the memory model: peak device <= usable (unchecked when device_bytes is
  None), peak host + `copies` fp32 weight copies (BUILD_COPIES; FAST_BUILD_COPIES for a JAX probe that fills its
  state in place) <= host_bytes and, for the JAX side on a GPU (`kind`), its pinned-host pool by the shared rule
  (`jax_pool`) within host_bytes (each device's pool can grow to its limit). On a TPU the pinned-host state is
  ordinary host memory beside the runtime's premapped region (measured: `tpu_host_overhead`), so the host check
  adds that overhead to the whole host peak."""
  memory, _ = sizing_modules()
  rows = memory.estimate(run, sides=(side,))
  dev = memory.peak_device_bytes(rows, side)
  host = memory.peak_host_bytes(rows, side) + copies * 4 * memory.param_count(run.model)
  if side == "jax" and kind == "tpu":
    host += tpu_host_overhead()
  usable = float("inf") if device_bytes is None else device_bytes * (1 - RESERVE)
  gpu_pool = side == "jax" and kind == "gpu"
  pool = (host_limits.pool_problem(host_limits.jax_pool(run, host_bytes=host_bytes), host_bytes) if gpu_pool
          else None)
  ok = dev <= usable and host <= host_bytes and pool is None
  extra = " and the TPU runtime's host overhead" if side == "jax" and kind == "tpu" else ""
  why = (f"predicted device {dev / 2**30:.1f} GiB (usable {usable / 2**30:.1f}), host {host / 2**30:.1f} GiB with "
         f"{copies} fp32 build copies{extra} (available {host_bytes / 2**30:.1f})")
  return ok, why + (f"; {pool}" if pool else "")


TPU_PREMAPPED_ENV = host_limits.TPU_PREMAPPED_ENV
TPU_PREMAPPED_DEFAULT = host_limits.TPU_PREMAPPED_DEFAULT_BYTES
"""The TPU runtime's premapped region where TPU_PREMAPPED_BUFFER_SIZE is unset: a staging area the runtime maps and
pins each time a process opens the chip (~11 s for the default on a v5e, 3.5 s for 256 MiB), not where `pinned_host`
arrays live (parity.sizing.host_limits, measured with benchmarks/tpu_parts/pinned_probe.py). So a large region only
costs host memory: a TPU run wants a small one."""
TPU_RUNTIME_HOST_BYTES = host_limits.TPU_PROCESS_HOST_BYTES
"""What a training process holds beyond its state and the region (parity.sizing.host_limits: measured)."""
TPU_COMPILE_HOST_BYTES = host_limits.TPU_COMPILE_HOST_BYTES
"""What the step's compile adds (parity.sizing.host_limits: measured)."""


def tpu_premapped(environ=None) -> tuple[int, str]:
  """(bytes, source) of the TPU's premapped region: TPU_PREMAPPED_BUFFER_SIZE when it is a whole number > 0, else
  the runtime's default."""
  import os
  raw = (os.environ if environ is None else environ).get(TPU_PREMAPPED_ENV, "").strip()
  if raw.isdigit() and int(raw) > 0:
    return int(raw), f"{TPU_PREMAPPED_ENV}={raw}"
  return TPU_PREMAPPED_DEFAULT, f"{TPU_PREMAPPED_ENV} unset: the runtime's default"


def tpu_host_overhead(environ=None) -> int:
  """Host bytes a TPU training process holds besides its own state (host_limits.tpu_process_overhead): the premapped
  region, the process's own, and the step's compile unless a persistent compilation cache (JAX_COMPILATION_CACHE_DIR)
  lets the run that holds the state load the executable the search compiled (tpu_parts/bench.py sets one; its host
  peak at 98 layers was then its state plus the process's own)."""
  import os
  env = os.environ if environ is None else environ
  return host_limits.tpu_process_overhead(tpu_premapped(environ)[0], compiles=not env.get("JAX_COMPILATION_CACHE_DIR"))


def predicted_largest(base, side: str, device_bytes: int, host_bytes: int, cap: int = 4096, *, plan: str | None = None,
                      kind: str = "gpu", copies: int = BUILD_COPIES) -> int:
  """Largest n_layers in [1, cap] whose probe run (`plan`: that plan at micro batch 1; default the side's
  PROBE_PLANS pair) fits by the memory model with `copies` build copies (`predicted_fits`; 0: none), by bisection."""
  lo, hi = 0, cap + 1
  while hi - lo > 1:
    mid = (lo + hi) // 2
    run = probe_run(base, side, mid) if plan is None else with_plan(base, plan, micro_batch=1, n_layers=mid)
    if predicted_fits(run, side, device_bytes, host_bytes, kind, copies)[0]:
      lo = mid
    else:
      hi = mid
  return lo


GRID_PLANS = ("zero0", "zero2-offload-scan")
"""The TPU flow's default JAX plans to time: nothing offloaded, and the Adam moments in host memory streamed through
the update a layer at a time (both scan over layers)."""
GRID_GRAD_ACCUM = (1, 8)
GRID_MICRO_TOKENS = 4096
"""Tokens per micro batch of the grid: 4k tokens a step at gradient accumulation 1, 32k at 8."""
LARGEST_PLANS = ("zero0", "zero2-offload-scan", "scan-offload")
"""The TPU flow's largest-model plans: none offloaded, the moments offloaded, params and moments offloaded."""


def grid_run(base, plan: str, micro_tokens: int, grad_accum: int, n_layers: int | None = None):
  """`base` under `plan` (scanning over layers) at micro batch micro_tokens / seq_len and `grad_accum` micro batches.
  Raises ValueError when micro_tokens is not a multiple of the sequence length."""
  seq = base.train.seq_len
  if micro_tokens % seq or micro_tokens < seq:
    raise ValueError(f"--micro-tokens {micro_tokens}: must be a multiple of the sequence length {seq}")
  run = with_plan(base, plan, micro_batch=micro_tokens // seq, n_layers=n_layers)
  return dataclasses.replace(run, train=dataclasses.replace(run.train, grad_accum_steps=grad_accum)).validate()


def grid_depth(base, plans_: tuple[str, ...], micro_tokens: int, grad_accum: int, hw, host_bytes: int,
               cap: int = 1024) -> tuple[int, list[str]]:
  """(deepest n_layers in [1, cap] at which every plan of the grid fits the device and host by the memory model with
  the planner's RESERVE, at the grid's micro batch and `grad_accum` (on a TPU with the runtime's host overhead
  beside the state: `tpu_host_overhead`), 0 when none; the lines saying so)."""
  memory, _ = sizing_modules()
  usable = hw.device_bytes * (1 - RESERVE)

  def peaks(n: int) -> dict[str, tuple[int, int]]:
    out = {}
    for plan in plans_:
      rows = memory.estimate(grid_run(base, plan, micro_tokens, grad_accum, n), sides=("jax",))
      out[plan] = (memory.peak_device_bytes(rows, "jax"), memory.peak_host_bytes(rows, "jax"))
    return out

  overhead = tpu_host_overhead() if hw.kind == "tpu" else 0

  def fits(n: int) -> bool:
    return all(d <= usable and h + overhead <= host_bytes for d, h in peaks(n).values())
  lo, hi = 0, cap + 1
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
  why = [f"grid depth by the memory model: {lo} layers of d_model {base.model.d_model}, micro batch "
         f"{micro_tokens // base.train.seq_len} x seq {base.train.seq_len}, grad accum {grad_accum}: every plan fits "
         f"{usable / 2**30:.1f} GiB usable ({hw.name}, {1 - RESERVE:.0%} of {hw.device_bytes / 2**30:.2f} GiB)"]
  if lo:
    why += [f"  {p}: device {d / 2**30:.2f} GiB, host {h / 2**30:.2f} GiB" for p, (d, h) in peaks(lo).items()]
  if hw.kind == "tpu":
    limit, source = tpu_premapped()
    why.append(f"  host: each plan's state plus {overhead / 2**30:.2f} GiB the TPU runtime holds (its premapped region "
               f"{limit / 2**30:.2f} GiB, {source}; the runtime; the compile)")
  return lo, why


_HBM_NEED = re.compile(r"\(([0-9.]+)G\) exceeds available HBM \(([0-9.]+)G\)")


def compiler_guess(rec: dict[str, Any]) -> int | None:
  """The depth a TPU compiler's refusal points at: n x available / required, from its message ("the total memory
  required for HLO temporaries (24.14G) exceeds available HBM (15.75G)"). The requirement grows with depth plus a
  part that does not (embeddings, logits): need = c + b·n, so the deepest that fits is n* = (A - c) / b, and the
  guess n·A / need exceeds it by (n - n*)·c / need: it falls between n* and n, closer to n* the smaller c is, and
  each refusal's guess comes closer (truncation to a whole layer may land it on n*). None without such a message.
  The same for a depth that compiled with host buffers the host cannot hold: n x host_allowed_bytes /
  host_need_bytes (jax_largest.compiled_host_problem's figures)."""
  m = _HBM_NEED.search(str(rec.get("detail") or ""))
  if m and float(m.group(1)) > 0:
    return int(rec["n_layers"] * float(m.group(2)) / float(m.group(1)))
  need, allowed = rec.get("host_need_bytes"), rec.get("host_allowed_bytes")
  if need and allowed is not None and need > 0:
    return int(rec["n_layers"] * allowed / need)
  return None


def search_largest(probe, start: int, *, max_probes: int, time_left, min_probe_s,
                   resolution: float = 0.125) -> dict[str, Any]:
  """Doubling then bisection over n_layers: the largest depth whose probe trains. After a refusal whose message states
  the memory it needed (`compiler_guess`), the next probe is the depth that need points at, where it lies inside the
  bracket, instead of the midpoint.

  Args:
    probe: n_layers -> {'status': 'ok' | 'oom' | 'host-limit' | 'timeout' | 'error', ...}; 'oom' and 'host-limit'
      (refused before it starts: the memory model's host bytes exceed what the node has) bound the search from
      above, 'timeout' and 'error' end it (the answer is then a lower bound).
    start: the first depth (the memory model's prediction), doubled while probes succeed.
    max_probes: probes at most; time_left: () -> seconds left; min_probe_s: no probe starts with less left (a
      number, or () -> seconds: e.g. the last probe's time).
    resolution: bisection stops when hi - lo <= max(1, resolution * lo).
  Returns:
    {'largest_ok': lo (0: none trained), 'smallest_failed': hi or None, 'complete': bool, 'stopped': why,
     'probes': [{'n_layers', **probe result}]}.
  """
  lo, hi, n, probes, stopped = 0, None, max(1, start), [], ""

  def run(k: int) -> str:
    res = probe(k)
    probes.append({"n_layers": k, **res})
    return res["status"]

  def need() -> float:
    return min_probe_s() if callable(min_probe_s) else min_probe_s

  def can() -> bool:
    return len(probes) < max_probes and time_left() >= need()

  while hi is None and can():
    status = run(n)
    if status == "ok":
      lo, n = n, 2 * n
    elif status in ("oom", "host-limit"):
      hi = n
    else:
      stopped = f"probe at {n} layers: {status}"
      break
  while not stopped and hi is not None and hi - lo > max(1, int(resolution * lo)) and can():
    guess = compiler_guess(probes[-1]) if probes[-1]["status"] in ("oom", "host-limit") else None
    mid = guess if guess is not None and lo < guess < hi else (lo + hi) // 2
    status = run(mid)
    if status == "ok":
      lo = mid
    elif status in ("oom", "host-limit"):
      hi = mid
    else:
      stopped = f"probe at {mid} layers: {status}"
  complete = not stopped and hi is not None and hi - lo <= max(1, int(resolution * lo))
  if not complete and not stopped:
    stopped = (f"probe cap ({max_probes}) reached" if len(probes) >= max_probes else
               f"time budget spent ({time_left():.0f} s left < {need():.0f} s per probe)")
  return {"largest_ok": lo, "smallest_failed": hi, "complete": complete, "stopped": stopped or "bracket closed",
          "probes": probes}
