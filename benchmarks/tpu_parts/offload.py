"""Host offload of the JAX side on one accelerator: which layout of the copies hides them, and what it saves.

  python3 benchmarks/tpu_parts/offload.py --out DIR [--budget-s 420] [--tiny]
  bash benchmarks/tpu.sh offload                      # on a TPU VM, after its install

The driver (this process) never opens the accelerator: it runs the measurements as child processes of this same
file (`--child NAME`), one at a time (one process holds a TPU), each with its own environment, and writes
  DIR/offload/offload.json   every record: rates, equality, timings (tokens/s, compiled device bytes, bytes moved)
  DIR/offload/offload.md     the tables, with the derived overlap and memory figures
  DIR/offload.tgz            both, for the trip back
Children:
  rates      the in-step host<->device rate: one jitted program that reads a pinned_host array (H2D), one that
             writes one (D2H), one that does both (what a step with offloaded state does), bytes / median seconds
  equality   offload on/off in fp32 on a tiny model: every offload plan's params and Adam moments after N steps
             against the same layout without offload (bitwise, or the max |difference|)
  timing     the project's step (jax_impl.step.Trainer) on a llama-shaped model at 4k and 32k tokens per step for
             each variant: no offload, the optimizer-state offload layouts (jax_impl.stream.StreamOptions), params +
             optimizer state; tokens/s, the compiled device peak (memory_analysis), bytes moved per step
  flags      `timing` again for the variants that matter, under the XLA:TPU host-offload scheduler flags
--tiny runs every child on a CPU with a tiny model and short steps (tests/test_offload_bench.py): the figures are
checks, not measurements.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks.tpu_parts import offload_report as report  # noqa: E402

HOST_OFFLOAD_FLAGS = (
    "--xla_tpu_enable_all_experimental_scheduler_features=true",
    "--xla_tpu_enable_scheduler_memory_pressure_tracking=true",
    "--xla_tpu_host_transfer_overlap_limit=24",
    "--xla_tpu_aggressive_opt_barrier_removal=ENABLED",
    "--xla_lhs_prioritize_async_depth_over_stall=ENABLED",
    "--xla_should_allow_loop_variant_parameter_in_chain=ENABLED",
    "--xla_should_add_loop_invariant_op_in_chain=ENABLED",
    "--xla_max_concurrent_host_send_recv=100",
    "--xla_tpu_scheduler_percent_shared_memory_limit=100",
    "--xla_latency_hiding_scheduler_rerun=2",
)
"""The XLA:TPU scheduler flags MaxText sets for host offload (the HOST_OFFLOAD_FLAGS of its XLA flags library), less
the all-gather pipelining flag, which has no collective to act on with one chip."""

# (name, plan fields, stream options): the order is the priority order (a child stops at its budget).
VARIANTS = (
    ("no-offload", dict(offload_opt_state=False), {}),
    ("opt-deferred", dict(), dict(deferred=True)),
    ("opt-deferred-home-after", dict(), dict(deferred=True, home_after_loop=True)),
    ("opt-stream", dict(), {}),
    ("opt-stream-unroll-all", dict(), dict(unroll=0)),
    ("opt-whole-tree", dict(), dict(enabled=False)),
    ("opt-stream-in-place", dict(), dict(in_place=True)),
    ("params+opt-stream", dict(offload_params=True), {}),
    ("opt-stream-unroll-2", dict(), dict(unroll=2)),
    ("opt-stream-unpinned", dict(host_memory_kind="unpinned_host"), {}),
    ("opt-ratio-0.5", dict(offload_opt_ratio=0.5), {}),  # part of the moments (jax.offload_opt_ratio): the copies
    ("opt-ratio-0.25", dict(offload_opt_ratio=0.25), {}),  # shrink with the share, and so does the memory given back
)
FLAG_VARIANTS = ("no-offload", "opt-deferred", "opt-whole-tree", "opt-stream")
GRAD_ACCUM = (2, 16)
"""Micro batches per step at micro batch 2 x 1024 tokens: 4k and 32k tokens per step (micro batch 4 did not leave
room for the no-offload step's 32k-token accumulation on a 16 GiB chip: 16.6 GB of temporaries)."""


def model_spec(tiny: bool):
  """The timed model: llama-shaped, ~0.24B params (d_model 1024, 16 layers, SwiGLU 2816, vocab 32000), the size
  the first TPU measurements used; tiny: 2 layers of width 64."""
  from parity.spec import ModelSpec
  if tiny:
    return ModelSpec(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64,
                     norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False)
  return ModelSpec(vocab_size=32000, d_model=1024, n_layers=16, n_heads=16, n_kv_heads=16, d_ff=2816,
                   max_seq_len=1024, norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False)


# ----------------------------------------------------------------------------- children (they open the device)


def _median_time(fn, reps: int) -> float:
  import jax
  jax.block_until_ready(fn())
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def child_rates(args) -> dict:
  """In-step copy rates between pinned_host and the device, GB/s (10^9 B), for a buffer the size of args.mib."""
  import jax
  import numpy as np
  dev = jax.devices()[0]
  n = args.mib * 2**20 // 4
  host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
  x_host = jax.device_put(np.ones(n, np.float32), host)
  x_dev = jax.device_put(np.ones(n, np.float32), on_dev)
  # Each program writes into a donated buffer of its own output's memory, as a train step with donated offloaded state
  # does: a fresh pinned_host output each call would time the host allocator (~0.5 GB/s), not the link.
  h2d = jax.jit(lambda x, d: d + jax.device_put(x, jax.memory.Space.Device), out_shardings=on_dev, donate_argnums=1)
  d2h = jax.jit(lambda d, h: d * 2.0, out_shardings=host, donate_argnums=1, keep_unused=True)
  both = jax.jit(lambda x: x * 2.0, in_shardings=host, out_shardings=host, donate_argnums=0)
  nbytes = n * 4
  out = {"bytes": nbytes, "device": dev.device_kind, "backend": jax.default_backend()}
  bufs = {"dev": jax.device_put(np.zeros(n, np.float32), on_dev), "host": jax.device_put(np.zeros(n, np.float32), host),
          "both": x_host}

  def step(name):
    if name == "h2d":
      bufs["dev"] = h2d(x_host, bufs["dev"])
      return bufs["dev"]
    if name == "d2h":
      bufs["host"] = d2h(x_dev, bufs["host"])
      return bufs["host"]
    bufs["both"] = both(bufs["both"])
    return bufs["both"]

  for name, moved in (("h2d", nbytes), ("d2h", nbytes), ("both", 2 * nbytes)):
    try:
      s = _median_time(lambda: step(name), args.reps)
      out[name] = {"seconds": s, "gb_per_s": moved / s / 1e9, "bytes_moved": moved}
    except Exception as e:  # a layout the backend refuses is a finding, not a crash
      out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
  return out


def _run(model, plan_fields: dict, ga: int, micro: int, seq: int, precision: str, validate: bool = True):
  from parity.spec import JaxPlan, RunSpec, TrainSpec
  plan = JaxPlan(scan_layers=True, **plan_fields)
  train = TrainSpec(steps=8, micro_batch_size=micro, grad_accum_steps=ga, seq_len=seq, precision=precision,
                    warmup_steps=1, eval_every=0)
  run = RunSpec(model=model, train=train, jax=plan, sides=("jax",))
  return run.validate() if validate else run  # the device twins of the act-offload policies are internal names


def _set_stream(options: dict) -> None:
  from jax_impl import stream
  stream.OPTIONS = stream.StreamOptions(**options)


def child_equality(args) -> dict:
  """fp32, tiny llama: every offload layout's params and moments after args.eq_steps steps, against its no-offload
  twin (the optimizer-state and params layouts against no offload; each activation-offload policy against the
  policy that keeps the same residuals in device memory, so that a different recompute is not counted)."""
  import numpy as np
  from parity.weights import init_params
  from jax_impl.step import Trainer
  model = model_spec(True)
  nothing = dict(offload_opt_state=False)
  cases = [("no-offload", nothing, {}, "none", None)] + [(n, f, o, "none", "no-offload") for n, f, o in VARIANTS[1:]]
  for policy, twin in (("offload_names", "save_names"), ("offload_dots_no_batch", "save_dots_no_batch")):
    cases += [(f"ref-{twin}", nothing, {}, twin, None), (f"act-{policy}", nothing, {}, policy, f"ref-{twin}")]
  rng = np.random.default_rng(3)
  batches = [rng.integers(0, model.vocab_size, (2, 2, 33)).astype(np.uint16) for _ in range(args.eq_steps)]
  rows, results = [], {}
  for name, fields, options, remat, ref in cases:
    row = {"variant": name, "remat": remat, "reference": ref}
    try:
      _set_stream(options)
      run = _run(model, {**fields, "remat": remat}, 2, 2, 32, "fp32", validate=not name.startswith("ref-"))
      t = Trainer.build(run, init_params(model, 0))
      t.compile((2, 2, 33), None)
      losses = [t.step(b)["loss"] for b in batches]
      results[name] = (t.canonical_params(), t.canonical_moments(), losses)
      if ref in results:
        (p0, m0, l0), (p1, m1, _) = results[ref], results[name]
        dp = max(float(np.max(np.abs(p1[k] - p0[k]))) for k in p0)
        dm = max(float(np.max(np.abs(m1[k] - m0[k]))) for k in m0)
        row.update(max_abs_param_diff=dp, max_abs_moment_diff=dm, bitwise=dp == 0.0 and dm == 0.0,
                   loss_equal=losses == l0)
    except Exception as e:
      row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    _set_stream({})
    if row.get("reference") is not None or "error" in row:
      rows.append(row)
    save_partial(args, {"steps": args.eq_steps, "rows": rows})
  return {"steps": args.eq_steps, "rows": rows}


def _compiled_bytes(ma: dict) -> dict:
  """Device and host bytes of a compiled step from its memory_analysis fields (common.compiled_device_peak):
  'device_peak_bytes' = XLA's peak less the step's host buffers (device memory only) and 'device_from' how;
  'host_bytes' = the step's pinned_host buffers; 'sum_bytes' = the compiler's argument + output + temp - alias, which
  on a TPU counts temporaries the runtime does not hold at once (not a device peak)."""
  from benchmarks.gpu_parts.common import compiled_device_peak
  c = compiled_device_peak(ma)
  get = lambda k: int(ma.get(k, 0) or 0)
  return {"device_peak_bytes": c["device_bytes"], "device_from": c["device_from"], "host_bytes": c["host_bytes"] or 0,
          "sum_bytes": c["peak_bytes"], "temp_bytes": get("temp_size_in_bytes")}


def _time_variant(name: str, fields: dict, options: dict, ga: int, args) -> dict:
  import jax
  import numpy as np
  from benchmarks.gpu_parts.common import fast_params, peak_rss_bytes, reset_peak_rss
  from jax_impl import offload
  from jax_impl.step import Trainer
  from parity.sizing.cost import flops_per_token, strict_flops_per_token
  model = model_spec(args.tiny)
  micro, seq = (2, 32) if args.tiny else (2, 1024)
  run = _run(model, fields, ga, micro, seq, "bf16")
  _set_stream(options)
  rec = {"variant": name, "grad_accum": ga, "micro": micro, "seq": seq, "tokens_per_step": ga * micro * seq,
         "plan": {k: getattr(run.jax, k) for k in ("offload_opt_state", "offload_params", "host_memory_kind",
                                                    "scan_layers", "remat")}, "stream": options}
  try:
    reset_peak_rss()
    t0 = time.perf_counter()
    t = Trainer.build(run, fast_params(model))
    shape = (ga, micro, seq + 1)
    t.compile(shape, None)
    rec["build_compile_s"] = time.perf_counter() - t0
    rec["compile_s"] = t.compile_s
    rec["memory_analysis"] = t.memory_analysis
    rec.update(_compiled_bytes(t.memory_analysis))
    ev = t.offload_evidence()
    moved = {g: ev[g] for g in ("offload_params", "offload_opt_state") if g in ev}
    rec["entry_moved_bytes"] = sum(v["moved_bytes_per_step"] for v in moved.values())
    dev = t.placement.mesh.devices.flat[0]
    rec["state_bytes_by_kind"] = offload.bytes_by_memory_kind(t.state, dev)
    rng = np.random.default_rng(0)
    times = []
    for i in range(args.warmup + args.steps):
      batch = rng.integers(0, model.vocab_size, shape).astype(np.uint16)
      s0 = time.perf_counter()
      m = t.step(batch)
      if i >= args.warmup:
        times.append(time.perf_counter() - s0)
    med = statistics.median(times)
    rec.update(step_s=times, median_s=med, tokens_per_s=rec["tokens_per_step"] / med, loss=m["loss"],
               peak_rss_bytes=peak_rss_bytes(), n_params=int(sum(x.size for x in jax.tree.leaves(t.state.params))),
               flops_per_token=float(flops_per_token(model, seq)),
               strict_flops_per_token=float(strict_flops_per_token(model, seq)))  # exact kernel: dense
    del t
  except Exception as e:
    rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
  finally:
    _set_stream({})
  return rec


def child_timing(args) -> dict:
  """Every variant (or args.variants) at each grad accumulation, in priority order, within the budget."""
  import jax
  dev = jax.devices()[0]
  head = lambda rows: {"device": dev.device_kind, "backend": jax.default_backend(), "rows": rows,
                       "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""),
                       "xla_flags": os.environ.get("XLA_FLAGS", "")}
  names = args.variants.split(",") if args.variants else [v[0] for v in VARIANTS]
  table = {v[0]: v for v in VARIANTS}
  rows, deadline = [], time.monotonic() + args.budget_s
  for name in names:
    _, fields, options = table[name]
    for ga in (tuple(int(x) for x in args.grad_accum.split(",")) if args.grad_accum else GRAD_ACCUM):
      if time.monotonic() > deadline:
        rows.append({"variant": name, "grad_accum": ga, "error": "not run: the child's budget ended"})
        continue
      rec = _time_variant(name, fields, options, ga, args)
      print(json.dumps({k: rec.get(k) for k in ("variant", "grad_accum", "tokens_per_s", "device_peak_bytes",
                                                "entry_moved_bytes", "error")}), flush=True)
      rows.append(rec)
      save_partial(args, head(rows))
  return head(rows)


CHILDREN = {"rates": child_rates, "equality": child_equality, "timing": child_timing}


def save_partial(args, out: dict) -> None:
  """Writes a child's record so far (a child killed at its timeout still leaves the rows it finished)."""
  Path(args.json).write_text(json.dumps({**out, "partial": True}, indent=1, default=str))


def run_child(args) -> int:
  import jax
  out = CHILDREN[args.child](args)
  out["versions"] = {"jax": jax.__version__}
  Path(args.json).write_text(json.dumps(out, indent=1, default=str))
  return 0


# ----------------------------------------------------------------------------- driver (never opens the device)


def _spawn(args, name: str, child: str, extra: list[str], env_add: dict, timeout: float, script: str = __file__
           ) -> dict:
  """Runs `script --child CHILD` (this file's children by default) within `timeout` seconds; its record."""
  out_json = args.work / f"{name}.json"
  cmd = [sys.executable, script, "--child", child, "--json", str(out_json), "--budget-s", str(max(10, timeout - 40)),
         *extra] + (["--tiny"] if args.tiny else [])
  env = {**os.environ, **env_add}
  t0 = time.monotonic()
  log = args.work / f"{name}.log"
  with open(log, "w") as fh:
    try:
      proc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout)
      rc = proc.returncode
    except subprocess.TimeoutExpired:
      rc = "timeout"
  rec = {"child": child, "rc": rc, "wall_s": time.monotonic() - t0, "env": env_add}
  if out_json.exists():
    rec.update(json.loads(out_json.read_text()))
  else:
    rec["log_tail"] = log.read_text()[-2000:]
  print(f"[offload] {name}: rc={rc} in {rec['wall_s']:.0f} s", flush=True)
  return rec


