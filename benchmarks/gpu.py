"""GPU benchmark suite: both sides of parity on one accelerator, in one command (docs/benchmarks.md).

  benchmarks/gpu.sh                                  # on a GPU node: wheels, env, this script; ~8 min
  python benchmarks/gpu.py --out DIR                 # the same without the wrapper
  python benchmarks/gpu.py --tiny --out DIR          # CPU check (tests/test_gpu_bench.py): gpt2-tiny, tiny buffers
  python benchmarks/gpu.py --parts largest --budget-s 600 --out DIR   # one group of parts, more time

Parts (each measurement a process of its own, `python -m benchmarks.gpu_parts.<part>`, with a timeout; a failed
part is recorded with its stderr tail and the suite goes on):
  raw      torch pinned host<->device copies and matmul (torch_raw); JAX device_put to/from pinned_host, the same
           moves inside jit, and matmul (jax_raw)
  train    each side (jax_impl.step.Trainer; torch_impl.engine.DeepSpeedTrainer) on one fixed GPT size that
           needs offload by the memory model (benchmarks/gpu_parts/sizing.py says why, in the output): tokens/s,
           step time, MFU, peak device and host memory; the offload cost (tokens/s with full optimizer-state
           offload / without, same model, each side); the overlap (bytes moved per step, their time at the
           measured bandwidth, step time with offload minus without)
  largest  the largest n_layers each side trains at the fixed width (doubling from the memory model's prediction,
           then bisection; one process per probe; OOM read from the exit status and stderr); JAX plan scan-offload
           (params + optimizer state in pinned_host), DeepSpeed ZeRO-3 offload_optimizer + offload_param. Each JAX
           part gets XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB from its plan by the planner's rule (sizing.jax_pool), and a
           probe whose pool exceeds the host is not started ('host-limit')
Writes DIR/gpu.json and DIR/gpu.md (date, nvidia-smi, versions, the measured bandwidth next to every figure) and
DIR/logs/<part>.log. This driver imports neither jax nor torch. Exit 0: every part ran; 1: some failed (both
files are still written); 2: bad input.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata as md
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_parts import report, sizing  # noqa: E402
from benchmarks.gpu_parts.common import (classify_failure, flops_per_token, host_memory_bytes, peak_flops,  # noqa: E402
                                         sizing_modules, tail, write_json, write_spec)
from harness.launch import LaunchTimeout, run_module, worker_env  # noqa: E402
from harness import lifetime  # noqa: E402

PARTS = ("raw", "train", "largest")
SIDES = {"jax": "jax_train", "deepspeed": "ds_train"}
PACKAGES = ("jax", "jaxlib", "flax", "optax", "torch", "deepspeed", "numpy", "pydantic", "hjson", "py-cpuinfo")


@dataclasses.dataclass
class Suite:
  """What the driver knows while it runs: options, the deadline, where files go, every part's record."""
  args: argparse.Namespace
  out: Path
  deadline: float
  records: dict = dataclasses.field(default_factory=dict)
  op_build: subprocess.Popen | None = None
  local: threading.local = dataclasses.field(default_factory=threading.local)

  def left(self) -> float:
    """Seconds to this chain's deadline (a side's share of the budget), else the suite's."""
    return getattr(self.local, "deadline", self.deadline) - time.monotonic()

  @property
  def tiny(self) -> bool:
    return self.args.tiny


