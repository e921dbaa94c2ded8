"""Accelerator benchmark suite: parity's sides on one GPU or TPU, in one command (docs/benchmarks.md).

  benchmarks/gpu.sh                                  # on a GPU node: wheels, env, this script; ~12 min
  benchmarks/tpu.sh bench                            # on a TPU VM: install, this script with TPU defaults; < 7 min
  python benchmarks/gpu.py --out DIR                 # the same without a wrapper
  python benchmarks/gpu.py --tiny --out DIR          # CPU check (tests/test_gpu_bench.py): gpt2-tiny, tiny buffers
  python benchmarks/gpu.py --parts largest --budget-s 600 --out DIR   # one group of parts, more time
  python benchmarks/gpu.py --sides fsdp --out DIR    # one side of the fixed flow (its default budget: 240 s a side)

The device is named first (gpu_parts/device.py): a GPU by nvidia-smi; a TPU, on a machine that looks like a TPU VM,
by one short process that opens the chip (gpu_parts/jax_device.py: device_kind, count, bytes_limit, memory kinds,
versions); else the CPU. Then one of two flows, each measurement a process of its own with a timeout (a failed part
is recorded with its stderr tail and the suite goes on; a part this machine cannot run is recorded as not run, with
the reason: torch without a CUDA device, DeepSpeed and FSDP2 where sockets are refused):

  fixed (default on a GPU; gpu_parts/fixed_flow.py)
    raw      torch pinned host<->device copies and matmul (torch_raw); JAX device_put to/from pinned_host, the same
             moves inside jit, and matmul (jax_raw)
    train    each side (--sides: jax, deepspeed, fsdp) on one fixed GPT size that needs offload by the memory
             model: tokens/s, step time, MFU, peak memory; the offload cost and overlap (zero2-offload-scan against
             zero2, same model; FSDP2: zero3-offload-all against zero3, the ZeRO-3 pairs' FSDP2 plans)
    largest  the largest n_layers each side trains at the fixed width, one training process per probe; each JAX
             part gets XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB from its plan by the planner's rule (sizing.jax_pool)
  grid (default on a TPU, --flow grid elsewhere; gpu_parts/grid_flow.py)
    raw      jax_raw (its donated in-jit round trip is the in-step rate), torch_raw where torch has a device
    train    each --jax-plans plan at each --grad-accum on one model, compile-checked to fit: tokens/s, step time,
             MFU, compiled device peak, bytes moved; offload time added, transfer time, overlap, link bound, memory
             saved (gpu_parts/grid.py)
    largest  per --largest-plans plan, the largest n_layers whose train step COMPILES within the device's memory
             (one process, no weights: gpu_parts/jax_largest.py), then that depth run for 2 steps in a process of
             its own (a timeout is 'hung')
Writes DIR/gpu.json and DIR/gpu.md (date, device, versions, flags in force, host, every figure with its source) and
DIR/logs/<part>.log. This driver imports neither jax nor torch and never opens a TPU itself. Exit 0: every part that
could run ran; 1: some failed (both files are still written); 2: bad input.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_parts import device as devmod, fixed_flow, grid_flow, report, sizing  # noqa: E402
from benchmarks.gpu_parts.common import tail, write_json  # noqa: E402
from benchmarks.gpu_parts.suite import Suite, run_part, say  # noqa: E402
from harness import lifetime  # noqa: E402
from parity import sockets  # noqa: E402

PARTS = ("raw", "train", "largest")
SIDES = tuple(fixed_flow.SIDES)
"""The fixed flow's sides (--sides), in the order they run on a GPU: jax, deepspeed, fsdp."""
SIDE_BUDGET_S = 240.0
"""The fixed flow's default budget per side (outside --tiny): 480 s for two sides, 720 s for all three."""
FLOWS = ("auto", "fixed", "grid")
PACKAGES = ("jax", "jaxlib", "libtpu", "flax", "optax", "torch", "deepspeed", "numpy", "pydantic", "hjson",
            "py-cpuinfo")