def drive(args) -> int:
  t_start = time.monotonic()
  args.work = args.out / "offload"
  args.work.mkdir(parents=True, exist_ok=True)
  left = lambda: args.budget_s - (time.monotonic() - t_start)
  flags_env = {"LIBTPU_INIT_ARGS": " ".join(filter(None, [os.environ.get("LIBTPU_INIT_ARGS", ""),
                                                             *HOST_OFFLOAD_FLAGS]))}
  result = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "mode": "tiny (CPU check)" if args.tiny else "full",
            "host": report.host_info(), "children": {}}
  common = ["--mib", str(args.mib), "--reps", str(args.reps), "--steps", str(args.steps), "--warmup",
            str(args.warmup), "--eq-steps", str(args.eq_steps)] + (["--grad-accum", args.grad_accum]
                                                                  if args.grad_accum else [])
  plan = [("rates", "rates", [], {}, 0.09), ("equality", "equality", [], {}, 0.14),
          ("timing", "timing", [], {}, 0.6), ("flags", "timing", ["--variants", ",".join(FLAG_VARIANTS)],
                                              flags_env, 1.0)]
  if args.only:
    plan = [p for p in plan if p[0] in args.only.split(",")]
  if args.variants:  # the timing child's variants (the flags child keeps its own)
    plan = [(n, c, x + ["--variants", args.variants] if n == "timing" else x, e, s) for n, c, x, e, s in plan]
  result["children"] = run_children(args, plan, common, left)
  write_results(args, "offload", result, report.markdown(result))
  return 0