def say(msg: str) -> None:
  print(f"[gpu-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_part(suite: Suite, name: str, module: str, argv: list[str], timeout: float,
             env: dict[str, str] | None = None) -> dict:
  """Runs `python -m benchmarks.gpu_parts.<module> --json <out> argv` through the harness (harness.launch: bound to
  this process, its whole tree killed at the timeout) with `env` added to its environment; returns its record:
  {'ok': True, 'result', 'wall_s'} or {'ok': False, 'failure': 'timeout'|'oom'|'error'|'skipped', 'detail',
  'stderr_tail'}. Output: logs/<name>.log."""
  timeout = min(timeout, suite.left())
  if timeout < suite.args.min_part_s:
    rec = {"ok": False, "failure": "skipped", "detail": f"suite budget spent ({suite.left():.0f} s left)"}
    say(f"{name}: skipped ({rec['detail']})")
    return rec
  res_path = suite.out / "parts" / f"{name}.json"
  args = ["--json", str(res_path), *argv]
  say(f"{name}: start (timeout {timeout:.0f} s)")
  t0 = time.monotonic()
  try:
    fin = run_module(f"benchmarks.gpu_parts.{module}", args, timeout_s=timeout, env=env)
    rc, text, timed_out = fin.returncode, fin.stdout + fin.stderr, False
  except LaunchTimeout as exc:
    rc, text, timed_out = None, exc.stderr_tail, True
  wall = time.monotonic() - t0
  (suite.out / "logs" / f"{name}.log").write_text(f"{module} {' '.join(args)}\n{text}")
  if rc == 0 and res_path.exists():
    rec = {"ok": True, "wall_s": wall, "result": json.loads(res_path.read_text())}
  else:
    detail = f"timed out after {timeout:.0f} s" if timed_out else f"exit {rc}"
    rec = {"ok": False, "wall_s": wall, "failure": classify_failure(rc, text, timed_out), "detail": detail,
           "stderr_tail": tail(text)}
  say(f"{name}: {'ok' if rec['ok'] else 'FAILED (' + rec['failure'] + ', ' + rec['detail'] + ')'} ({wall:.0f} s)")
  return rec


def start_op_build(suite: Suite) -> None:
  """Loads or JIT-builds DeepSpeed's cpu_adam in the background (CPU work while the GPU parts run), bound to this
  process as every part is (harness.lifetime)."""
  log = open(suite.out / "logs" / "ds_build_op.log", "w")
  cmd = [sys.executable, "-m", "harness.boot", "benchmarks.gpu_parts.ds_train", "--build-op", "--json",
         str(suite.out / "parts" / "ds_build_op.json")]
  suite.op_build = lifetime.spawn(cmd, env=worker_env(), timeout_s=suite.args.op_build_timeout_s, stdout=log,
                                  stderr=subprocess.STDOUT, cwd=str(ROOT))
  suite.records["ds_build_op"] = {"started": time.monotonic()}
  say("ds_build_op: loading/building DeepSpeed's cpu_adam in the background")


def wait_op_build(suite: Suite) -> None:
  """Waits for the background op build (at most its timeout) and records it; idempotent."""
  if suite.op_build is None or "ok" in suite.records.get("ds_build_op", {}):
    return
  rec = suite.records["ds_build_op"]
  left = suite.args.op_build_timeout_s - (time.monotonic() - rec["started"])
  try:
    rc = suite.op_build.wait(timeout=max(1.0, min(left, suite.left())))
  except subprocess.TimeoutExpired:
    lifetime.kill_tree(suite.op_build.pid)  # the compilers too (ninja starts them in groups of their own)
    suite.op_build.wait()
    rc = None
  lifetime.release(suite.op_build)
  text = (suite.out / "logs" / "ds_build_op.log").read_text(errors="replace")
  path = suite.out / "parts" / "ds_build_op.json"
  ok = rc == 0 and path.exists()
  rec.update(ok=ok, wall_s=time.monotonic() - rec.pop("started"))
  if ok:
    rec["result"] = json.loads(path.read_text())
  else:
    rec.update(failure=classify_failure(rc, text, rc is None), detail=f"exit {rc}", stderr_tail=tail(text))
  say(f"ds_build_op: {'ok' if ok else 'FAILED'} ({rec['wall_s']:.0f} s)")


# ----------------------------------------------------------------------------- raw

RAW = {"jax": "jax_raw", "deepspeed": "torch_raw"}


def part_raw(suite: Suite, side: str) -> None:
  """The side's framework: bandwidth and matmul (jax_raw; torch_raw for DeepSpeed)."""
  a = suite.args
  sizes = ["--mib", str(a.mib), "--n", str(a.matmul_n), "--reps", str(a.reps)]
  suite.records[RAW[side]] = run_part(suite, RAW[side], RAW[side], sizes, a.part_timeout_s)


