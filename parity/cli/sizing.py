"""`parity estimate`, `parity plan` and `parity presets`: the run through parity.pipeline.resolve.resolve_run, the
tables.

The numbers come from parity.sizing.memory (estimate_json, totals, step_rows) and parity.sizing.plans (choose_plan,
explain, ranking_json); this module only parses options and prints.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re

from parity.cli._common import (EXIT_FAIL, EXIT_OK, add_run_source, check_json_target, console, float_arg, int_arg,
                                split_list)
from parity.inputs import ascii_number
from parity.presets import DEFAULT_PRESET
from parity.overrides import parse_overrides
from parity.spec import SpecError
from parity.weights import n_params
from parity.pipeline.resolve import resolve_run
from parity.sizing.plans import HARDWARE, check_plan_depth, plan_of
from parity.sizing import host_limits, memory, plans
from parity.cli._common import Failure
from parity.hf import MODEL_PRESETS, PUBLISHED_PARAM_COUNTS
from parity.hf.presets import HF_REPOS
from parity.presets import PRESETS
from parity.side_plans import describe_plans, side_plans
from parity.spec import to_dict

__all__ = ["register"]

PLAN_EXITS = """exit status:
  0  a plan pair fits; the table marks it 'chosen'
  1  no plan pair fits the device and host memory (the lines below the table say why for each);
     try more --devices, a smaller --micro-batch or --seq-len, or more memory
  2  bad input (an unknown preset, model, hardware or side; a value out of range)"""


def _add_run_source(p: argparse.ArgumentParser, model_default: str) -> None:
  """--preset | --model, --config, --set, --micro-batch, --seq-len, --precision: what resolve_run takes."""
  src = p.add_mutually_exclusive_group()
  src.add_argument("--preset", help=f"a run preset, e.g. gpt2-tiny (default: {model_default}); see `parity presets`")
  src.add_argument("--model", help="a model-size preset, e.g. gpt2-124m, llama-3.1-8b, qwen3-8b, gemma-3-27b (or its "
                                   "Hugging Face name: Llama-3.1-8B), with micro batch 1, sequence min(2048, max) and "
                                   f"bf16 unless given (default: {model_default}); see `parity presets`")
  add_run_source(p, set_example="--set model.n_layers=4", preset=False)  # --preset is exclusive with --model here
  p.add_argument("--micro-batch", type=int_arg, help="sequences per micro batch per device (default: the preset's; a "
                                                 "--model: 1)")
  p.add_argument("--seq-len", type=int_arg,
                 help="tokens per sequence (default: the preset's; a --model: min(2048, max))")
  p.add_argument("--precision", choices=("fp32", "bf16", "fp16"),
                 help="compute precision (default: the preset's; a --model: bf16)")


def _resolve(args: argparse.Namespace, *, default_model: str | None, plan: str | None = None, **train):
  """The run `plan` / `estimate` cost; one deeper than plans.MAX_PLAN_LAYERS is refused (SpecError) first."""
  model = args.model if args.model or args.preset or args.config else default_model
  spec = resolve_run(args.preset, model=model, config=args.config, plan=plan, micro_batch=args.micro_batch,
                     seq_len=args.seq_len, precision=args.precision, overrides=parse_overrides(args.overrides),
                     **train).spec
  check_plan_depth(spec.model)
  return spec


def register(sub) -> None:
  """Adds `estimate`, `plan` and `presets` to the subparsers `sub`."""
  p = sub.add_parser("estimate", help="memory model: bytes per category and memory kind, DeepSpeed, JAX and FSDP2, "
                                      "with DeepSpeed's own estimator figures",
                     description="Estimates the bytes of params, gradients, fp32 master, optimizer moments and "
                                 "activations per rank, on the device and on the host, for the DeepSpeed, the JAX "
                                 "and the FSDP2 side of a run, next to DeepSpeed's own "
                                 "estimate_zero*_model_states_mem_needs (docs/plans.md). Exit 0, or 2 on bad input.")
  _add_run_source(p, DEFAULT_PRESET)
  p.add_argument("--plan", help="a plan pair of `parity plan` (parity.sizing.plans.PLANS) (default: the run's own "
                                "plans)")
  p.add_argument("--ranks", type=int_arg, default=1, help="data-parallel ranks of the DeepSpeed and the FSDP2 side")
  p.add_argument("--json", metavar="FILE", help="also write the rows and DeepSpeed's figures as JSON (default: none)")
  p.add_argument("--force", action="store_true", help="let --json FILE replace an existing file (default off: an "
                                                      "existing file is refused, exit 2)")
  p.set_defaults(handler=run_estimate)

  p = sub.add_parser("plan", help="choose the sharding/offload/remat plan that fits a device and is fastest",
                     description="Ranks every plan pair (DeepSpeed <-> JAX, and FSDP2 with --sides ...,fsdp) by the "
                                 "memory model and a roofline step "
                                 "time on the given hardware and chooses the fastest that fits (docs/plans.md).",
                     epilog=PLAN_EXITS, formatter_class=argparse.RawDescriptionHelpFormatter)
  _add_run_source(p, "llama-7b")
  p.add_argument("--grad-accum", type=int_arg, help="micro batches per optimizer step (default: the preset's; a "
                                                "--model: 1)")
  p.add_argument("--hardware", choices=sorted(HARDWARE), default="H100", help="accelerator preset")
  p.add_argument("--device-memory", type=size_gib,
                 help="device memory: GiB, or a size such as 80GB, 80GiB (default: --hardware's)")
  p.add_argument("--host-memory", type=host_size,
                 help="host memory per device: GiB, a size such as 512GB, or 'here' (this machine: the smaller of "
                      "MemAvailable and the cgroup limit, over --devices) (default: --hardware's)")
  p.add_argument("--pin-memory", action="store_true",
                 help="cost DeepSpeed's offload with pin_memory true: torch pins each host buffer as a power of two "
                      "(default off: parity's DeepSpeed configs are unpinned)")
  p.add_argument("--bandwidth", type=float_arg,
                 help="host<->device bandwidth per direction, GB/s (default: --hardware's)")
  p.add_argument("--peak-tflops", type=float_arg, help="peak at the run's precision, TFLOP/s (default: --hardware's; "
                                                   "fp32 runs use its fp32 peak)")
  p.add_argument("--mfu", type=float_arg, default=0.4, help="assumed model-FLOPs utilisation, in (0, 1]")
  p.add_argument("--devices", type=int_arg, default=1, help="data-parallel devices")
  p.add_argument("--sides", default="deepspeed,jax", help="sides that must fit, comma-separated")
  p.add_argument("--opt-ratios", default="0.25,0.5,0.75,1", help="shares of the optimizer state a pair that offloads "
                 "it may offload (jax.offload_opt_ratio), increasing, the last 1; '1': all of it (default %(default)s)")
  p.add_argument("--padding-fraction", type=float_arg, default=0.0,
                 help="share of padding positions of a padded/packed run (its data card's padding_fraction), in "
                      "[0, 1): the ranking also gives tokens/s of the real positions (default 0)")
  p.add_argument("--json", metavar="FILE", help="also write the ranking as JSON (default: none)")
  p.add_argument("--force", action="store_true", help="let --json FILE replace an existing file (default off: an "
                                                      "existing file is refused, exit 2)")
  p.set_defaults(handler=run_plan)

  p = sub.add_parser("presets", help="list the built-in run presets and the model-size presets",
                     description="Lists the run presets (`--preset`: a whole run, small enough for a CPU) and the "
                                 "model-size presets (`--model` of estimate and plan: real model shapes).")
  p.add_argument("-v", "--verbose", action="store_true", help="also print each run preset in full (default off)")
  p.set_defaults(handler=run_presets)


UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
"""Binary units, largest first; a table uses the largest one its biggest figure reaches (`table_unit`)."""


def table_unit(values) -> tuple[str, int]:
  """(name, bytes) of the largest unit of UNITS that the largest of `values` (bytes; None ignored) reaches, so a small
  run's figures read as 471.000 KiB rather than 0.000 GiB."""
  top = max((v for v in values if v), default=0)
  return next(((name, b) for name, b in UNITS if top >= b), UNITS[-1])


