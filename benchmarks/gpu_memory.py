"""JAX plans on one accelerator: the memory model's predicted device peak against what XLA and the allocator report.

For each plan (one fresh process per plan, so the allocator's peak belongs to that plan alone) the JAX side of
`parity compare --plan NAME` is built on the chosen model, compiled and run for a few steps. Recorded:

  * predicted: `parity.sizing.memory.estimate` rows and `peak_device_bytes` for the JAX side;
  * compiled: every numeric field of `compiled.memory_analysis()` (argument, output, alias, temp bytes and, on
    backends that split them, their host counterparts);
  * allocator: `device.memory_stats()` after the steps (`peak_bytes_in_use`, `bytes_in_use`, `bytes_limit`);
    the CPU backend reports none, and the table says so;
  * state: bytes of the live state per memory kind (`jax_impl.offload.bytes_by_memory_kind`);
  * step time (median of the timed steps) and the host->device bandwidth of a pinned_host array (GB/s, in
    every plan's process; the report gives the median), which the planner's cost model assumes.

Writes <out>/gpu-memory.json and gpu-memory.md. Needs jax, flax, optax and numpy only (no torch, DeepSpeed or
pydantic), so it runs on a GPU node as is.

Usage:
  python benchmarks/gpu_memory.py --out DIR                       # gpt2-1.5b, bf16, micro 1 x 1024, 5 plans
  python benchmarks/gpu_memory.py --tiny --out DIR                # CPU check: gpt2-tiny preset, 2 steps
  python benchmarks/gpu_memory.py --model llama-1b --plans zero0,zero2-offload-scan --out DIR
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from parity.pipeline.resolve import resolve_run  # noqa: E402
from parity.sizing import memory  # noqa: E402
from parity.weights import init_params  # noqa: E402
from parity.hf import MODEL_PRESETS  # noqa: E402
from parity.sizing.plans import PLANS  # noqa: E402

DEFAULT_PLANS = "zero0,zero2-offload,zero2-offload-scan,scan-offload,act-offload"
GiB = 2**30


def _run_spec(args: argparse.Namespace):
  if args.tiny:
    return resolve_run("gpt2-tiny", plan=args.one, micro_batch=args.micro_batch, seq_len=args.seq_len,
                       precision=args.precision).spec
  return resolve_run(model=args.model, plan=args.one, micro_batch=args.micro_batch or 1,
                     seq_len=args.seq_len or 1024, precision=args.precision).spec


def _bandwidth_gbs(nbytes: int = 256 * 2**20) -> float | None:
  """Host (pinned_host) -> device copy bandwidth, GB/s, best of 3; None when the device has no pinned_host."""
  import jax
  import numpy as np
  dev = jax.devices()[0]
  if "pinned_host" not in {m.kind for m in dev.addressable_memories()}:
    return None
  host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  x = jax.device_put(np.ones(nbytes // 4, np.float32), host)
  x.block_until_ready()
  best = float("inf")
  for _ in range(3):
    t0 = time.perf_counter()
    jax.device_put(x, jax.sharding.SingleDeviceSharding(dev, memory_kind="device")).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return nbytes / best / 1e9


def run_one(args: argparse.Namespace) -> dict:
  """Child process: one plan, JAX side only."""
  import jax
  import numpy as np

  from jax_impl import offload  # the framework: jax is imported after the benchmark has set its flags
  from jax_impl.step import Trainer  # the framework: jax is imported after the benchmark has set its flags

  run = _run_spec(args)
  t = run.train
  t0 = time.perf_counter()
  trainer = Trainer.build(run, init_params(run.model, 0))
  init_s = time.perf_counter() - t0
  shape = (t.grad_accum_steps, t.micro_batch_size, t.seq_len + 1)
  trainer.compile(shape, None)
  rng = np.random.default_rng(0)
  times = []
  for _ in range(args.steps):
    batch = rng.integers(0, run.model.vocab_size, shape).astype(np.uint16)
    s0 = time.perf_counter()
    metrics = trainer.step(batch)
    times.append(time.perf_counter() - s0)
  dev = jax.devices()[0]
  stats = dev.memory_stats() or {}
  rows = memory.estimate(run, sides=("jax",))
  return {
      "plan": args.one, "backend": jax.default_backend(), "device": str(dev),
      "model": dataclasses.asdict(run.model), "train": dataclasses.asdict(t), "jax_plan": dataclasses.asdict(run.jax),
      "predicted_rows": [dataclasses.asdict(r) for r in rows],
      "predicted_peak_device_bytes": memory.peak_device_bytes(rows, "jax"),
      "memory_analysis": trainer.memory_analysis,
      "allocator": {k: int(stats[k]) for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit") if k in stats},
      "state_bytes_by_kind": offload.bytes_by_memory_kind(trainer.state, dev),
      "state_memory_kinds": offload.state_memory_kinds(trainer.state),
      "jaxpr_device_puts": trainer.offload_evidence()["jaxpr_device_puts"],
      "init_s": init_s, "compile_s": trainer.compile_s, "step_s": times,
      "median_step_s": statistics.median(times), "last_loss": metrics["loss"],
      "host_to_device_gbs": _bandwidth_gbs(),
  }


def _gib(n) -> str:
  """GiB with 2 decimals, or MiB with 3 below 0.1 GiB (the CPU check's tiny model)."""
  if n is None:
    return "n/a"
  return f"{n / GiB:.2f} GiB" if n >= 0.1 * GiB else f"{n / 2**20:.3f} MiB"


def markdown(results: list[dict], header: dict) -> str:
  out = [f"# JAX plans: predicted vs measured device memory — {header['date']}", "",
         f"{header['machine']}. Versions: {header['versions']}.", ""]
  if header.get("nvidia_smi"):
    out += ["```", header["nvidia_smi"].strip(), "```", ""]
  ok = [r for r in results if "error" not in r]
  if ok:
    m, t = ok[0]["model"], ok[0]["train"]
    bw = [r["host_to_device_gbs"] for r in ok if r.get("host_to_device_gbs")]
    bw_text = f"{statistics.median(bw):.1f} GB/s (median over {len(bw)} plan processes)" if bw else \
        "not measured (no pinned_host memory on this backend)"
    out += [f"Model: {m['n_layers']} layers × d_model {m['d_model']}, vocab {m['vocab_size']}; micro batch "
            f"{t['micro_batch_size']} × seq {t['seq_len']}, {t['precision']}, grad accum {t['grad_accum_steps']}. "
            f"Host→device bandwidth (pinned_host, 256 MiB): {bw_text}.", ""]
  out += ["| plan | predicted peak | allocator peak | peak / predicted | XLA temp | XLA args | "
          "XLA host args | state on device | state on host | median step s | compile s |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in results:
    if "error" in r:
      out.append(f"| `{r['plan']}` | failed: {r['error'][:120]} " + "| " * 9 + "|")
      continue
    ma, al, kinds = r["memory_analysis"], r["allocator"], r["state_bytes_by_kind"]
    peak = al.get("peak_bytes_in_use")
    ratio = f"{peak / r['predicted_peak_device_bytes']:.3f}" if peak else "n/a (backend reports none)"
    host = sum(v for k, v in kinds.items() if k != "device")
    out.append(f"| `{r['plan']}` | {_gib(r['predicted_peak_device_bytes'])} | {_gib(peak)} | {ratio} | "
               f"{_gib(ma.get('temp_size_in_bytes'))} | {_gib(ma.get('argument_size_in_bytes'))} | "
               f"{_gib(ma.get('host_argument_size_in_bytes'))} | {_gib(kinds.get('device', 0))} | {_gib(host)} | "
               f"{r['median_step_s']:.3f} | {r['compile_s']:.1f} |")
  out += ["", "The predicted peak is `parity.sizing.memory.peak_device_bytes` (resident device state + "
              "max(forward/backward "
          "phase: activations and fetched or cast params, update phase: fetched state and the streamed update's "
          "new stacks)); the allocator peak is the process's "
          "`memory_stats()['peak_bytes_in_use']` after compile and the timed steps (one process per plan)."]
  return "\n".join(out) + "\n"


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="gpt2-1.5b", help="a parity.hf.MODEL_PRESETS name")
  ap.add_argument("--tiny", action="store_true", help="the gpt2-tiny run preset (a CPU check of this script)")
  ap.add_argument("--plans", default=DEFAULT_PLANS, help="comma-separated parity.sizing.plans.PLANS names")
  ap.add_argument("--micro-batch", type=int, help="sequences per micro batch (default 1; --tiny: the preset's)")
  ap.add_argument("--seq-len", type=int, help="tokens per sequence (default 1024; --tiny: the preset's)")
  ap.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"))
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--timeout", type=float, default=240.0, help="seconds per plan before it is reported failed")
  ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu-memory.json / .md")
  ap.add_argument("--one", help=argparse.SUPPRESS)
  ap.add_argument("--json", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.steps < 1:
    ap.error(f"--steps must be >= 1; got {args.steps}")
  if args.tiny:
    args.steps = min(args.steps, 2)
  if args.one:
    Path(args.json).write_text(json.dumps(run_one(args), indent=1, default=str))
    return 0

  plans = [p.strip() for p in args.plans.split(",") if p.strip()]
  unknown = [p for p in plans if p not in PLANS]
  if unknown or not plans:
    print(f"--plans: unknown or no plan(s) {unknown or args.plans!r}; known: {', '.join(PLANS)}", file=sys.stderr)
    return 2
  if not args.tiny and args.model not in MODEL_PRESETS:
    print(f"--model {args.model!r} is not a model preset; known: {', '.join(MODEL_PRESETS)}", file=sys.stderr)
    return 2
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONUNBUFFERED": "1"}
  results = []
  for name in plans:
    path = out / f"gpu-memory-{name}.json"
    sizes = [f for flag, v in (("--micro-batch", args.micro_batch), ("--seq-len", args.seq_len)) if v is not None
             for f in (flag, str(v))]
    cmd = [sys.executable, __file__, "--one", name, "--json", str(path), "--model", args.model, *sizes,
           "--precision", args.precision, "--steps", str(args.steps)] + (["--tiny"] if args.tiny else [])
    t0 = time.perf_counter()
    try:
      proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
      ok = proc.returncode == 0 and path.exists()
      err = "" if ok else (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    except subprocess.TimeoutExpired:
      ok, err = False, f"timed out after {args.timeout:.0f} s"
    results.append(json.loads(path.read_text()) if ok else {"plan": name, "error": err})
    print(f"{name}: {'ok' if ok else 'FAILED ' + err} ({time.perf_counter() - t0:.0f} s)", flush=True)
  import importlib.metadata as md
  versions = ", ".join(f"{p} {md.version(p)}" for p in ("jax", "jaxlib", "flax", "optax", "numpy"))
  try:
    smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
  except (OSError, subprocess.TimeoutExpired):
    smi = ""
  header = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.platform()}, {os.cpu_count()} CPUs",
            "versions": versions, "nvidia_smi": smi}
  (out / "gpu-memory.json").write_text(json.dumps({"header": header, "results": results}, indent=1, default=str))
  (out / "gpu-memory.md").write_text(markdown(results, header))
  print(f"wrote {out / 'gpu-memory.md'}")
  return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
  sys.exit(main())