def link_gbs(suite: Suite, side: str) -> dict | None:
  """Measured pinned host<->device GB/s (median) of the side's own stack: JAX device_put, torch copies."""
  if side == "jax":
    rec = suite.records.get("jax_raw", {})
    bw = (rec.get("result") or {}).get("bandwidth", {})
    up, down = bw.get("device_put_pinned_to_device"), bw.get("device_put_device_to_pinned")
    src = "jax device_put pinned_host<->device"
  else:
    rec = suite.records.get("torch_raw", {})
    bw = (rec.get("result") or {}).get("bandwidth", {})
    up, down = bw.get("host_to_device_pinned"), bw.get("device_to_host_pinned")
    src = "torch pinned copies"
    if up is None and "host_to_host" in bw:
      up = down = bw["host_to_host"]
      src = "host memcpy (CPU: no link)"
  if not up or not down:
    return None
  return {"h2d_gbs": up["median_gbs"], "d2h_gbs": down["median_gbs"], "source": src + (
      " (CPU: same RAM)" if "cpu" in bw.get("kind", "") and side == "jax" else "")}


# ----------------------------------------------------------------------------- train

def train_configs(suite: Suite) -> tuple[dict, dict]:
  """(sizing record, {config name: RunSpec}) of the train part: fixed (offload), cost_offload, cost_none."""
  if suite.tiny:
    base = sizing.tiny_run()
    micro = base.train.micro_batch_size
    info = {"model": "gpt2-tiny (CPU check)", "micro_fixed": micro, "micro_cost": micro,
            "why": ["tiny CPU mode: gpt2-tiny at its preset micro batch; nothing needs offload on a CPU, so the "
                    "fixed size and the offload-cost size are the same run"]}
  else:
    fx = sizing.fixed_size(suite.records["device"]["memory_total_bytes"],
                           suite.records["device"]["host_available_bytes"])
    base, info = fx.pop("run"), fx
    info["model"] = sizing.FIXED_MODEL
  if info.get("micro_fixed") is None:
    return info, {}
  b = base
  configs = {"fixed": sizing.with_plan(b, sizing.OFFLOAD_PLAN, micro_batch=info["micro_fixed"])}
  if info.get("micro_cost"):
    configs["cost_offload"] = sizing.with_plan(b, sizing.OFFLOAD_PLAN, micro_batch=info["micro_cost"])
    configs["cost_none"] = sizing.with_plan(b, sizing.NO_OFFLOAD_PLAN, micro_batch=info["micro_cost"])
  return info, configs


def part_train(suite: Suite, side: str, configs: dict) -> None:
  """The side's train runs: the fixed size with offload, the offload-cost pair."""
  a = suite.args
  init = [] if suite.tiny else ["--fast-init"]
  if side == "deepspeed":
    wait_op_build(suite)
  for cname, run in configs.items():
    name = f"{side}_{cname}"
    if cname == "cost_offload" and run == configs["fixed"]:
      suite.records[name] = {"same_as": f"{side}_fixed"}
      continue
    spec = write_spec(run, suite.out / "parts" / f"{name}.spec.json")
    # DeepSpeed without offload: torch.optim.AdamW (torch_adam), as FusedAdam's CUDA op needs nvcc and minutes
    adam = ["--torch-adam"] if side == "deepspeed" and cname == "cost_none" else []
    env, pool = sizing.jax_pool(run) if side == "jax" else ({}, None)
    rec = run_part(suite, name, SIDES[side], ["--spec", str(spec), "--steps", str(a.steps), "--warmup",
                                             str(a.warmup), *init, *adam], a.train_timeout_s, env=env)
    if pool:
      rec["pool"] = pool
    rec["config"] = {"plan": sizing.NO_OFFLOAD_PLAN if cname == "cost_none" else sizing.OFFLOAD_PLAN,
                     "micro_batch": run.train.micro_batch_size, "seq_len": run.train.seq_len,
                     "n_layers": run.model.n_layers, "d_model": run.model.d_model, "precision": run.train.precision}
    if rec["ok"]:
      rec["derived"] = derived(suite, side, run, rec["result"])
    suite.records[name] = rec


