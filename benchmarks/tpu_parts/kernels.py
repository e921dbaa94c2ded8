"""Two questions the offload and MFU figures hinge on, answered on the chip: can a host copy run under compute in one
XLA:TPU program, and what does the step reach with the flash-attention kernel.

  python3 benchmarks/tpu_parts/kernels.py --out DIR [--budget-s 420] [--tiny] [--only overlap,mfu]
  bash benchmarks/tpu.sh kernels                      # on a TPU VM, after its install

The driver never opens the accelerator; each child does (one process holds a TPU), as in offload.py:
  overlap  one jitted program per layout of L slices of a pinned_host stack and L blocks of matmuls: compute alone,
           the copies alone (each slice in to the device and back out), both in one loop with the compute reading
           the slice it fetched (dependent), not reading it (independent), reading the slice the previous iteration
           prefetched (prefetch), and the copies outside the compute loop (apart). Hidden share =
           (t_compute + t_copies - t_both) / min(t_compute, t_copies): 1 when the shorter one is entirely under the
           longer, 0 when they run in series. Run twice: the runtime's default flags, and MaxText's host-offload
           scheduler flags (offload.HOST_OFFLOAD_FLAGS).
  mfu      the project's step (jax_impl.step.Trainer), bf16, no offload and the deferred optimizer-state offload, for
           each attention kernel (jax_impl.kernels: exact, flash) on two llama-shaped widths; tokens/s, MFU against
           the chip's bf16 data-sheet peak (offload_report.PEAK_BF16), the compiled device peak; and the first
           step's loss of flash against exact on the same weights and batch (the speed layout's rounding, nats).
Writes DIR/kernels/kernels.json (every record), kernels.md (the tables) and DIR/kernels.tgz.
--tiny runs on a CPU with tiny shapes and the exact kernel only (tests/test_kernels_bench.py): checks, not figures.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks.tpu_parts import offload  # noqa: E402
from benchmarks.tpu_parts import kernels_report as report  # noqa: E402


# ----------------------------------------------------------------------------- overlap child


def _overlap_programs(n_layers: int, slice_elems: int, dim: int, reps: int):
  """The jitted programs of the overlap child (module docstring), with their donated host buffers' makers."""
  import jax
  import jax.numpy as jnp
  dev = jax.devices()[0]
  host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
  to_dev = lambda x: jax.device_put(x, jax.memory.Space.Device)
  to_host = lambda x: jax.device_put(x, jax.memory.Space.Host)

  def chain(x, w):
    for _ in range(reps):
      x = jnp.tanh(jnp.dot(x, w, preferred_element_type=jnp.float32)).astype(jnp.bfloat16)
    return x

  def compute(x, w):
    return jax.lax.fori_loop(0, n_layers, lambda i, x: chain(x, w), x)

  def copies(h):
    return jax.lax.scan(lambda c, s: (c, to_host(to_dev(s) * 2.0)), None, h)[1]

  def dependent(x, w, h):
    def body(x, s):
      d = to_dev(s)
      x = chain(x + d[:1].astype(jnp.bfloat16).reshape(1, 1), w)
      return x, to_host(d * 2.0)
    return jax.lax.scan(body, x, h)

  def independent(x, w, h):
    def body(x, s):
      return chain(x, w), to_host(to_dev(s) * 2.0)
    return jax.lax.scan(body, x, h)

  def prefetch(x, w, h):
    def body(carry, i):
      x, cur = carry
      nxt = to_dev(jax.lax.dynamic_index_in_dim(h, jnp.minimum(i + 1, n_layers - 1), keepdims=False))
      x = chain(x + cur[:1].astype(jnp.bfloat16).reshape(1, 1), w)
      return (x, nxt), to_host(cur * 2.0)
    first = to_dev(jax.lax.dynamic_index_in_dim(h, 0, keepdims=False))
    (x, _), out = jax.lax.scan(body, (x, first), jnp.arange(n_layers))
    return x, out

  def apart(x, w, h):
    return compute(x, w), copies(h)

  progs = {
      "compute": (jax.jit(compute, out_shardings=on_dev), False),
      "copies": (jax.jit(copies, in_shardings=host, out_shardings=host, donate_argnums=0), True),
      "dependent": (jax.jit(dependent, in_shardings=(on_dev, on_dev, host), out_shardings=(on_dev, host),
                            donate_argnums=2), True),
      "independent": (jax.jit(independent, in_shardings=(on_dev, on_dev, host), out_shardings=(on_dev, host),
                              donate_argnums=2), True),
      "prefetch": (jax.jit(prefetch, in_shardings=(on_dev, on_dev, host), out_shardings=(on_dev, host),
                           donate_argnums=2), True),
      "apart": (jax.jit(apart, in_shardings=(on_dev, on_dev, host), out_shardings=(on_dev, host),
                        donate_argnums=2), True),
  }
  make = {"x": lambda: jax.device_put(jnp.ones((dim, dim), jnp.bfloat16) * 0.01, on_dev),
          "w": lambda: jax.device_put(jnp.eye(dim, dtype=jnp.bfloat16), on_dev),
          "h": lambda: jax.device_put(jnp.ones((n_layers, slice_elems), jnp.float32), host)}
  return progs, make