def run_children(args, plan: list[tuple], common: list[str], left, script: str = __file__) -> dict:
  """Each (name, child, extra argv, env, share of the time left) of `plan` in turn, a child of `script`; the last runs
  to the end of the budget (`left()`: seconds left), one with under 20 s is recorded as not run."""
  children = {}
  for i, (name, child, extra, env_add, share) in enumerate(plan):
    share = 1.0 if i == len(plan) - 1 else share  # the last child runs to the end of the budget
    timeout = max(20.0, left() * share) if share < 1.0 else left() - 5
    if timeout < 20:
      children[name] = {"child": child, "error": "not run: the suite's budget ended"}
      continue
    children[name] = _spawn(args, name, child, common + extra, env_add, timeout, script=script)
  return children


def write_results(args, stem: str, result: dict, markdown: str) -> None:
  """args.work/STEM.json and STEM.md, the folder tarred as args.out/STEM.tgz, the tables printed."""
  (args.work / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
  (args.work / f"{stem}.md").write_text(markdown)
  with tarfile.open(args.out / f"{stem}.tgz", "w:gz") as tar:
    for f in sorted(args.work.iterdir()):
      tar.add(f, arcname=f"{stem}/{f.name}")
  print(markdown, flush=True)


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", type=Path, help="results folder (driver)")
  ap.add_argument("--budget-s", type=float, default=None, help="whole run (driver) or child, seconds")
  ap.add_argument("--tiny", action="store_true", help="CPU check: tiny model and buffers")
  ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
  ap.add_argument("--json", help=argparse.SUPPRESS)
  ap.add_argument("--variants", help="timing: comma-separated variant names (default: all, in priority order)")
  ap.add_argument("--only", help="driver: comma-separated children to run (rates, equality, timing, flags)")
  ap.add_argument("--mib", type=int, default=None)
  ap.add_argument("--reps", type=int, default=None)
  ap.add_argument("--steps", type=int, default=None)
  ap.add_argument("--warmup", type=int, default=None)
  ap.add_argument("--eq-steps", type=int, default=None)
  ap.add_argument("--grad-accum", help="timing: comma-separated micro batches per step (default 2,16: 4k and 32k "
                                       "tokens)")
  args = ap.parse_args(argv)
  tiny = args.tiny
  defaults = dict(budget_s=420.0 if tiny else 460.0, mib=4 if tiny else 512, reps=2 if tiny else 5,
                  steps=2 if tiny else 4, warmup=1 if tiny else 2, eq_steps=3 if tiny else 4)
  for k, v in defaults.items():
    if getattr(args, k) is None:
      setattr(args, k, v)
  if args.child is None and args.out is None:
    ap.error("--out is required")
  whole = lambda x: x.strip().isdecimal() and int(x) > 0  # isdigit passes '²', which int() refuses
  if args.grad_accum is not None and not all(whole(x) for x in args.grad_accum.split(",")):
    ap.error(f"--grad-accum {args.grad_accum!r}: whole numbers > 0, comma-separated (e.g. 2,16)")
  known = [v[0] for v in VARIANTS]
  bad = [x for x in (args.variants or "").split(",") if args.variants is not None and x not in known]
  if bad:
    ap.error(f"--variants {args.variants!r}: unknown {', '.join(bad)}; choose from {', '.join(known)}")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.child:
    return run_child(args)
  return drive(args)


if __name__ == "__main__":
  sys.exit(main())