def _in(n: int | None, unit: tuple[str, int], spec: str = ",.3f") -> str:
  """`n` bytes in `unit`; '-' for None; a non-zero figure too small to show is '<0.001' (never a bare 0)."""
  if n is None:
    return "-"
  if unit[1] == 1:
    return f"{n:,}"
  text = format(n / unit[1], spec)
  return f"<{format(0, spec)[:-1]}1" if n and float(text.replace(",", "")) == 0 else text


def human_bytes(n: int) -> str:
  """`n` bytes in its own unit of UNITS: '12.551 GiB', '471.000 KiB'."""
  unit = table_unit([n])
  return f"{_in(n, unit)} {unit[0]}"


def plan_label(run, plans) -> str:
  """The plan pair's name and what `plans` (side -> plan: parity.side_plans.side_plans) set, in the plans' own words
  (parity.side_plans.describe_plans): 'plan zero2-offload (DeepSpeed ...; JAX ...)'; a run whose plans are no named
  pair says so."""
  name = plan_of(run)
  return f"{f'plan {name}' if name else 'own plans (no named pair)'} ({describe_plans(plans)})"


def run_estimate(args: argparse.Namespace) -> int:
  """`parity estimate`: the per-category model for both sides and DeepSpeed's own figures. Returns 0.

  Raises:
    SpecError: an unknown preset, model or plan, a value out of range (main exits 2).
  """
  from rich.table import Table  # rich: loaded when a table is printed
  if args.ranks < 1:
    raise SpecError(f"--ranks {args.ranks}: must be >= 1")
  check_json_target(args.json, args.force)
  run = _resolve(args, default_model=None, plan=args.plan)
  out = memory.estimate_json(run, args.ranks)
  sides = memory.estimate_sides()
  rows = memory.estimate(run, ranks=args.ranks, sides=sides)
  t = run.train
  tot = {s: memory.totals(rows, s) for s in sides}
  steps = memory.step_rows(rows, sides)
  peaks = [out[f"peak_{w}_bytes"][s] for s in sides for w in ("device", "host")]
  unit = table_unit([*peaks, *(c for _, cells in steps for c in cells)])
  ranks = f"{args.ranks} rank{'s' * (args.ranks > 1)}"
  per = -(-t.micro_batch_size // args.ranks)
  split = ("the whole micro batch" if args.ranks == 1 else
           "the micro batch split over them" if t.micro_batch_size % args.ranks == 0 else
           f"micro batch {t.micro_batch_size} does not split over {ranks} (compare --nproc {args.ranks} refuses "
           f"it; --micro-batch {args.ranks * per} would): counted as {per} sequence{'s' * (per > 1)} each")
  plans = side_plans(run, sides)
  fsdp = plans.pop("fsdp", None)  # FSDP2's plan is said with its ranks and split, beside them
  table = Table(title=f"{out['total_params']:,} params, micro batch {t.micro_batch_size} x {t.seq_len} tokens, "
                      f"{t.precision}, {plan_label(run, plans)}, DeepSpeed on {ranks}"
                      + (" (that micro batch on each: train_micro_batch_size_per_gpu)" if args.ranks > 1 else "")
                      + (f"; FSDP2 ({fsdp.describe()}) on {ranks}" if fsdp is not None else "")
                      + f", {split} ({unit[0]} per rank)")
  for col in ("category", *(f"{s} {k}" for s in sides for k in memory.KINDS)):
    table.add_column(col, justify="left" if col == "category" else "right")
  for cat in memory.CATEGORIES:
    table.add_row(cat, *(_in(tot[s][cat][k], unit) for s in sides for k in memory.KINDS))
  for label, cells in steps:
    table.add_row(label, *(_in(c, unit) for c in cells))
  table.add_row("peak device / host", *(_in(c, unit) for c in peaks))
  con = console()
  con.print(table)
  for line in estimator_lines(out, t.precision):
    con.print(line, highlight=False)
  if args.json:
    _write_json(args.json, out)
  return EXIT_OK


def estimator_lines(out: dict, precision: str) -> list[str]:
  """The lines under `parity estimate`'s table: DeepSpeed's own estimator with its formula, and this model's
  DeepSpeed figures of the same scope as the sum of their terms, so the two can be set side by side."""
  ds, rel = out["deepspeed_estimator"], out["deepspeed_estimator"]["relation"]
  g = out["ranks"]
  def terms(kind: str) -> str:
    parts = [f"{r['category']}" + (f" ({r['note']})" if r["note"] else "") + f" {human_bytes(r['bytes'])}"
             for r in rel["rows"] if r["kind"] == kind]
    return " + ".join(parts) or "0"
  lines = [f"DeepSpeed's own estimator, {ds['call']} (model states only; gpu per GPU, cpu per node of "
           f"{g} GPU{'s' * (g > 1)}):",
           f"  gpu {human_bytes(ds['gpu_bytes'])} = {ds['gpu_formula']}",
           f"  cpu {human_bytes(ds['cpu_bytes'])} = {ds['cpu_formula']}; 1.5 is its additional_buffer_factor, a "
           f"safety margin: without it {human_bytes(rel['estimator_host_unfactored_bytes'])}",
           f"This model's DeepSpeed side, the same scope (the tensors DeepSpeed 0.19.8 allocates, no safety factor, "
           f"no activations; host per node of {g} rank{'s' * (g > 1)}):",
           f"  device {human_bytes(rel['device_bytes'])} = {terms('device')}",
           f"  host {human_bytes(rel['host_bytes'])} = {terms('host')}"]
  diff = rel["host_minus_unfactored_bytes"]
  lines.append(f"  host vs the estimator's cpu without its factor: {'+' if diff >= 0 else '-'}"
               f"{human_bytes(abs(diff))}; vs its cpu figure: {human_bytes(rel['host_bytes'])} against "
               f"{human_bytes(ds['cpu_bytes'])} (docs/plans.md, 'Where this differs from DeepSpeed's estimator')")
  if precision == "fp32":
    lines.append("  the estimator assumes 2-byte (fp16) params and gradients; this run is fp32, 4 bytes each")
  return lines


def run_plan(args: argparse.Namespace) -> int:
  """`parity plan`: every plan pair's cost, the choice, and why cheaper ones do not fit.

  Returns 0 when a plan fits, 1 when none does. Raises SpecError on bad input (main exits 2).
  """
  from rich.table import Table  # rich: loaded when a table is printed
  sides = _plan_sides(args.sides)
  check_json_target(args.json, args.force)
  run = _resolve(args, default_model="llama-7b", grad_accum=args.grad_accum)
  hw = _plan_hardware(args)
  # XLA's GPU pinned-host pool variable: read on a GPU only (a bad value: SpecError naming it, exit 2); a TPU has none
  pool_gib = host_limits.xla_pool_setting(os.environ) if hw.kind == "gpu" else None
  # a TPU's premapped host region (TPU_PREMAPPED_BUFFER_SIZE; a bad value: SpecError naming it, exit 2)
  region = (host_limits.tpu_premapped_setting(os.environ) if hw.kind == "tpu"
            else host_limits.TPU_PREMAPPED_DEFAULT_BYTES)
  ratios = _opt_ratios(args.opt_ratios)
  best, ranked = plans.choose_plan(run.model, run.train, hw, devices=args.devices, sides=sides, mfu=args.mfu,
                                   xla_pool_gib=pool_gib, pin_memory=args.pin_memory, opt_ratios=ratios,
                                   tpu_premapped=region)
  inputs = plans.plan_inputs(hw, run.train, devices=args.devices, sides=sides, mfu=args.mfu,
                             padding_fraction=args.padding_fraction, opt_ratios=ratios)
  unit = table_unit([b for c in ranked for d in (c.peak_device_bytes, c.host_bytes) for b in d.values()])
  table = Table(title=f"{memory.param_count(run.model):,} params, {run.train.tokens_per_step:,} tokens/step per "
                      f"device, {run.train.precision}, on {args.devices} x {hw.name}: {plan_header(inputs)}")
  # fits the terminal's width: short stacked headers, one column per side (device / host), plan names whole
  # a unit that shows them
  tu = next(((n, f) for n, f in (("s", 1), ("ms", 1e3), ("µs", 1e6)) if max(
      (c.step_s for c in ranked if math.isfinite(c.step_s)), default=1) * f >= 1), ("µs", 1e6))
  t = lambda x: "-" if not math.isfinite(x) else f"{x * tu[1]:.3f}"
  costed_sides = tuple(inputs["sides"])  # on a TPU the torch sides are not costed (plans.off_device_sides)
  for col in ("plan", f"step\n{tu[0]}", f"compute\n{tu[0]}", f"transfer\n{tu[0]}",
              *(f"{s} {unit[0]}\ndevice/host" for s in costed_sides), "fits"):
    table.add_column(col, justify="left" if col in ("plan", "fits") else "right", overflow="fold",
                     no_wrap=col == "plan")
  for c in ranked:
    mark = "[bold green]chosen[/]" if best is not None and c.name == best.name else ("yes" if c.fits else "no")
    costed = math.isfinite(c.step_s)  # a pair not runnable here (or with no FSDP2 counterpart) was not costed
    ratio = f" (jax ratio {c.jax_opt_ratio:g})" if c.jax_opt_ratio not in (None, 1.0) else ""
    table.add_row(c.name + ratio, t(c.step_s), t(c.compute_s), t(c.transfer_s),
                  *(f"{_in(c.peak_device_bytes[s], unit, ',.1f')} / {_in(c.host_bytes[s], unit, ',.1f')}"
                    if costed else "-" for s in costed_sides), mark if costed else "not costed")
  con = console()
  con.print(table)
  _plan_notes(con, args, hw, best, ranked, inputs, pool_gib)
  if args.json:
    pool_env = host_limits.XLA_POOL_ENV if hw.kind == "gpu" else None  # TPU: no such variable
    _write_json(args.json, {**plans.ranking_json(best, ranked, inputs),
                            "host_limits": {"hardware_kind": hw.kind, "xla_pool_env": pool_env,
                                            "xla_pool_user_gib": pool_gib, "pin_memory": args.pin_memory}})
  return EXIT_OK if best else EXIT_FAIL


def _plan_notes(con, args: argparse.Namespace, hw, best, ranked, inputs: dict, pool_gib: int | None) -> None:
  """The lines under `parity plan`'s table: the choice (and, when it keeps nothing on the host, that it needs no
  offload), its throughput, each side's and the engine's choice, the host limits, why cheaper pairs do not fit."""
  if inputs.get("not_on_device_note"):
    con.print(inputs["not_on_device_note"], highlight=False)
  no_offload = best is not None and math.isfinite(best.step_s) and not any(best.host_bytes.values())
  con.print(f"choice: {best.name} — {plans.PLANS[best.name].description}"
            + (f"; it needs no offload on {hw.name}, and no offload pair is faster" if no_offload else "") if best else
            "[red]no plan fits[/red] (exit 1): more devices, a smaller micro batch or sequence, or more memory")
  if best is not None:
    for note in best.notes:
      con.print(f"  {note}", highlight=False)
    tput = next(r for r in plans.ranking_json(best, ranked, inputs)["ranked"] if r["name"] == best.name)
    con.print(f"estimated throughput of {best.name}: {tput['tokens_per_s']:,.0f} tokens/s"
              + (f", {tput['non_padding_tokens_per_s']:,.0f} of them real positions (padding fraction "
                 f"{args.padding_fraction:g}: padding costs the FLOPs of a real position)"
                 if args.padding_fraction else ""), highlight=False)
  per_side = plans.side_choices(ranked)
  if per_side:
    con.print(per_side, highlight=False)
  engine = plans.engine_choice(ranked, f"{args.devices} x {hw.name}")
  if engine:
    con.print(engine, highlight=False)
  for line in host_lines(best, pool_gib, inputs["host_bytes_per_device"], kind=hw.kind):
    con.print(line, highlight=False)
  for line in plans.explain(best, ranked):
    con.print("  " + line)
  for why, names in plans.uncosted(ranked).items():
    con.print(f"  not costed: {', '.join(names)}: {why}", highlight=False)


def _plan_hardware(args: argparse.Namespace):
  """--hardware with the figures given replaced (plans.custom_hardware), named as the user gave the device memory:
  their memory, the preset's compute and link ('H100 with 80GB of device memory')."""
  hw = plans.custom_hardware(plans.HARDWARE[args.hardware], device_gib=args.device_memory,
                             host_gib=host_gib(args.host_memory, args.devices), bandwidth_gbs=args.bandwidth,
                             peak_tflops=args.peak_tflops)
  if args.device_memory is not None:
    given = getattr(args.device_memory, "given", "") or f"{args.device_memory:g} GiB"
    hw = dataclasses.replace(hw, name=f"{args.hardware} with {given} of device memory (--device-memory)")
  return hw


def host_lines(best, user_gib: int | None, host_bytes: int, kind: str = "gpu") -> list[str]:
  """The chosen plan's host limits as `parity plan` prints them: on a GPU the JAX side's pinned-host requirement and
  the pool setting it will use (PoolDecision.statement) against `host_bytes` per device; on a TPU (`kind`) its host
  bytes against host memory alone (XLA's GPU pool does not exist there); DeepSpeed's pinned rounding (with
  --pin-memory)."""
  if best is None:
    return []
  out = []
  if kind != "gpu":
    if "jax" in best.host_bytes:
      need = best.host_bytes["jax"]
      keeps = f"keeps {human_bytes(need)} per device in host memory, within" if need else "keeps nothing on the host of"
      out.append(f"host memory of {best.name}: the JAX side {keeps} the {host_bytes / 2**30:,.0f} GiB host memory "
                 "per device; a TPU has no pinned-host pool limit of its own, so host memory is the only bound")
  elif best.jax_pool:
    gib = best.jax_pool["gib"]
    fits = (f"; the {gib} GiB pool, one per GPU, fits the {host_bytes / 2**30:,.0f} GiB host memory per device"
            if gib * 2**30 <= host_bytes else "")
    out.append(f"pinned host of {best.name}: {best.jax_pool['statement']}{fits}")
  elif "jax" in best.host_bytes:
    out.append(f"pinned host of {best.name}: the JAX side pins no host memory; "
               f"{host_limits.XLA_POOL_ENV} {'is ' + str(user_gib) if user_gib else 'is not set'}")
  if best.deepspeed_pinned:
    d = best.deepspeed_pinned
    out.append(f"pinned host of {best.name}, DeepSpeed (pin_memory): {human_bytes(d['requested_bytes'])} of buffers "
               f"pin {human_bytes(d['pinned_bytes'])} (torch rounds each to a power of two), counted in its host "
               "figure")
  return out


_SIZE_UNITS = {"": 2**30, "gib": 2**30, "gb": 10**9, "tib": 2**40, "tb": 10**12, "mib": 2**20, "mb": 10**6}


class Size(float):
  """A size flag's value in GiB that remembers how the user wrote it (`given`: '80GB'), for output naming it."""
  given: str = ""


def size_gib(text: str) -> float:
  """A memory size flag's value in GiB (argparse `type`): a bare number is GiB; a suffix GB/TB/MB is decimal, GiB/TiB/
  MiB binary ('80GB' -> 74.5). A non-finite or non-positive figure is returned as is: the CLI's number rule and
  plans.custom_hardware refuse it naming the flag. Raises argparse.ArgumentTypeError for text that is no size."""
  m = re.fullmatch(r"\s*([-+]?(?:[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?|inf|infinity|nan))\s*([A-Za-z]*)\s*", str(text),
                   flags=re.IGNORECASE)
  unit = m.group(2).lower() if m else None
  if m is None or unit not in _SIZE_UNITS:
    raise argparse.ArgumentTypeError(f"{text!r}: give GiB as a number (80) or a size with a unit (80GB, 80GiB, 1TB)")
  size = Size(float(m.group(1)) * _SIZE_UNITS[unit] / 2**30)
  size.given = str(text).strip() + ("" if unit else " GiB")
  return size


def host_size(text: str) -> float | str:
  """--host-memory's argparse `type`: 'here', or a size (`size_gib`)."""
  return "here" if str(text).strip().lower() == "here" else size_gib(text)


def host_gib(value: float | str | None, devices: int) -> float | None:
  """--host-memory in GiB per device: a size (`host_size`), or 'here': this machine's available memory (the smaller
  of MemAvailable and the cgroup limit less its working set, host_limits.host_memory) over `devices`."""
  if value != "here":
    return value
  avail = host_limits.host_memory().available_bytes
  if avail is None:
    raise SpecError("--host-memory here: neither /proc/meminfo MemAvailable nor a cgroup memory limit can be read "
                    "on this machine; give the host memory per device in GiB")
  return avail / max(1, devices) / 2**30


def plan_header(inputs: dict) -> str:
  """The assumptions of `parity plan` in one line (`parity.sizing.plans.plan_inputs`): device memory and the part
  usable after the reserve, host memory per device, host link, peak at the run's precision, MFU; a figure the preset
  carries from another chip is marked so ('unmeasured (v5e's)'), as is the overlap of copies with compute."""
  GiB, GB = 2**30, 10**9
  borrowed = inputs.get("unmeasured") or {}
  link = borrowed.get("host_link_bytes_per_s")
  overlap = borrowed.get("hidden_transfer")
  return (f"{inputs['device_bytes'] / GiB:,.1f} GiB device memory ({inputs['usable_device_bytes'] / GiB:,.1f} usable "
          f"after a {inputs['reserve']:.0%} reserve), {inputs['host_bytes_per_device'] / GiB:,.0f} GiB host memory per "
          f"device, {inputs['host_link_bytes_per_s'] / GB:,.0f} GB/s host link per direction"
          + (f" ({link})" if link else "") + (f", host copies in series with compute ({overlap})" if overlap else "")
          + f", peak {inputs['peak_flops'] / 1e12:,.1f} TFLOP/s ({inputs['precision']}), MFU {inputs['mfu']:g}")


def _opt_ratios(text: str) -> tuple[float, ...]:
  """`plan --opt-ratios`: comma-separated numbers (choose_plan checks their range and order). Raises SpecError."""
  try:
    return tuple(ascii_number(x, float) for x in str(text).split(","))
  except ValueError:
    raise SpecError(f"--opt-ratios {text!r}: comma-separated shares in (0, 1], increasing, the last 1 (e.g. "
                    "0.25,0.5,0.75,1; 1: offload all of the optimizer state)") from None


def _plan_sides(text: str) -> tuple[str, ...]:
  """`plan --sides`: comma-separated, no empty entry, no side twice (choose_plan checks the names). Raises SpecError."""
  if any(not x.strip() for x in str(text).split(",")):
    raise SpecError(f"--sides {text!r}: an empty entry; give comma-separated names out of deepspeed, jax, fsdp")
  sides = tuple(split_list(text))
  if len(set(sides)) != len(sides):
    raise SpecError(f"--sides {text}: lists a side twice; give each of deepspeed, jax, fsdp once")
  return sides


def _write_json(path: str, data) -> None:
  """Writes `data` as JSON; an OSError reaches main as a Failure naming the file (exit 1)."""
  try:
    with open(path, "w", encoding="utf-8") as f:
      json.dump(data, f, indent=1)
  except OSError as exc:
    raise Failure(f"--json {path}: cannot write ({exc.strerror or exc}); the table above is complete") from None


def run_presets(args: argparse.Namespace) -> int:
  """`parity presets`: run presets (name, size, training) and model-size presets (parity.hf.MODEL_PRESETS)."""
  con = console()
  con.print("[bold]run presets[/bold] (--preset of compare, diagnose, estimate, plan):")
  for name, spec in PRESETS.items():
    m, t = spec.model, spec.train
    con.print(f"  [bold]{name}[/bold]{' (default)' if name == DEFAULT_PRESET else ''}: {n_params(m) / 1e6:.2f} M "
              f"params, {m.n_layers} layers × d_model {m.d_model}, seq {t.seq_len}, batch {t.micro_batch_size}×"
              f"{t.grad_accum_steps}, {t.steps} steps")
    if args.verbose:
      con.print_json(json.dumps(to_dict(spec)))
  con.print("[bold]model-size presets[/bold] (--model of estimate and plan; memory and time models only):")
  for name, m in MODEL_PRESETS.items():
    n = PUBLISHED_PARAM_COUNTS.get(name, n_params(m))
    con.print(f"  [bold]{name}[/bold]: {n / 1e9:.3g} B params, {m.n_layers} layers × d_model {m.d_model}, "
              f"{m.n_heads} heads{f' ({m.n_kv_heads} kv)' if m.n_kv_heads and m.n_kv_heads != m.n_heads else ''}"
              f"{f' of {m.d_head}' if m.d_head is not None else ''}, {m.mlp} MLP, vocab {m.vocab_size:,}, max seq "
              f"{m.max_seq_len}{f', window {m.sliding_window}' if m.sliding_window is not None else ''}"
              f"{f' ({HF_REPOS[name]})' if name in HF_REPOS else ''}")
  return EXIT_OK