def device_info(suite: Suite) -> dict:
  """The device record (gpu_parts/device.py): nvidia-smi's GPU; else, on a machine that looks like a TPU VM, the
  jax_device part's reading of the chip (never in --tiny: the CPU check); else the CPU. Host memory and cores with
  it; --device-gib overrides the device memory."""
  args = suite.args
  dev = {"kind": "cpu", "name": None, "memory_total_bytes": None, **devmod.gpu_info()}
  evidence = None if args.tiny or dev.get("kind") == "gpu" else devmod.tpu_evidence()
  if evidence:
    dev["tpu_evidence"] = evidence
    rec = run_part(suite, "jax_device", "jax_device", [], args.part_timeout_s)
    suite.records["jax_device"] = rec
    if rec.get("ok"):
      dev.update(devmod.device_from_jax_probe(rec["result"]), probe_open_s=rec["result"].get("open_s"))
    if dev.get("kind") == "tpu" and not dev.get("memory_total_bytes"):  # the runtime gave no bytes_limit
      hw = sizing.hardware(1, 1, dev.get("name"), "tpu")
      preset = sizing.sizing_modules()[1].HARDWARE[hw.name]
      dev.update(memory_total_bytes=preset.device_bytes, memory_source=f"the planner's {hw.name} preset "
                                                                        "(memory_stats gave no bytes_limit)")
  if args.device_gib:
    dev.update(memory_total_bytes=int(args.device_gib * 2**30), memory_source="--device-gib")
  return {**dev, **devmod.host_facts(args.host_gib)}


def header(args: argparse.Namespace, dev: dict) -> dict:
  versions = {p: devmod.package_version(p) for p in PACKAGES}
  versions.update({k: v for k, v in (dev.get("versions") or {}).items() if v})  # what the chip's process saw
  return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "mode": "tiny (CPU check)" if args.tiny else "full",
          "flow": args.flow, "machine": f"{platform.platform()}, {os.cpu_count()} CPUs",
          "python": sys.version.split()[0], "versions": versions, "env": devmod.recorded_env(), "argv": sys.argv[1:],
          "sockets": sockets.sockets_record(), "torch_extensions_note": getattr(args, "extensions_note", None)}


