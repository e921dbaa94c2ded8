"""Named plan pairs (a DeepSpeed plan and its JAX counterpart) and the planner behind `parity plan`.

`PLANS` pairs each `DeepSpeedPlan` with the `JaxPlan` that keeps the same state in the same places:
ZeRO stage s <-> JAX `zero_stage` s (sharding over the data axis), DeepSpeed `offload_optimizer: cpu`
<-> `offload_opt_state` (Adam moments and, in DeepSpeed, the fp32 master copy on the host),
`offload_param: cpu` <-> `offload_params`, activation checkpointing <-> `remat='full'`. Where FSDP2 keeps the same
state in the same places, the pair also names the FSDP2 side's plan (`Plan.fsdp`): ZeRO-3 <-> `fully_shard` on every
block and the root; ZeRO-3 with params and optimizer on the CPU <-> `fully_shard` + `CPUOffloadPolicy`. FSDP2 always
shards the params, so ZeRO-0/1/2 pairs have no FSDP2 counterpart (None: an `fsdp` side runs its own plan); activation
checkpointing <-> `FsdpPlan.activation_checkpointing`.
`apply_plan(run, name)` puts a pair into a RunSpec. `choose_plan` ranks every candidate with the memory
model of `parity.sizing.memory` and the roofline step-time model of `parity.sizing.cost` (docs/plans.md), whose
`Hardware`, `HARDWARE` and `step_time` are importable from here; a pair that offloads the optimizer state gets the
smallest share of it that fits the JAX side (`OPT_RATIOS`, jax.offload_opt_ratio). No jax or torch import.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from parity.sizing import host_limits, memory
from parity.sizing.cost import GiB, HARDWARE, Hardware, custom_hardware, step_time
from parity.sizing.batches import counted_tokens_per_s
from parity.sizing.memory_jax import opt_split
from parity.spec import DeepSpeedPlan, FsdpPlan, JaxPlan, ModelSpec, RunSpec, SpecError, TrainSpec

__all__ = ["Plan", "PLANS", "DEFAULT_PLAN", "fsdp_missing_reason", "apply_plan", "with_plan", "plan_of", "Hardware",
           "HARDWARE", "Candidate", "OPT_RATIOS",
           "step_time", "choose_plan", "engine_choice", "uncosted", "explain", "custom_hardware", "plan_inputs",
           "ranking_json", "MAX_PLAN_LAYERS", "check_plan_depth", "TORCH_SIDES", "off_device_sides",
           "off_device_note"]

MAX_PLAN_LAYERS = 1024
"""Deepest model.n_layers the planner and the memory model cost (their DeepSpeed and JAX figures walk every layer's
tensors: 1,024 layers take about two seconds, 10^9 would take days). The deepest published LLMs have under 200."""


def check_plan_depth(model: ModelSpec) -> None:
  """Refuses (SpecError, exit 2) a model deeper than MAX_PLAN_LAYERS before anything is costed."""
  if model.n_layers > MAX_PLAN_LAYERS:
    raise SpecError(f"model.n_layers={model.n_layers:,}: the planner and the memory model cost at most "
                    f"{MAX_PLAN_LAYERS:,} layers (the deepest published LLMs have under 200); check the value (e.g. "
                    "--set model.n_layers=32)")


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
  """One DeepSpeed plan and the JAX plan that places the same training state in the same memory."""

  deepspeed: DeepSpeedPlan
  """ZeRO stage, offload and activation checkpointing of the DeepSpeed side."""
  jax: JaxPlan
  """Memory kinds, sharding and remat policy of the JAX side."""
  description: str
  """One line: what the pair keeps where."""
  fsdp: FsdpPlan | None = None
  """The FSDP2 side's plan that keeps the same state in the same places, or None where FSDP2 has none
  (`fsdp_missing_reason`: a ZeRO-0/1/2 pair; an `fsdp` side then runs the run's own `RunSpec.fsdp`)."""


_OFF = dict(offload_optimizer="none")
_SHARD = FsdpPlan()
"""fully_shard on every block and the root, params resharded after forward: ZeRO-3's state and schedule."""
_SHARD_OFFLOAD = FsdpPlan(offload=True)
"""The same with CPUOffloadPolicy: sharded params, gradients and optimizer state on the host, the step on the CPU."""
_SHARD_OFFLOAD_REMAT = FsdpPlan(offload=True, activation_checkpointing=True)
"""The same, every block recomputed in the backward pass (torch.utils.checkpoint)."""
PLANS: dict[str, Plan] = {
    "zero0": Plan(DeepSpeedPlan(zero_stage=0, **_OFF), JaxPlan(offload_opt_state=False),
                  "everything replicated on the device: no sharding, no offload"),
    "zero1": Plan(DeepSpeedPlan(zero_stage=1, **_OFF), JaxPlan(offload_opt_state=False, zero_stage=1),
                  "optimizer state (fp32 master + Adam moments) sharded over data-parallel ranks"),
    "zero2": Plan(DeepSpeedPlan(zero_stage=2, **_OFF), JaxPlan(offload_opt_state=False, zero_stage=2),
                  "optimizer state and gradients sharded"),
    "zero2-offload": Plan(DeepSpeedPlan(), JaxPlan(),
                          "default pair: ZeRO-2 + optimizer on the CPU <-> Adam moments in pinned_host"),
    "zero2-offload-remat": Plan(DeepSpeedPlan(activation_checkpointing=True), JaxPlan(remat="full"),
                                "default pair + every block recomputed in the backward pass"),
    "zero3": Plan(DeepSpeedPlan(zero_stage=3, **_OFF), JaxPlan(offload_opt_state=False, zero_stage=3),
                  "params, gradients and optimizer state sharded (FSDP)", _SHARD),
    "zero3-offload-all": Plan(DeepSpeedPlan(zero_stage=3, offload_param="cpu"),
                              JaxPlan(offload_params=True, zero_stage=3),
                              "ZeRO-3 with optimizer state and params on the host", _SHARD_OFFLOAD),
    "zero3-offload-all-remat": Plan(DeepSpeedPlan(zero_stage=3, offload_param="cpu", activation_checkpointing=True),
                                    JaxPlan(offload_params=True, zero_stage=3, remat="full"),
                                    "ZeRO-3, everything offloaded, every block recomputed", _SHARD_OFFLOAD_REMAT),
    "zero3-fsdp4": Plan(DeepSpeedPlan(zero_stage=3, **_OFF), JaxPlan(offload_opt_state=False, zero_stage=3,
                                                                      data_parallel=4),
                        "FSDP over 4 devices on the JAX side (DeepSpeed: ZeRO-3 on its ranks)", _SHARD),
    "scan-offload": Plan(DeepSpeedPlan(zero_stage=3, offload_param="cpu"),
                         JaxPlan(offload_params=True, zero_stage=3, scan_layers=True),
                         "ZeRO-3 with params and optimizer state on the host, brought to the device one layer at "
                         "a time (JAX: scan, forward, backward and update)", _SHARD_OFFLOAD),
    "scan-offload-remat": Plan(DeepSpeedPlan(zero_stage=3, offload_param="cpu", activation_checkpointing=True),
                               JaxPlan(offload_params=True, zero_stage=3, scan_layers=True, remat="full"),
                               "scan-offload + every block recomputed in the backward pass", _SHARD_OFFLOAD_REMAT),
    "zero2-offload-scan": Plan(DeepSpeedPlan(), JaxPlan(scan_layers=True),
                               "default pair; JAX streams the Adam moments through the update one layer at a time"),
    "act-offload": Plan(DeepSpeedPlan(activation_checkpointing=True), JaxPlan(remat="offload_dots_no_batch"),
                        "JAX keeps weight-matmul outputs in host memory; DeepSpeed recomputes each block"),
    "zero3-act-offload": Plan(DeepSpeedPlan(zero_stage=3, **_OFF, activation_checkpointing=True,
                                            cpu_checkpointing=True),
                              JaxPlan(offload_opt_state=False, zero_stage=3, remat="offload_names"),
                              "ZeRO-3 state on the device, saved activations in host memory: DeepSpeed "
                              "cpu_checkpointing (block inputs; blocks recomputed), JAX remat offload_names (the "
                              "named residuals), FSDP2 save_on_cpu (everything autograd saves)",
                              FsdpPlan(activation_offload=True)),
}
"""Named plan pairs for `parity compare --plan NAME`; see docs/plans.md for the table."""

DEFAULT_PLAN = "zero2-offload"
"""The pair RunSpec() uses (DeepSpeedPlan() and JaxPlan())."""


def apply_plan(run: RunSpec, name: str) -> RunSpec:
  """Returns `run` with the DeepSpeed and JAX plans of PLANS[name], validated.

  Raises:
    SpecError: unknown name (the known ones are listed), or the plan does not fit the run (e.g. a
      micro batch not divisible by the plan's data_parallel).
  """
  try:
    plan = PLANS[name]
  except KeyError:
    raise SpecError(f"unknown plan {name!r}; known plans: {', '.join(PLANS)} (or 'auto')") from None
  out = with_plan(run, plan)
  try:
    return out.validate()
  except SpecError as exc:
    raise SpecError(f"plan {name!r}: {exc}") from None


def with_plan(run: RunSpec, plan: Plan) -> RunSpec:
  """`run` with the pair's DeepSpeed and JAX plans, and its FSDP2 plan where it has one (else run.fsdp kept); not
  validated."""
  return dataclasses.replace(run, deepspeed=plan.deepspeed, jax=plan.jax,
                             fsdp=plan.fsdp if plan.fsdp is not None else run.fsdp)


def plan_of(run: RunSpec) -> str | None:
  """Name of the plan pair a run uses, or None when its plans are not one of PLANS. A run with an `fsdp` side
  matches a pair with an FSDP2 plan only when its `RunSpec.fsdp` is that plan, and a pair must describe at least
  one side the run has (jax, deepspeed, or fsdp where the pair has an FSDP2 plan): an fsdp-only run names no
  ZeRO-0/1/2 pair."""
  for name, plan in PLANS.items():
    described = {"jax", "deepspeed"} | ({"fsdp"} if plan.fsdp is not None else set())
    if plan.deepspeed == run.deepspeed and plan.jax == run.jax and described & set(run.sides) and (
        plan.fsdp is None or "fsdp" not in run.sides or plan.fsdp == run.fsdp):
      return name
  return None


# ----------------------------------------------------------------------------- planner

TORCH_SIDES = {"deepspeed": "DeepSpeed", "fsdp": "FSDP2"}
"""The sides whose engine is torch: on a TPU they do not run on the chip (torch has no TPU backend in this project,
and the TPU VM measured refuses the sockets their process group needs), so the planner gives them no TPU figures."""


def off_device_sides(hw: Hardware, sides: tuple[str, ...]) -> tuple[str, ...]:
  """The sides of `sides` that do not run on `hw`'s accelerator: DeepSpeed and FSDP2 on a TPU (`TORCH_SIDES`: they
  run on a CUDA GPU or the host CPU), none on a GPU."""
  return tuple(s for s in sides if hw.kind == "tpu" and s in TORCH_SIDES)


def off_device_note(hw: Hardware, sides: tuple[str, ...]) -> str | None:
  """The line `parity plan` prints for the sides it does not cost on `hw` (`off_device_sides`), or None."""
  off = off_device_sides(hw, sides)
  return f"not costed on {hw.name}: {_off_device_reason(off)}" if off else None


def _off_device_reason(off: tuple[str, ...]) -> str:
  names = " and ".join(TORCH_SIDES[s] for s in off)
  one = len(off) == 1
  it = "it" if one else "them"
  return (f"{', '.join(off)} ({names}) {'runs' if one else 'run'} on a CUDA GPU or the host CPU, not on a TPU, so "
          f"{'it gets' if one else 'they get'} no TPU device memory or step time; cost {it} with a GPU --hardware "
          f"(e.g. H100), run {it} there or on a CPU machine, and join the folders with the JAX side's (`parity join`)")


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
  """One plan pair evaluated on one machine: the slower side's cost, and why it does not fit (if so)."""

  name: str
  step_s: float
  """Estimated optimizer-step time of the slower side, seconds."""
  compute_s: float
  transfer_s: float
  peak_device_bytes: dict[str, int]
  """side -> predicted peak device bytes per rank."""
  host_bytes: dict[str, int]
  """side -> predicted peak host bytes per rank (resident + in-step host rows)."""
  problems: tuple[str, ...]
  """Why the plan does not fit; empty when it fits."""
  jax_pool: dict[str, Any] | None = None
  """The JAX side's pinned-host pool per device (parity.sizing.host_limits.PoolDecision.to_json: need, the pool the
  worker gets, who set it, the sentence); None when the JAX side is not costed or pins nothing."""
  side_step_s: dict[str, float] | None = None
  """side -> its own estimated step seconds (step_s is the slowest of them); None for a pair not costed."""
  deepspeed_pinned: dict[str, Any] | None = None
  """With pin_memory: the DeepSpeed side's pinned host buffers, {'requested_bytes', 'pinned_bytes'} per rank
  (host_limits.deepspeed_pinned_cost: torch rounds each block to a power of two); host_bytes includes the
  difference. None without pin_memory."""
  jax_opt_ratio: float | None = None
  """The JAX side's jax.offload_opt_ratio where the planner chose one (`OPT_RATIOS`), else None (the pair's own)."""
  notes: tuple[str, ...] = ()
  """Lines `parity plan` prints about the pair's choice: the ratio chosen and why (`_opt_ratio`)."""

  @property
  def fits(self) -> bool:
    return not self.problems

  def side_fits(self, side: str) -> bool:
    """Whether `side` alone fits: costed, and no problem names it (each problem starts with its side's name)."""
    return self.side_step_s is not None and not any(p.startswith((f"{side} ", f"{side}'s ")) for p in self.problems)


def _host_limits(runs: dict[str, RunSpec], hosts: dict[str, int], host_bytes: int, *, ranks: int,
                 pool_user_gib: int | None, pin_memory: bool,
                 kind: str = "gpu") -> tuple[dict | None, dict | None, list[str]]:
  """(jax_pool, deepspeed_pinned, problems) of one pair (`Candidate`): on a GPU (`kind`) the JAX side's pool by the
  shared rule (host_limits.pool_decision: it must hold the need and fit the host); a TPU has no such pool (its host
  need is bounded by host memory only, `_candidate`'s host problem). DeepSpeed's pinned rounding added to `hosts`
  in place when pin_memory is on."""
  pool, pinned, problems = None, None, []
  if "deepspeed" in runs and pin_memory:
    cost = host_limits.deepspeed_pinned_cost(runs["deepspeed"], ranks)
    hosts["deepspeed"] += cost.extra_bytes
    pinned = {"requested_bytes": cost.requested_bytes, "pinned_bytes": cost.pinned_bytes}
  if "jax" in runs and kind == "gpu":
    need = host_limits.jax_pinned_need_bytes(runs["jax"])
    if need:
      decision = host_limits.pool_decision(need, pool_user_gib, host_bytes)
      pool = decision.to_json()
      why = host_limits.pool_problem(decision, host_bytes)
      if why and (decision.need_bytes > decision.pool_bytes or hosts["jax"] <= host_bytes):  # else: the host line
        problems.append(why)
  return pool, pinned, problems


def _candidate(name: str, runs: dict[str, RunSpec], hw: Hardware, host_bytes: int, *, mfu: float, reserve: float,
               ranks: int, pool_user_gib: int | None = None, pin_memory: bool = False,
               tpu_premapped: int = host_limits.TPU_PREMAPPED_DEFAULT_BYTES) -> Candidate:
  """Costs one pair; `runs` maps each side that must fit to the RunSpec it would run."""
  sides = tuple(runs)
  rows = [r for s, run in runs.items() for r in memory.estimate(run, ranks=ranks, sides=(s,))]
  usable = int(hw.device_bytes * (1 - reserve))
  peaks = {s: memory.peak_device_bytes(rows, s) for s in sides}
  hosts = {s: memory.peak_host_bytes(rows, s) for s in sides}
  pool, pinned, pool_problems = _host_limits(runs, hosts, host_bytes, ranks=ranks, pool_user_gib=pool_user_gib,
                                             pin_memory=pin_memory, kind=hw.kind)
  problems = [f"{s} needs {peaks[s] / GiB:.1f} GiB on the device > {usable / GiB:.1f} GiB usable"
              for s in sides if peaks[s] > usable]
  extra = {s: host_limits.tpu_process_overhead(tpu_premapped) if hw.kind == "tpu" and s == "jax" else 0
           for s in sides}
  problems += [f"{s} needs {hosts[s] / GiB:.1f} GiB of host memory"
               + (f" + {extra[s] / GiB:.1f} GiB the TPU runtime holds" if extra[s] else "")
               + f" > {host_bytes / GiB:.1f} GiB" for s in sides if hosts[s] + extra[s] > host_bytes]
  times = {s: step_time(run, s, hw, rows, mfu=mfu, ranks=ranks) for s, run in runs.items()}
  step, compute, transfer = max(times.values())
  return Candidate(name, step, compute, transfer, peaks, hosts, tuple(problems + pool_problems), pool,
                   {s: t[0] for s, t in times.items()}, pinned)


OPT_RATIOS = (0.25, 0.5, 0.75, 1.0)
"""The shares of the optimizer state the planner tries offloading (jax.offload_opt_ratio), smallest first. A pair that
offloads it, whose JAX side does not fit with the optimizer state on the device but fits with all of it on the host,
runs the smallest share that fits (`_opt_ratio`): less to move each step, and a TPU v5e hides none of the copy time
behind compute (cost.Hardware.hidden_transfer)."""


def _opt_ratio(run: RunSpec, usable: int, ratios: tuple[float, ...] = OPT_RATIOS) -> tuple[RunSpec, str | None]:
  """(the JAX run with the planner's offload_opt_ratio, the line saying why) for a pair that offloads the optimizer
  state; (run, None) where it keeps the pair's own: no optimizer offload, or a JAX side that fits with the optimizer
  state on the device (a pair without the offload costs less then) or does not fit with all of it on the host."""
  p = run.jax
  at = lambda **kw: dataclasses.replace(run, jax=dataclasses.replace(p, **kw))
  peak = lambda r: memory.peak_device_bytes(memory.estimate(r, sides=("jax",)), "jax")
  if not p.offload_opt_state or p.offload_opt_ratio < 1:
    return run, None
  on_device = peak(at(offload_opt_state=False))
  if on_device <= usable or peak(run) > usable:
    return run, None
  tried = []
  for ratio in ratios:
    chosen = at(offload_opt_ratio=ratio)
    need = peak(chosen)
    if need <= usable:
      break
    tried.append(f"{ratio:g} needs {need / GiB:.1f} GiB")
  share = opt_split(chosen).share
  return chosen, (f"jax offload_opt_ratio {ratio:g}: the smallest of {', '.join(f'{r:g}' for r in ratios)} whose "
                  f"device bytes fit ({need / GiB:.1f} GiB <= {usable / GiB:.1f} GiB usable; with the optimizer state "
                  f"on the device {on_device / GiB:.1f} GiB" + "".join(f"; {t}" for t in tried) + f"): {share:.0%} "
                  f"of the moment bytes on the host, the rest on the device (--set jax.offload_opt_ratio={ratio:g})")


def fsdp_missing_reason(plan: Plan) -> str:
  """Why a pair has no FSDP2 plan (`Plan.fsdp` None), in words `parity plan` prints: a ZeRO-0/1/2 pair (FSDP2 always
  shards the params)."""
  if plan.deepspeed.zero_stage < 3:
    return "no FSDP2 counterpart (FSDP2 always shards the params; these pairs are ZeRO-0/1/2)"
  return "no FSDP2 counterpart"


def _pair_runs(plan: Plan, jax_plan: JaxPlan, model: ModelSpec, train: TrainSpec, jax_train: TrainSpec,
               sides: tuple[str, ...]) -> dict[str, RunSpec] | str:
  """{side: the validated RunSpec it would run} of one pair for `sides`, or why the pair cannot be costed: no FSDP2
  counterpart (`fsdp_missing_reason`), or 'not runnable here: <the SpecError>'. The JAX
  and FSDP2 sides get `jax_train` (the global micro batch), DeepSpeed `train` (per rank)."""
  runs = {"deepspeed": RunSpec(model=model, train=train, deepspeed=plan.deepspeed),
          "jax": RunSpec(model=model, train=jax_train, jax=jax_plan)}
  if "fsdp" in sides:
    if plan.fsdp is None:
      return fsdp_missing_reason(plan)
    runs["fsdp"] = RunSpec(model=model, train=jax_train, fsdp=plan.fsdp, sides=("fsdp",))
  try:
    for s in sides:
      runs[s].validate()
  except SpecError as exc:
    return f"not runnable here: {exc}"
  return {s: runs[s] for s in sides}


def _costed(name: str, runs: dict, hw: Hardware, host: int, opt_ratios: tuple[float, ...], *, reserve: float,
            **kw) -> Candidate:
  """One pair's Candidate (`_candidate`), its JAX side at the smallest share of the optimizer state that fits
  (`_opt_ratio`, with the note saying why) when more than one share is tried."""
  note = None
  if "jax" in runs and len(opt_ratios) > 1:
    runs["jax"], note = _opt_ratio(runs["jax"], int(hw.device_bytes * (1 - reserve)), opt_ratios)
  cand = _candidate(name, runs, hw, host, reserve=reserve, **kw)
  if note is None:
    return cand
  return dataclasses.replace(cand, jax_opt_ratio=runs["jax"].jax.offload_opt_ratio, notes=(note,))


def _check_choice_inputs(mfu: float, devices: int, sides: tuple[str, ...], opt_ratios: tuple[float, ...]) -> None:
  """choose_plan's refusals of its inputs (its Raises), each naming the option and the fix."""
  if not (isinstance(mfu, (int, float)) and 0 < mfu <= 1):
    raise SpecError(f"mfu (--mfu) {mfu}: must be a fraction in (0, 1]")
  if devices < 1:
    raise SpecError(f"devices (--devices) {devices}: must be >= 1")
  if not sides or set(sides) - {"deepspeed", "jax", "fsdp"}:
    raise SpecError(f"sides (--sides) {','.join(sides)!r}: list deepspeed, jax and/or fsdp")
  if not opt_ratios or opt_ratios[-1] != 1 or any(not a < b for a, b in zip((0, *opt_ratios), opt_ratios)):
    raise SpecError(f"offload ratios (--opt-ratios) {','.join(f'{r:g}' for r in opt_ratios)!r}: increasing shares "
                    "in (0, 1], the last 1 (e.g. 0.25,0.5,0.75,1; 1: offload all of the optimizer state)")


def choose_plan(model: ModelSpec, train: TrainSpec, hw: Hardware, *, host_bytes: int | None = None,
                devices: int = 1, sides: tuple[str, ...] = ("deepspeed", "jax"), mfu: float = 0.4,
                reserve: float = 0.1, xla_pool_gib: int | None = None, pin_memory: bool = False,
                opt_ratios: tuple[float, ...] = OPT_RATIOS,
                tpu_premapped: int = host_limits.TPU_PREMAPPED_DEFAULT_BYTES) -> tuple[Candidate | None, list]:
  """Ranks the plan pairs of PLANS on a machine; returns (the fastest that fits or None, all, fastest first; equal
  step times by transfer time, so a pair without offload is chosen over an offload pair that is no faster). A pair
  that offloads the optimizer state runs the smallest share of it (`OPT_RATIOS`) that fits its JAX side, where the
  JAX side fits with all of it on the host and not with none (`_opt_ratio`; `Candidate.jax_opt_ratio`, `notes`).

  Args:
    model, train: what is trained; train.micro_batch_size is per device on both sides (DeepSpeed's
      `train_micro_batch_size_per_gpu`; the JAX side gets a micro batch of micro_batch_size · devices split
      over its data axis), so both sides process the same global batch.
    hw: the accelerator (memory, bf16 peak, host link bandwidth).
    host_bytes: host memory per rank, bytes; default hw.host_bytes.
    devices: data-parallel devices; plans are evaluated with jax.data_parallel = devices and DeepSpeed on
      `devices` ranks (zero3-fsdp4 only when devices == 4).
    sides: sides that must fit; a pair costs its slower side. 'fsdp': the pair's FSDP2 plan (`Plan.fsdp`) on
      `devices` ranks, the global micro batch split over them (parity.sizing.fsdp_memory); a pair without one is
      ranked last, saying so. On a TPU (hw.kind 'tpu') deepspeed and fsdp are left out, not costed: they run on a
      CUDA GPU or the host CPU, never on the chip (`off_device_sides`, `off_device_note`).
    mfu: assumed model-FLOPs utilisation of the peak.
    reserve: fraction of device memory kept for the framework, workspaces and fragmentation.
    xla_pool_gib: the user's XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (host_limits.xla_pool_setting; None: unset). On a
      GPU (hw.kind 'gpu') each JAX plan that pins host memory gets a pool by the shared rule
      (host_limits.pool_decision, `Candidate.jax_pool`); a user's pool below the need, or a pool above the host
      memory per device, is a problem (the pair does not fit). On a TPU the rule does not exist: ignored, and the
      host need is bounded by host memory only.
    pin_memory: cost DeepSpeed's offload with pin_memory true: its pinned buffers rounded as torch pins them
      (host_limits.deepspeed_pinned_cost); parity's own DeepSpeed configs are unpinned (parity.numerics.ds_json).
    opt_ratios: the shares of the optimizer state tried (`OPT_RATIOS`), increasing, the last 1; (1,): every pair
      offloads all of it, as it names.
    tpu_premapped: on a TPU, the runtime's premapped region (host_limits.tpu_premapped_setting), host memory the
      JAX side's process holds beside its state (host_limits.tpu_process_overhead).
  Raises:
    SpecError: mfu outside (0, 1], devices < 1, a side other than deepspeed/jax/fsdp, opt_ratios not increasing
      shares in (0, 1] ending at 1, a model deeper than MAX_PLAN_LAYERS, only torch sides on a TPU.
  """
  _check_choice_inputs(mfu, devices, sides, opt_ratios)
  check_plan_depth(model)
  off = off_device_sides(hw, sides)
  if off and len(off) == len(sides):
    raise SpecError(f"sides (--sides) {','.join(sides)!r} on {hw.name}: {_off_device_reason(off)}; add jax to plan "
                    "the JAX side on the TPU")
  sides = tuple(s for s in sides if s not in off)  # torch sides never run on a TPU: no TPU figures for them
  host = hw.host_bytes if host_bytes is None else host_bytes
  jax_train = dataclasses.replace(train, micro_batch_size=train.micro_batch_size * devices)
  out, seen = [], set()
  for name, plan in PLANS.items():
    if plan.jax.data_parallel not in (1, devices):
      continue
    jax_plan = dataclasses.replace(plan.jax, data_parallel=devices)
    if (plan.deepspeed, jax_plan) in seen:  # e.g. zero3 == zero3-fsdp4 on 4 devices
      continue
    seen.add((plan.deepspeed, jax_plan))
    runs = _pair_runs(plan, jax_plan, model, train, jax_train, sides)
    if isinstance(runs, str):  # a pair this run cannot use: ranked last, with the reason
      out.append(Candidate(name, math.inf, math.inf, math.inf, {s: 0 for s in sides}, {s: 0 for s in sides},
                           (runs,)))
      continue
    out.append(_costed(name, runs, hw, host, tuple(opt_ratios), mfu=mfu, reserve=reserve, ranks=devices,
                       pool_user_gib=xla_pool_gib, pin_memory=pin_memory, tpu_premapped=tpu_premapped))
  out.sort(key=lambda c: (c.step_s, c.transfer_s))  # equally fast: the pair moving less over the host link first
  best = next((c for c in out if c.fits), None)  # (a no-offload pair before any offload pair at the same step time)
  return best, out


def side_choices(ranked: list[Candidate]) -> str | None:
  """Each side's own choice: the fastest pair that fits that side alone, by its own estimated step time (a row's
  step and the pair's choice are its slowest side's, so one side's best can be another pair). None when no pair was
  costed per side."""
  sides = sorted({s for c in ranked if c.side_step_s for s in c.side_step_s})
  if not sides:
    return None
  out = []
  for side in sides:
    fitting = [c for c in ranked if c.side_step_s and side in c.side_step_s and c.side_fits(side)]
    best = min(fitting, key=lambda c: c.side_step_s[side], default=None)
    out.append(f"{side}: no plan fits" if best is None else
               f"{side}: {best.name} ({best.side_step_s[side] * 1e3:,.1f} ms/step)")
  return "each side alone, by its own estimated step time: " + "; ".join(out)


def engine_choice(ranked: list[Candidate], hw_name: str) -> str | None:
  """With both a JAX and an FSDP2 side costed: which engine trains faster by this model, each by its fastest pair
  that fits it alone (`Candidate.side_fits`, its own step time); None without both sides. "stay on PyTorch" when
  FSDP2's is faster or JAX has none, "JAX" when JAX's is, a tie said as one. An FSDP2 pair with CPUOffloadPolicy
  runs its optimizer step on the CPU, which the step-time model does not cost (nor DeepSpeed's CPU Adam): the line
  says so whenever the FSDP2 pair it names offloads."""
  best = {}
  for side in ("jax", "fsdp"):
    if not any(c.side_step_s and side in c.side_step_s for c in ranked):
      return None
    fitting = [c for c in ranked if c.side_step_s and side in c.side_step_s and c.side_fits(side)]
    best[side] = min(fitting, key=lambda c: c.side_step_s[side], default=None)
  j, f = best["jax"], best["fsdp"]
  say = lambda side, c: f"{c.name}, {c.side_step_s[side] * 1e3:.1f} ms/step"
  caveat = ("; the FSDP2 figure leaves out its optimizer step on the CPU (CPUOffloadPolicy), which this model does "
            "not cost: measure it (`parity compare --plan " + f.name + " --sides jax,fsdp`) before choosing"
            if f is not None and PLANS[f.name].fsdp is not None and PLANS[f.name].fsdp.offload else "")
  if j is None and f is None:
    return f"engine: neither JAX nor FSDP2 fits {hw_name} with any pair"
  if j is None or (f is not None and f.side_step_s["fsdp"] < j.side_step_s["jax"]):
    return ("engine, each by its own side's estimated step time (a row's step is its slowest side's): stay on PyTorch "
            f"(FSDP2 {say('fsdp', f)}): "
            + ("no JAX plan fits" if j is None else f"JAX's fastest that fits is {say('jax', j)}") + caveat)
  if f is None or j.side_step_s["jax"] < f.side_step_s["fsdp"]:
    return ("engine, each by its own side's estimated step time (a row's step is its slowest side's): JAX "
            f"({say('jax', j)}): "
            + ("no FSDP2 plan fits" if f is None else f"FSDP2's fastest that fits is {say('fsdp', f)}") + caveat)
  return ("engine, each by its own side's estimated step time (a row's step is its slowest side's): either (JAX "
          f"{say('jax', j)}; FSDP2 {say('fsdp', f)}): the same"
          + caveat)


def uncosted(ranked: list[Candidate]) -> dict[str, list[str]]:
  """The pairs not costed (not runnable here, or no FSDP2 counterpart), grouped by their reason: {reason: names}."""
  out: dict[str, list[str]] = {}
  for c in ranked:
    if not math.isfinite(c.step_s):
      out.setdefault("; ".join(c.problems), []).append(c.name)
  return out


def explain(best: Candidate | None, ranked: list[Candidate]) -> list[str]:
  """One line per costed plan cheaper than the choice (or every costed plan when none fits): why it does not fit
  (the uncosted ones: `uncosted`)."""
  lines = []
  for c in ranked:
    if best is not None and c.name == best.name:
      break
    if not math.isfinite(c.step_s):
      continue
    lines.append(f"{c.name} ({c.step_s * 1e3:.1f} ms/step) does not fit: " + "; ".join(c.problems))
  return lines


# ----------------------------------------------------------------------------- what `parity plan` takes and writes

def plan_inputs(hw: Hardware, train: TrainSpec, *, host_bytes: int | None = None, devices: int = 1,
                sides: tuple[str, ...] = ("deepspeed", "jax"), mfu: float = 0.4, reserve: float = 0.1,
                padding_fraction: float = 0.0, opt_ratios: tuple[float, ...] = OPT_RATIOS) -> dict[str, Any]:
  """What `choose_plan` assumed, JSON-ready (the same arguments): hardware name, device memory and the part usable
  after `reserve` (bytes), host memory per device (bytes), host link per direction (bytes/s), the peak at the run's
  precision (FLOP/s), MFU, devices, the sides costed on `hw`, and where some are not ('not_on_device',
  `off_device_sides`) those with the sentence saying why, the figures the preset carries unmeasured from another chip
  where it carries any ('unmeasured': field -> "unmeasured (v5e's)"), the shares of the optimizer state tried
  (opt_ratios), and the run's precision, micro batch, sequence and gradient accumulation, and the padding fraction the
  ranking's non-padding tokens/s counts with (`ranking_json`; 0: every position real).

  Raises:
    SpecError: padding_fraction (--padding-fraction) outside [0, 1).
  """
  if not (isinstance(padding_fraction, (int, float)) and 0 <= padding_fraction < 1):
    raise SpecError(f"padding fraction (--padding-fraction) {padding_fraction!r}: must be in [0, 1) (a padded or "
                    "packed run's data card gives it)")
  off = off_device_sides(hw, sides)
  return {"hardware": hw.name, "device_bytes": hw.device_bytes, "reserve": reserve,
          "usable_device_bytes": int(hw.device_bytes * (1 - reserve)),
          "host_bytes_per_device": hw.host_bytes if host_bytes is None else host_bytes,
          "host_link_bytes_per_s": hw.host_link_bytes_per_s, "peak_flops": hw.peak(train.precision), "mfu": mfu,
          "devices": devices, "sides": [s for s in sides if s not in off],
          **({"not_on_device": list(off), "not_on_device_note": off_device_note(hw, sides)} if off else {}),
          **({"unmeasured": {f: hw.unmeasured_label(f) for f in hw.unmeasured}} if hw.unmeasured else {}),
          "opt_ratios": list(opt_ratios), "precision": train.precision,
          "micro_batch_size": train.micro_batch_size, "seq_len": train.seq_len,
          "grad_accum_steps": train.grad_accum_steps, "padding_fraction": padding_fraction}


def ranking_json(best: Candidate | None, ranked: list[Candidate],
                 inputs: dict[str, Any] | None = None) -> dict[str, Any]:
  """JSON-ready ranking of `choose_plan`: {'inputs': `plan_inputs` (when given), 'choice': name or None, 'ranked':
  [Candidate fields + 'fits', and with inputs 'tokens_per_s' (every position of the global step / step_s) and
  'non_padding_tokens_per_s' (parity.sizing.batches.counted_tokens_per_s at inputs' padding_fraction)]}; an infinite
  cost (a pair this run cannot use) is None."""
  def finite(d: dict) -> dict:  # an uncosted pair's byte figures are not zero bytes: null, as its costs
    costed = math.isfinite(d["step_s"])
    return {k: (None if isinstance(v, float) and math.isinf(v) else
                {s: None for s in v} if k in ("peak_device_bytes", "host_bytes") and not costed else v)
            for k, v in d.items()}
  return {**({"inputs": inputs} if inputs is not None else {}), "choice": best.name if best else None,
          "ranked": [finite(dict(dataclasses.asdict(c), fits=c.fits, **_throughput(c, inputs))) for c in ranked]}


def _throughput(c: Candidate, inputs: dict[str, Any] | None) -> dict[str, float]:
  """{'tokens_per_s', 'non_padding_tokens_per_s'} of a candidate (inf for a pair that cannot run: None in JSON);
  {} without the plan's inputs. Padding costs the FLOPs of a real position, so only the counted share changes."""
  if inputs is None:
    return {}
  tokens = inputs["micro_batch_size"] * inputs["seq_len"] * inputs["grad_accum_steps"] * inputs["devices"]
  tps = tokens / c.step_s if c.step_s > 0 and math.isfinite(c.step_s) else math.inf
  return {"tokens_per_s": tps, "non_padding_tokens_per_s": counted_tokens_per_s(tps, inputs["padding_fraction"])}