def derived(suite: Suite, side: str, run, res: dict) -> dict:
  """MFU against the device's bf16 peak and the link bandwidth the side measured, for one train record."""
  peak = peak_flops(res.get("device"), "fp32" if run.train.precision == "fp32" else "bf16")
  fpt = flops_per_token(run.model, run.train.seq_len)
  out = {"flops_per_token": fpt, "model_tflops_per_s": res["tokens_per_s"] * fpt / 1e12,
         "peak_tflops": peak / 1e12 if peak else None,
         "mfu": res["tokens_per_s"] * fpt / peak if peak else None, "link": link_gbs(suite, side)}
  if side == "deepspeed":
    memory, _ = sizing_modules()
    from parity.sizing import cost
    rows = memory.estimate(run, sides=("deepspeed",))
    out["moved_bytes_per_step_model"] = cost.transfer_bytes(run, "deepspeed", rows)
  return out


def offload_summary(suite: Suite) -> dict:
  """Per side: offload cost (tokens/s kept) and overlap (bytes moved, their time at the measured bandwidth, the
  step time offload adds)."""
  out = {}
  for side in SIDES:
    off = suite.records.get(f"{side}_cost_offload", {})
    if "same_as" in off:
      off = suite.records.get(off["same_as"], {})
    none = suite.records.get(f"{side}_cost_none", {})
    if not (off.get("ok") and none.get("ok")):
      out[side] = {"error": "needs both cost runs; " + "; ".join(
          f"{n}: {r.get('failure', 'missing')}" for n, r in (("offload", off), ("none", none)) if not r.get("ok"))}
      continue
    ro, rn = off["result"], none["result"]
    moved = ro["moved_bytes_per_step"] if side == "jax" else off["derived"]["moved_bytes_per_step_model"]
    link = off["derived"]["link"]
    transfer_s = moved / (0.5 * (link["h2d_gbs"] + link["d2h_gbs"]) * 1e9) if link and moved else None
    extra = ro["median_s"] - rn["median_s"]
    out[side] = {"tokens_per_s_offload": ro["tokens_per_s"], "tokens_per_s_none": rn["tokens_per_s"],
                 "kept": ro["tokens_per_s"] / rn["tokens_per_s"], "step_s_offload": ro["median_s"],
                 "step_s_none": rn["median_s"], "offload_adds_s": extra, "moved_bytes_per_step": moved,
                 "moved_source": "compiled step's S(5) entry buffers" if side == "jax" else
                 "planner transfer model (grads down, params up: 2 x e x N)",
                 "transfer_s_at_measured_bw": transfer_s, "link": link,
                 "hidden_fraction": (1 - extra / transfer_s) if transfer_s else None}
  return out


# ----------------------------------------------------------------------------- largest

def part_largest(suite: Suite, side: str) -> None:
  """Doubling then bisection over n_layers at the fixed width, one probe process each, within the side's budget."""
  a = suite.args
  base = sizing.tiny_run() if suite.tiny else sizing.fixed_run()
  dev = suite.records["device"].get("memory_total_bytes")
  host = suite.records["device"]["host_available_bytes"]
  if side == "deepspeed":
    wait_op_build(suite)
  if suite.tiny:
    start, why = base.model.n_layers, "tiny: the preset's depth"
  else:
    start = max(1, sizing.predicted_largest(base, side, dev, host))
    why = f"the memory model's largest n_layers ({sizing.PROBE_PLANS[side]}, micro batch 1)"

  def probe(n: int) -> dict:
    run = sizing.probe_run(base, side, n)
    if not suite.tiny:
      ok, text = sizing.predicted_fits(run, side, None, host)  # the host is the hard limit: never exceed it
      if not ok:
        return {"status": "host-limit", "detail": f"not started: {text}"}
    spec = write_spec(run, suite.out / "parts" / f"largest_{side}_{n}.spec.json")
    env, pool = sizing.jax_pool(run) if side == "jax" else ({}, None)  # the pool sized from the plan
    rec = run_part(suite, f"largest_{side}_{n}", SIDES[side], ["--spec", str(spec), "--steps", "1", "--warmup", "1",
                                                                "--fast-init"], a.probe_timeout_s, env=env)
    extra = {"pool": pool} if pool else {}
    if rec["ok"]:
      r = rec["result"]
      return {"status": "ok", "n_params": r["n_params"], "peak_device_bytes": r["peak_device_bytes"],
              "peak_host_rss_bytes": r["peak_host_rss_bytes"], "step_s": r["median_s"], "wall_s": rec["wall_s"],
              **extra}
    return {"status": rec["failure"], "detail": rec.get("detail"), "stderr_tail": rec.get("stderr_tail", ""),
            **extra}

  res = sizing.search_largest(probe, start, max_probes=a.max_probes, min_probe_s=a.min_part_s, time_left=suite.left)
  res.update(plan=sizing.PROBE_PLANS[side], start=start, start_why=why, d_model=base.model.d_model,
             seq_len=base.train.seq_len, link=link_gbs(suite, side))
  if res["largest_ok"]:
    res["largest_params"] = next(p["n_params"] for p in res["probes"] if p["n_layers"] == res["largest_ok"])
  suite.records[f"largest_{side}"] = res
  say(f"largest {side}: {res['largest_ok']} layers trained; {res['stopped']}")