def child_overlap(args) -> dict:
  """Times each program of `_overlap_programs` (median of args.reps calls after one warm call)."""
  import jax
  n_layers, slice_elems, dim, reps = (4, 4096, 64, 2) if args.tiny else (16, 8 << 20, 4096, 4)
  progs, make = _overlap_programs(n_layers, slice_elems, dim, reps)
  x, w = make["x"](), make["w"]()
  bufs = {"h": make["h"]()}
  out = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "layers": n_layers,
         "slice_bytes": slice_elems * 4, "matmul_dim": dim, "matmuls_per_layer": reps,
         "bytes_moved": 2 * n_layers * slice_elems * 4, "flops": 2 * dim ** 3 * reps * n_layers,
         "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""), "rows": {}}

  def call(name):
    fn, donates = progs[name]
    if name == "compute":
      return fn(x, w)
    if name == "copies":
      bufs["h"] = fn(bufs["h"])
      return bufs["h"]
    res, bufs["h"] = fn(x, w, bufs["h"])
    return res

  for name in progs:
    try:
      out["rows"][name] = {"seconds": offload._median_time(lambda: call(name), args.reps)}
    except Exception as e:  # a layout the compiler refuses is a finding
      out["rows"][name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
      bufs["h"] = make["h"]()
    offload.save_partial(args, out)
  return out


# ----------------------------------------------------------------------------- mfu child


def model_spec(width: str):
  """llama-shaped models: 'tiny' (CPU check), 'd1024' (271M, offload.py's), 'd2048' (8 layers, 542M: its fp32
  weights, gradients and Adam moments take 8.7 GB of a 16 GiB chip without offload), 'd2048x16' (954M: 15.3 GB of
  them, so it runs with the optimizer-state offload only)."""
  from parity.spec import ModelSpec
  if width == "tiny":
    return offload.model_spec(True)
  if width == "d1024":
    return offload.model_spec(False)
  layers = 16 if width == "d2048x16" else 8
  return ModelSpec(vocab_size=32000, d_model=2048, n_layers=layers, n_heads=16, n_kv_heads=16, d_ff=5632,
                   max_seq_len=2048, norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False)


# (model width, plan fields, stream options, micro batch, grad accum, seq): priority order
MFU_CASES = (
    ("d1024", {"offload_opt_state": False}, {}, 2, 16, 1024),  # offload.py's no-offload row at 32k tokens
    ("d2048", {"offload_opt_state": False}, {}, 1, 16, 2048),  # micro 2: 22.2 GB of temporaries (exact), refused
    ("d2048x16", {}, {"deferred": True}, 1, 16, 2048),  # flash 17.4 GB, exact 24.0 GB at micro 1: the flash
    ("d2048x16", {"remat": "save_dots_no_batch"}, {"deferred": True}, 1, 16, 2048),  # kernel with dots saved
)
TINY_CASES = (("tiny", {"offload_opt_state": False}, {}, 2, 2, 32), ("tiny", {}, {"deferred": True}, 2, 2, 32))


def _time_case(width, fields, options, micro, ga, seq, kernel, args) -> dict:
  import jax
  import numpy as np
  from benchmarks.gpu_parts.common import fast_params
  from jax_impl import kernels
  from jax_impl.step import Trainer
  from parity.sizing.cost import flops_per_token
  from parity.spec import JaxPlan, RunSpec, TrainSpec
  model = model_spec(width)
  train = TrainSpec(steps=8, micro_batch_size=micro, grad_accum_steps=ga, seq_len=seq, precision="bf16",
                    warmup_steps=1, eval_every=0)
  run = RunSpec(model=model, train=train, jax=JaxPlan(scan_layers=True, **fields), sides=("jax",)).validate()
  rec = {"model": width, "plan": fields, "stream": options, "micro": micro, "grad_accum": ga, "seq": seq,
         "kernel": kernel, "tokens_per_step": micro * ga * seq}
  try:
    kernels.set_attention_kernel(kernel)
    offload._set_stream(options)
    t = Trainer.build(run, fast_params(model))
    shape = (ga, micro, seq + 1)
    t.compile(shape, None)
    rec.update(compile_s=t.compile_s, **offload._compiled_bytes(t.memory_analysis))
    rng = np.random.default_rng(0)
    batch = rng.integers(0, model.vocab_size, shape).astype(np.uint16)
    times, losses = [], []
    for i in range(args.warmup + args.steps):
      s0 = time.perf_counter()
      losses.append(t.step(batch)["loss"])
      if i >= args.warmup:
        times.append(time.perf_counter() - s0)
    med = sorted(times)[len(times) // 2]
    fpt = float(flops_per_token(model, seq))
    rec.update(step_s=times, median_s=med, tokens_per_s=rec["tokens_per_step"] / med, first_loss=losses[0],
               n_params=int(sum(x.size for x in jax.tree.leaves(t.state.params))), flops_per_token=fpt,
               peak_flops=offload.report.peak_bf16(jax.devices()[0].device_kind))
    rec["mfu"] = rec["tokens_per_s"] * fpt / rec["peak_flops"] if rec["peak_flops"] else None
    del t
  except Exception as e:
    rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
  finally:
    kernels.set_attention_kernel("exact")
    offload._set_stream({})
  return rec


def child_mfu(args) -> dict:
  import jax
  kernels_ = ("exact",) if args.tiny else ("flash", "exact")
  rows, deadline = [], time.monotonic() + args.budget_s
  head = lambda: {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "rows": rows}
  for case in (TINY_CASES if args.tiny else MFU_CASES):
    for kernel in kernels_:
      if time.monotonic() > deadline:
        rows.append({"model": case[0], "kernel": kernel, "error": "not run: the child's budget ended"})
        continue
      rec = _time_case(*case, kernel, args)
      print(json.dumps({k: rec.get(k) for k in ("model", "kernel", "tokens_per_s", "mfu", "device_peak_bytes",
                                                "first_loss", "error")}), flush=True)
      rows.append(rec)
      offload.save_partial(args, head())
  return head()


CHILDREN = {"overlap": child_overlap, "mfu": child_mfu}


def run_child(args) -> int:
  import jax
  out = CHILDREN[args.child](args)
  out["versions"] = {"jax": jax.__version__}
  Path(args.json).write_text(json.dumps(out, indent=1, default=str))
  return 0


# ----------------------------------------------------------------------------- driver (never opens the device)


def drive(args) -> int:
  t_start = time.monotonic()
  args.work = args.out / "kernels"
  args.work.mkdir(parents=True, exist_ok=True)
  left = lambda: args.budget_s - (time.monotonic() - t_start)
  flags_env = {"LIBTPU_INIT_ARGS": " ".join(filter(None, [os.environ.get("LIBTPU_INIT_ARGS", ""),
                                                             *offload.HOST_OFFLOAD_FLAGS]))}
  result = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "mode": "tiny (CPU check)" if args.tiny else "full",
            "host": offload.report.host_info(), "children": {}}
  common = ["--reps", str(args.reps), "--steps", str(args.steps), "--warmup", str(args.warmup)]
  plan = [("overlap", "overlap", [], {}, 0.2), ("overlap-flags", "overlap", [], flags_env, 0.25),
          ("mfu", "mfu", [], {}, 1.0)]
  if args.only:
    plan = [p for p in plan if p[0].split("-")[0] in args.only.split(",")]
  result["children"] = offload.run_children(args, plan, common, left, script=__file__)
  offload.write_results(args, "kernels", result, report.markdown(result))
  return 0


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", type=Path, help="results folder (driver)")
  ap.add_argument("--budget-s", type=float, default=None, help="whole run (driver) or child, seconds")
  ap.add_argument("--tiny", action="store_true", help="CPU check: tiny shapes, exact attention")
  ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
  ap.add_argument("--json", help=argparse.SUPPRESS)
  ap.add_argument("--only", help="driver: comma-separated children (overlap, mfu)")
  ap.add_argument("--reps", type=int, default=None)
  ap.add_argument("--steps", type=int, default=None)
  ap.add_argument("--warmup", type=int, default=None)
  args = ap.parse_args(argv)
  defaults = dict(budget_s=300.0 if args.tiny else 420.0, reps=2 if args.tiny else 5, steps=2 if args.tiny else 3,
                  warmup=1 if args.tiny else 2)
  for k, v in defaults.items():
    if getattr(args, k) is None:
      setattr(args, k, v)
  if args.child is None and args.out is None:
    ap.error("--out is required")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  return run_child(args) if args.child else drive(args)


if __name__ == "__main__":
  sys.exit(main())