def set_environment(args: argparse.Namespace) -> None:
  """What benchmarks/gpu.sh exports, where unset, so the parts inherit it from a bare `python benchmarks/gpu.py`
  too; a writable TORCH_EXTENSIONS_DIR for DeepSpeed's op build (device.extensions_dir); --tiny also compiles XLA's
  CPU code unoptimised (the CPU check times nothing that matters, and it halves the compile of each JAX part on a
  2-core machine)."""
  for key, value in (("PYTHONUNBUFFERED", "1"), ("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),
                     ("JAX_DEFAULT_MATMUL_PRECISION", "highest")):
    os.environ.setdefault(key, value)
  os.environ["TORCH_EXTENSIONS_DIR"], args.extensions_note = devmod.extensions_dir()
  if args.tiny and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()


def _csv(ap: argparse.ArgumentParser, flag: str, text: str, known=None, number: bool = False) -> list:
  items = [x.strip() for x in text.split(",") if x.strip()]
  if not items:
    ap.error(f"{flag} {text!r}: give at least one value")
  if number:
    if not all(x.isdecimal() and int(x) > 0 for x in items):  # isdigit passes '²', which int() refuses
      ap.error(f"{flag} {text!r}: whole numbers > 0, comma-separated (e.g. 1,8)")
    return [int(x) for x in items]
  bad = [x for x in items if known is not None and x not in known]
  if bad:
    ap.error(f"{flag} {text!r}: unknown {', '.join(bad)}; choose from {', '.join(known)}")
  return items


def _plans(ap: argparse.ArgumentParser, flag: str, text: str) -> list[str]:
  """Plan names (sizing.plan_variant: a pair, or NAME@POLICY), comma-separated."""
  items = _csv(ap, flag, text)
  for item in items:
    try:
      sizing.plan_variant(item)
    except ValueError as exc:
      ap.error(f"{flag} {text!r}: {exc}")
  return items


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--tiny", action="store_true", help="CPU check: gpt2-tiny, tiny buffers, 1 probe per side")
  ap.add_argument("--out", default=os.environ.get("OUT") or f"benchmarks/results/gpu-{time.strftime('%Y-%m-%d')}")
  ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
  ap.add_argument("--flow", default="auto", choices=FLOWS, help="auto: grid on a TPU, fixed elsewhere")
  ap.add_argument("--sides", default=",".join(SIDES),
                  help=f"fixed flow: comma-separated, of {', '.join(SIDES)} (default all)")
  ap.add_argument("--budget-s", type=float,
                  help=f"whole suite, seconds (default: the fixed flow {SIDE_BUDGET_S:.0f} per side, 720 for all "
                       "three; the grid flow 480; --tiny 240)")
  ap.add_argument("--steps", type=int, help="timed steps per train run (default 3; --tiny 2)")
  ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (compile / first-step allocations)")
  ap.add_argument("--device-gib", type=float, help="accelerator memory to size for (default: the device's)")
  ap.add_argument("--host-gib", type=float,
                  help="host memory the runs may use (default: MemAvailable, or the cgroup limit less its use if less)")
  ap.add_argument("--max-probes", type=int, help="largest-model probes per side or plan (default 8; --tiny 1)")
  ap.add_argument("--largest-resolution", type=float, default=0.125,
                  help="grid flow: the JAX largest-model search stops when its bracket is within this share of the "
                       "largest that trained (default 0.125; 0: to the layer)")
  ap.add_argument("--jax-plans", default=",".join(sizing.GRID_PLANS),
                  help="grid flow: plans to time (a pair of parity's plans, or NAME@POLICY: it with jax.remat POLICY)")
  ap.add_argument("--grad-accum", help="grid flow: gradient accumulations per plan (default 1,8; --tiny 1,2)")
  ap.add_argument("--micro-tokens", type=int, help="grid flow: tokens per micro batch (default 4096; --tiny 64)")
  ap.add_argument("--largest-plans", default=",".join(sizing.LARGEST_PLANS),
                  help="grid flow: plans to size (as --jax-plans, e.g. zero0@full)")
  ap.add_argument("--model", default=sizing.FIXED_MODEL,
                  help="grid flow: the model whose width and sequence are timed and searched (a parity.hf."
                       f"MODEL_PRESETS or parity.presets.PRESETS name; default {sizing.FIXED_MODEL}; the flow picks "
                       "its depth)")
  ap.add_argument("--largest-budget-s", type=float, default=240.0,
                  help="grid flow: seconds for the largest-model search and its confirming runs (default 240)")
  ap.add_argument("--confirm-timeout-s", type=float,
                  help="seconds each largest-model confirming run (and fixed-flow probe) may take (default 150; --tiny "
                       "90): a TPU process with a large premapped region spends a minute opening the chip")
  ap.add_argument("--bytes-limit", type=int, help="grid flow: device bytes a compile must fit (default: the chip's)")
  ap.add_argument("--largest-fit-by", default="sum", choices=("sum", "xla", "compile"),
                  help="grid flow: a compiled depth fits when its argument+output+temp-alias (sum, default), XLA's "
                       "peak_memory_in_bytes less the step's host buffers (xla), or nothing but XLA's acceptance "
                       "(compile) is within the limit")
  ap.add_argument("--raw-mib", type=int, help="MiB per bandwidth copy in the raw parts (default 1024; --tiny 8)")
  return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  ap = _parser()
  args = ap.parse_args(argv)
  tiny = args.tiny
  args.parts = _csv(ap, "--parts", args.parts, PARTS)
  args.sides = _csv(ap, "--sides", args.sides, SIDES)
  args.budget_given = args.budget_s is not None
  args.budget_s = args.budget_s or (240.0 if tiny else 480.0)  # the fixed flow's: `budget` once the flow is known
  args.steps = args.steps or (2 if tiny else 3)
  args.max_probes = args.max_probes or (1 if tiny else 8)
  args.micro_tokens = args.micro_tokens or (64 if tiny else sizing.GRID_MICRO_TOKENS)
  # per-part limits: tiny runs take seconds each on a CPU; the GPU figures leave room for the ~8 minute total
  args.mib, args.matmul_n, args.reps = (8, 256, 3) if tiny else (1024, 8192, 5)
  args.mib = args.raw_mib or args.mib
  args.part_timeout_s, args.train_timeout_s, args.probe_timeout_s = (60, 90, 90) if tiny else (90, 150, 150)
  args.probe_timeout_s = args.confirm_timeout_s or args.probe_timeout_s
  args.op_build_timeout_s, args.min_part_s = (240, 5) if tiny else (240, 20)
  args.jax_plans = _plans(ap, "--jax-plans", args.jax_plans)
  args.largest_plans = _plans(ap, "--largest-plans", args.largest_plans)
  args.grad_accum = _csv(ap, "--grad-accum", args.grad_accum or ("1,2" if tiny else "1,8"), number=True)
  try:
    seq = (sizing.tiny_run() if tiny else sizing.fixed_run(args.model)).train.seq_len
  except KeyError as exc:
    ap.error(f"--model: {exc.args[0]}")
  if args.micro_tokens % seq or args.micro_tokens < seq:
    model = "gpt2-tiny (--tiny)" if tiny else args.model
    ap.error(f"--micro-tokens {args.micro_tokens}: must be a multiple of --model {model}'s sequence length {seq}")
  if args.confirm_timeout_s is not None and not 0 < args.confirm_timeout_s < math.inf:  # nan, inf: no limit
    ap.error(f"--confirm-timeout-s must be a finite number > 0; got {args.confirm_timeout_s}")
  if not 0 <= args.largest_resolution < 1:  # nan fails both
    ap.error(f"--largest-resolution must be a number in [0, 1); got {args.largest_resolution}")
  for key in ("budget_s", "steps", "max_probes", "micro_tokens", "largest_budget_s", "mib"):
    if getattr(args, key) <= 0:
      ap.error(f"--{key.replace('_', '-')} must be > 0; got {getattr(args, key)}")
  return args


def prepare(args: argparse.Namespace) -> tuple[Suite, int | None]:
  """The suite with its device named and its flow chosen; an exit status when nothing can be sized (else None)."""
  out = Path(args.out)
  for sub in ("parts", "logs"):
    (out / sub).mkdir(parents=True, exist_ok=True)
  started = time.monotonic()
  suite = Suite(args, out, started + args.budget_s)
  suite.device = device_info(suite)
  suite.not_run = devmod.not_run_reasons(suite.device, args.tiny, sockets.loopback_refusal())
  if args.flow == "auto":
    args.flow = "grid" if suite.tpu else "fixed"
  if args.flow == "fixed" and not args.tiny and not args.budget_given:
    args.budget_s = SIDE_BUDGET_S * len(args.sides)
    suite.deadline = started + args.budget_s
  needs_size = set(args.parts) - {"raw"}
  if not args.tiny and not suite.device.get("memory_total_bytes") and needs_size:
    if "jax_device" in suite.records:  # a TPU VM whose chip could not be read: recorded, the files still come
      return suite, 1
    print("gpu.py: no accelerator found (nvidia-smi reports none, and this is no TPU VM) to size the train and "
          "largest parts for; on a CPU machine run --tiny, or give --device-gib", file=sys.stderr)
    return suite, 2
  if args.tiny and args.flow == "grid":
    suite.device["host_available_bytes"] = suite.device["host_available_bytes"] or 2**33
  return suite, None


def run_flow(suite: Suite) -> None:
  args = suite.args
  dev = suite.device
  sides = f", sides {','.join(args.sides)}" if args.flow == "fixed" else ""
  say(f"{'tiny CPU check' if args.tiny else 'full run'}: {args.flow} flow{sides}, parts {','.join(args.parts)}, budget "
      f"{args.budget_s:.0f} s, device {dev.get('name') or 'none (CPU)'} ({dev.get('kind')}), out {suite.out}")
  if args.flow == "grid":
    grid_flow.run_grid_flow(suite)
    return
  configs = {}
  if "train" in args.parts:
    info, configs = fixed_flow.train_configs(suite)
    suite.records["sizing"] = info
    for line in info["why"]:
      say(line)
  if not args.tiny and ("train" in args.parts or "largest" in args.parts) and "deepspeed" not in suite.not_run \
     and "deepspeed" in args.sides:
    fixed_flow.start_op_build(suite)  # tiny: the DeepSpeed parts load the built op themselves (2 cores: no spare CPU)
  fixed_flow.run_sides(suite, configs)
  if suite.op_build is not None:
    fixed_flow.wait_op_build(suite)


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  set_environment(args)
  t0 = time.monotonic()
  suite, status = prepare(args)
  if status == 2:
    return 2
  try:
    if status is None:
      run_flow(suite)
  except KeyboardInterrupt:  # the running part's tree is already killed (harness.launch); write what there is
    suite.records["interrupted"] = {"ok": False, "failure": "interrupted", "detail": "Ctrl-C / SIGINT"}
    if suite.op_build is not None and suite.op_build.poll() is None:
      lifetime.kill_tree(suite.op_build.pid)
  except Exception as exc:  # a fault of the driver's own code: recorded, and the files are still written
    import traceback
    suite.records["driver"] = {"ok": False, "failure": "error", "detail": f"{type(exc).__name__}: {exc}",
                               "stderr_tail": tail(traceback.format_exc())}
    say(f"driver error {type(exc).__name__}: {exc}")
  offload = fixed_flow.offload_summary(suite) if "train" in args.parts and args.flow == "fixed" else {}
  data = {"header": header(args, suite.device), "device": suite.device, "records": suite.records, "offload": offload,
          "sides_concurrent": args.tiny and args.flow == "fixed", "not_run": suite.not_run,
          "suite_wall_s": time.monotonic() - t0}
  write_json(suite.out / "gpu.json", data)
  (suite.out / "gpu.md").write_text(report.markdown(data))
  failed = report.failed_parts(data)
  say(f"wrote {suite.out / 'gpu.json'} and {suite.out / 'gpu.md'} in {data['suite_wall_s']:.0f} s; "
      f"{len(failed)} part(s) failed{': ' + ', '.join(failed) if failed else ''}")
  return 1 if failed or status else 0


if __name__ == "__main__":
  sys.exit(main())