def run_side(suite: Suite, side: str, configs: dict, deadline: float) -> None:
  """One side's chain (raw, train, largest: those asked for) against its own deadline; a crash of the driver's
  code for one side is recorded, not raised, so the other side and the files still come."""
  suite.local.deadline = deadline
  try:
    if "raw" in suite.args.parts:
      part_raw(suite, side)
    if "train" in suite.args.parts and configs:
      part_train(suite, side, configs)
    if "largest" in suite.args.parts:
      part_largest(suite, side)
  except Exception as exc:  # the suite must still write what it has
    import traceback
    suite.records[f"driver_{side}"] = {"ok": False, "failure": "error", "detail": f"{type(exc).__name__}: {exc}",
                                       "stderr_tail": tail(traceback.format_exc())}
    say(f"{side}: driver error {type(exc).__name__}: {exc}")


def run_sides(suite: Suite, configs: dict) -> None:
  """GPU: the JAX chain, then the DeepSpeed chain, each with half of the budget left (they must not share the
  device). --tiny: both at once on the CPU (the figures are checks, not measurements)."""
  if suite.tiny:
    threads = [threading.Thread(target=run_side, args=(suite, side, configs, suite.deadline), daemon=True)
               for side in SIDES]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    return
  for i, side in enumerate(SIDES):
    run_side(suite, side, configs, time.monotonic() + suite.left() / (len(SIDES) - i))


# ----------------------------------------------------------------------------- header, main

def device_info(args: argparse.Namespace) -> dict:
  """nvidia-smi text and the first GPU's name and memory (none on CPU), host memory."""
  out = {"nvidia_smi": "", "name": None, "memory_total_bytes": None}
  try:
    out["nvidia_smi"] = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    if q:
      name, mib = (s.strip() for s in q[0].rsplit(",", 1))
      out.update(name=name, memory_total_bytes=int(float(mib)) * 2**20)
  except (OSError, subprocess.SubprocessError, ValueError):
    pass
  if args.device_gib:
    out["memory_total_bytes"] = int(args.device_gib * 2**30)
  mem = host_memory_bytes()
  out["host_total_bytes"] = mem.get("MemTotal")
  out["host_available_bytes"] = int(args.host_gib * 2**30) if args.host_gib else mem.get("MemAvailable", 0)
  return out


def header(args: argparse.Namespace) -> dict:
  versions = {}
  for p in PACKAGES:
    try:
      versions[p] = md.version(p)
    except md.PackageNotFoundError:
      versions[p] = None
  env = {k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "JAX_DEFAULT_MATMUL_PRECISION", "XLA_FLAGS",
                                        "PYTHONUNBUFFERED", "TORCH_EXTENSIONS_DIR", "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB")
         if os.environ.get(k)}
  return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "mode": "tiny (CPU check)" if args.tiny else "full",
          "machine": f"{platform.platform()}, {os.cpu_count()} CPUs", "python": sys.version.split()[0],
          "versions": versions, "env": env, "argv": sys.argv[1:]}


