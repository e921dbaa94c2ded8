"""`parity estimate`, `parity plan` and `parity presets`: the run through parity.pipeline.resolve.resolve_run, the tables.

The numbers come from parity.sizing.memory (estimate_json, totals, step_rows) and parity.sizing.plans (choose_plan, explain,
ranking_json); this module only parses options and prints.
"""
from __future__ import annotations

import argparse
import json

from parity.cli._common import EXIT_FAIL, EXIT_OK, add_run_source, console, split_list
from parity.presets import DEFAULT_PRESET
from parity.spec import parse_overrides, SpecError
from parity.weights import n_params

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
  src.add_argument("--model", help="a model-size preset, e.g. gpt2-124m, llama-7b, with micro batch 1, sequence "
                                   "min(2048, max) and bf16 unless given (default: "
                                   f"{model_default}); see `parity presets`")
  add_run_source(p, set_example="--set model.n_layers=4", preset=False)  # --preset is exclusive with --model here
  p.add_argument("--micro-batch", type=int, help="sequences per micro batch per device (default: the preset's; a "
                                                 "--model: 1)")
  p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's; a --model: min(2048, max))")
  p.add_argument("--precision", choices=("fp32", "bf16", "fp16"),
                 help="compute precision (default: the preset's; a --model: bf16)")


def _resolve(args: argparse.Namespace, *, default_model: str | None, plan: str | None = None, **train):
  from parity.pipeline.resolve import resolve_run
  model = args.model if args.model or args.preset or args.config else default_model
  return resolve_run(args.preset, model=model, config=args.config, plan=plan, micro_batch=args.micro_batch,
                     seq_len=args.seq_len, precision=args.precision, overrides=parse_overrides(args.overrides),
                     **train).spec


def register(sub) -> None:
  """Adds `estimate`, `plan` and `presets` to the subparsers `sub`."""
  p = sub.add_parser("estimate", help="memory model: bytes per category and memory kind, both sides, with "
                                      "DeepSpeed's own estimator figures",
                     description="Estimates the bytes of params, gradients, fp32 master, optimizer moments and "
                                 "activations per rank, on the device and on the host, for the DeepSpeed and the JAX "
                                 "side of a run, next to DeepSpeed's own estimate_zero*_model_states_mem_needs "
                                 "(docs/plans.md). Exit 0, or 2 on bad input.")
  _add_run_source(p, DEFAULT_PRESET)
  p.add_argument("--plan", help="a plan pair of `parity plan` (parity.sizing.plans.PLANS) (default: the run's own plans)")
  p.add_argument("--ranks", type=int, default=1, help="data-parallel ranks of the DeepSpeed side")
  p.add_argument("--json", metavar="FILE", help="also write the rows and DeepSpeed's figures as JSON (default: none)")
  p.set_defaults(handler=run_estimate)

  from parity.sizing.plans import HARDWARE
  p = sub.add_parser("plan", help="choose the sharding/offload/remat plan that fits a device and is fastest",
                     description="Ranks every DeepSpeed <-> JAX plan pair by the memory model and a roofline step "
                                 "time on the given hardware and chooses the fastest that fits (docs/plans.md).",
                     epilog=PLAN_EXITS, formatter_class=argparse.RawDescriptionHelpFormatter)
  _add_run_source(p, "llama-7b")
  p.add_argument("--grad-accum", type=int, help="micro batches per optimizer step (default: the preset's; a "
                                                "--model: 1)")
  p.add_argument("--hardware", choices=sorted(HARDWARE), default="H100", help="accelerator preset")
  p.add_argument("--device-memory", type=float, help="device memory, GiB (default: --hardware's)")
  p.add_argument("--host-memory", type=float, help="host memory per device, GiB (default: --hardware's)")
  p.add_argument("--bandwidth", type=float, help="host<->device bandwidth per direction, GB/s (default: --hardware's)")
  p.add_argument("--peak-tflops", type=float, help="peak at the run's precision, TFLOP/s (default: --hardware's; "
                                                   "fp32 runs use its fp32 peak)")
  p.add_argument("--mfu", type=float, default=0.4, help="assumed model-FLOPs utilisation, in (0, 1]")
  p.add_argument("--devices", type=int, default=1, help="data-parallel devices")
  p.add_argument("--sides", default="deepspeed,jax", help="sides that must fit, comma-separated")
  p.add_argument("--json", metavar="FILE", help="also write the ranking as JSON (default: none)")
  p.set_defaults(handler=run_plan)

  p = sub.add_parser("presets", help="list the built-in run presets and the model-size presets",
                     description="Lists the run presets (`--preset`: a whole run, small enough for a CPU) and the "
                                 "model-size presets (`--model` of estimate and plan: real model shapes).")
  p.add_argument("-v", "--verbose", action="store_true", help="also print each run preset in full (default off)")
  p.set_defaults(handler=run_presets)


def _gib(n: int | None) -> str:
  return "-" if n is None else f"{n / 2**30:,.3f}"