def set_environment(args: argparse.Namespace) -> None:
  """What benchmarks/gpu.sh exports, where unset, so the parts inherit it from a bare `python benchmarks/gpu.py`
  too; --tiny also compiles XLA's CPU code unoptimised (the CPU check times nothing that matters, and it halves
  the compile of each JAX part on a 2-core machine)."""
  for key, value in (("PYTHONUNBUFFERED", "1"), ("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),
                     ("JAX_DEFAULT_MATMUL_PRECISION", "highest")):
    os.environ.setdefault(key, value)
  if args.tiny and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--tiny", action="store_true", help="CPU check: gpt2-tiny, tiny buffers, 1 probe per side")
  ap.add_argument("--out", default=os.environ.get("OUT") or f"benchmarks/results/gpu-{time.strftime('%Y-%m-%d')}")
  ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
  ap.add_argument("--budget-s", type=float, help="whole suite, seconds (default 480; --tiny 240)")
  ap.add_argument("--steps", type=int, help="timed steps per train run (default 3; --tiny 2)")
  ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (compile / first-step allocations)")
  ap.add_argument("--device-gib", type=float, help="accelerator memory to size for (default: nvidia-smi's)")
  ap.add_argument("--host-gib", type=float, help="host memory the runs may use (default: MemAvailable)")
  ap.add_argument("--max-probes", type=int, help="largest-model probes per side (default 8; --tiny 1)")
  args = ap.parse_args(argv)
  tiny = args.tiny
  args.budget_s = args.budget_s or (240.0 if tiny else 480.0)
  args.steps = args.steps or (2 if tiny else 3)
  args.max_probes = args.max_probes or (1 if tiny else 8)
  # per-part limits: tiny runs take seconds each on a CPU; the GPU figures leave room for the ~8 minute total
  args.mib, args.matmul_n, args.reps = (8, 256, 3) if tiny else (1024, 8192, 5)
  args.part_timeout_s, args.train_timeout_s, args.probe_timeout_s = (60, 90, 90) if tiny else (90, 150, 150)
  args.op_build_timeout_s, args.min_part_s = (240, 5) if tiny else (240, 20)
  parts = [p.strip() for p in args.parts.split(",") if p.strip()]
  bad = [p for p in parts if p not in PARTS]
  if bad or not parts:
    ap.error(f"--parts {args.parts!r}: choose from {', '.join(PARTS)}")
  for key in ("budget_s", "steps", "max_probes"):
    if getattr(args, key) <= 0:
      ap.error(f"--{key.replace('_', '-')} must be > 0; got {getattr(args, key)}")
  args.parts = parts
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  set_environment(args)
  out = Path(args.out)
  for sub in ("parts", "logs"):
    (out / sub).mkdir(parents=True, exist_ok=True)
  suite = Suite(args, out, time.monotonic() + args.budget_s)
  t0 = time.monotonic()
  suite.records["device"] = device_info(args)
  if not args.tiny and not suite.records["device"]["memory_total_bytes"] and set(args.parts) - {"raw"}:
    print("gpu.py: no accelerator found (nvidia-smi reports none) to size the train and largest parts for; on a "
          "CPU machine run --tiny, or give --device-gib", file=sys.stderr)
    return 2
  say(f"{'tiny CPU check' if args.tiny else 'full run'}: parts {','.join(args.parts)}, budget {args.budget_s:.0f} s, "
      f"device {suite.records['device']['name'] or 'none (CPU)'}, out {out}")
  configs = {}
  if "train" in args.parts:
    info, configs = train_configs(suite)
    suite.records["sizing"] = info
    for line in info["why"]:
      say(line)
  if not args.tiny and ("train" in args.parts or "largest" in args.parts):
    start_op_build(suite)  # tiny: the DeepSpeed parts load the built op themselves (2 cores: no spare CPU)
  try:
    run_sides(suite, configs)
    if suite.op_build is not None:
      wait_op_build(suite)
  except KeyboardInterrupt:  # the running part's tree is already killed (harness.launch); write what there is
    suite.records["interrupted"] = {"ok": False, "failure": "interrupted", "detail": "Ctrl-C / SIGINT"}
    if suite.op_build is not None and suite.op_build.poll() is None:
      lifetime.kill_tree(suite.op_build.pid)
  data = {"header": header(args), "device": suite.records.pop("device"), "records": suite.records,
          "offload": offload_summary(suite) if "train" in args.parts else {}, "sides_concurrent": args.tiny,
          "suite_wall_s": time.monotonic() - t0}
  write_json(out / "gpu.json", data)
  (out / "gpu.md").write_text(report.markdown(data))
  failed = report.failed_parts(data)
  say(f"wrote {out / 'gpu.json'} and {out / 'gpu.md'} in {data['suite_wall_s']:.0f} s; "
      f"{len(failed)} part(s) failed{': ' + ', '.join(failed) if failed else ''}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