def run_estimate(args: argparse.Namespace) -> int:
  """`parity estimate`: the per-category model for both sides and DeepSpeed's own figures. Returns 0.

  Raises:
    SpecError: an unknown preset, model or plan, a value out of range (main exits 2).
  """
  from rich.table import Table
  from parity.sizing import memory
  if args.ranks < 1:
    raise SpecError(f"--ranks {args.ranks}: must be >= 1")
  run = _resolve(args, default_model=None, plan=args.plan)
  out = memory.estimate_json(run, args.ranks)
  rows = memory.estimate(run, ranks=args.ranks)
  t = run.train
  table = Table(title=f"{out['total_params']:,} params, micro batch {t.micro_batch_size} x {t.seq_len} tokens, "
                      f"{t.precision} (GiB per rank)")
  for col in ("category", "deepspeed device", "deepspeed host", "jax device", "jax host"):
    table.add_column(col, justify="left" if col == "category" else "right")
  tot = {s: memory.totals(rows, s) for s in ("deepspeed", "jax")}
  for cat in memory.CATEGORIES:
    table.add_row(cat, *(_gib(tot[s][cat][k]) for s in ("deepspeed", "jax") for k in memory.KINDS))
  for label, cells in memory.step_rows(rows):
    table.add_row(label, *(_gib(c) for c in cells))
  table.add_row("peak device / host", *(_gib(out[f"peak_{w}_bytes"][s]) for s in ("deepspeed", "jax")
                                        for w in ("device", "host")))
  con = console()
  con.print(table)
  ds = out["deepspeed_estimator"]
  con.print(f"DeepSpeed's {ds['function']} (model states only, fp16 params, buffer factor 1.5): "
            f"gpu {_gib(ds['gpu_bytes'])} GiB, cpu {_gib(ds['cpu_bytes'])} GiB")
  if args.json:
    _write_json(args.json, out)
  return EXIT_OK


def run_plan(args: argparse.Namespace) -> int:
  """`parity plan`: every plan pair's cost, the choice, and why cheaper ones do not fit.

  Returns 0 when a plan fits, 1 when none does. Raises SpecError on bad input (main exits 2).
  """
  from rich.table import Table
  from parity.sizing import memory
  from parity.sizing import plans
  sides = tuple(split_list(args.sides))
  run = _resolve(args, default_model="llama-7b", grad_accum=args.grad_accum)
  hw = plans.custom_hardware(plans.HARDWARE[args.hardware], device_gib=args.device_memory, host_gib=args.host_memory,
                             bandwidth_gbs=args.bandwidth, peak_tflops=args.peak_tflops)
  best, ranked = plans.choose_plan(run.model, run.train, hw, devices=args.devices, sides=sides, mfu=args.mfu)
  GiB, GB = plans.GiB, plans.GB
  table = Table(title=f"{memory.param_count(run.model):,} params, {run.train.tokens_per_step:,} tokens/step per "
                      f"device on {args.devices} x {hw.name} ({hw.device_bytes / GiB:.0f} GiB, "
                      f"{hw.host_link_bytes_per_s / GB:.0f} GB/s host link, MFU {args.mfu})")
  # fits the terminal's width: short stacked headers, one column per side (device / host GiB), plan names whole
  for col in ("plan", "step\ns", "compute\ns", "transfer\ns", *(f"{s} GiB\ndevice/host" for s in sides), "fits"):
    table.add_column(col, justify="left" if col in ("plan", "fits") else "right", overflow="fold",
                     no_wrap=col == "plan")
  for c in ranked:
    mark = "[bold green]chosen[/]" if best is not None and c.name == best.name else ("yes" if c.fits else "no")
    table.add_row(c.name, f"{c.step_s:.3f}", f"{c.compute_s:.3f}", f"{c.transfer_s:.3f}",
                  *(f"{c.peak_device_bytes[s] / GiB:.1f} / {c.host_bytes[s] / GiB:.1f}" for s in sides), mark)
  con = console()
  con.print(table)
  con.print(f"choice: {best.name} — {plans.PLANS[best.name].description}" if best else
            "[red]no plan fits[/red] (exit 1): more devices, a smaller micro batch or sequence, or more memory")
  for line in plans.explain(best, ranked):
    con.print("  " + line)
  if args.json:
    _write_json(args.json, plans.ranking_json(best, ranked))
  return EXIT_OK if best else EXIT_FAIL


def _write_json(path: str, data) -> None:
  """Writes `data` as JSON; an OSError reaches main as a Failure naming the file (exit 1)."""
  from parity.cli._common import Failure
  try:
    with open(path, "w", encoding="utf-8") as f:
      json.dump(data, f, indent=1)
  except OSError as exc:
    raise Failure(f"--json {path}: cannot write ({exc.strerror or exc}); the table above is complete") from None


def run_presets(args: argparse.Namespace) -> int:
  """`parity presets`: run presets (name, size, training) and model-size presets (parity.hf.MODEL_PRESETS)."""
  from parity.hf import MODEL_PRESETS, PUBLISHED_PARAM_COUNTS
  from parity.presets import PRESETS
  from parity.spec import to_dict
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
              f"{m.n_heads} heads{f' ({m.n_kv_heads} kv)' if m.n_kv_heads and m.n_kv_heads != m.n_heads else ''}, "
              f"{m.mlp} MLP, max seq {m.max_seq_len}")
  return EXIT_OK
