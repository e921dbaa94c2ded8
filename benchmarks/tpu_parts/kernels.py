"""Questions the offload and MFU figures hinge on, answered on the chip: can a host copy run under compute in one
XLA:TPU program, what does the step reach with the flash-attention kernel, how much device memory each offload
layout really gives back, and does flash train like exact.

  python3 benchmarks/tpu_parts/kernels.py --out DIR [--budget-s 420] [--tiny] [--only overlap,mfu,headroom,agree]
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
           each attention kernel (jax_impl.kernels: exact, flash) on two llama-shaped widths; tokens/s, MFU (6N
           convention and strict: benchmarks.gpu_parts.common.mfu_fields) against the chip's bf16 data-sheet peak
           (offload_report.PEAK_BF16), the compiled device peak; and the first step's loss of flash against exact on
           the same weights and batch (the speed layout's rounding, nats).
  headroom the device memory each offload layout of offload.py's model leaves free during its step: the largest
           ballast array (bisection) the warmed step still runs beside; saved = that less no offload's (`_headroom`).
  agree    one short training per case from the same GPT-2 init on copy-task batches: exact bf16, exact fp32, flash
           bf16; flash's largest loss gap against exact, set against exact's bf16-vs-fp32 gap (`child_agree`).
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
  from benchmarks.gpu_parts.common import mfu_fields
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
    rec.update(compile_s=t.compile_s, memory_analysis=dict(t.memory_analysis),
               **offload._compiled_bytes(t.memory_analysis))
    rng = np.random.default_rng(0)
    batch = rng.integers(0, model.vocab_size, shape).astype(np.uint16)
    times, losses = [], []
    for i in range(args.warmup + args.steps):
      s0 = time.perf_counter()
      losses.append(t.step(batch)["loss"])
      if i >= args.warmup:
        times.append(time.perf_counter() - s0)
    stats = jax.devices()[0].memory_stats() or {}  # the runtime's hold: arrays in use + the program's region
    rec["memory_stats_after_steps"] = {k: int(v) for k, v in stats.items() if isinstance(v, int)}
    med = sorted(times)[len(times) // 2]
    rec.update(step_s=times, median_s=med, tokens_per_s=rec["tokens_per_step"] / med, first_loss=losses[0],
               n_params=int(sum(x.size for x in jax.tree.leaves(t.state.params))),
               peak_flops=offload.report.peak_bf16(jax.devices()[0].device_kind))
    # mfu (6N) and mfu_strict (matmul params; flash skips the masked blocks, exact computes every score)
    rec.update(mfu_fields(model, seq, rec["tokens_per_s"], rec["peak_flops"], causal_skip=kernel == "flash"))
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
      print(json.dumps({k: rec.get(k) for k in ("model", "kernel", "tokens_per_s", "mfu", "mfu_strict",
                                                "device_peak_bytes",
                                                "first_loss", "error")}), flush=True)
      rows.append(rec)
      offload.save_partial(args, head())
  return head()


# ----------------------------------------------------------------------------- agree child

AGREE_STEPS = 24


def copy_batches(n: int, ga: int, micro: int, seq: int, vocab: int, seed: int = 0):
  """n batches (ga, micro, seq + 1) of uint16 tokens where each row repeats one random 64-token chunk: the loss can
  only fall below ln(vocab) by attending back to the chunk's previous copy, so the attention kernel carries it."""
  import numpy as np
  rng = np.random.default_rng(seed)
  chunk = 64
  reps = -(-(seq + 1) // chunk)
  out = []
  for _ in range(n):
    base = rng.integers(0, vocab, (ga, micro, chunk))
    out.append(np.tile(base, (1, 1, reps))[..., :seq + 1].astype(np.uint16))
  return out


def _agree_run(model, precision: str, kernel: str, batches, micro: int, seq: int) -> dict:
  from jax_impl import kernels
  from jax_impl.step import Trainer
  from parity.spec import JaxPlan, RunSpec, TrainSpec
  from parity.weights import init_params
  train = TrainSpec(steps=len(batches), micro_batch_size=micro, grad_accum_steps=batches[0].shape[0], seq_len=seq,
                    precision=precision, lr=1e-3, warmup_steps=2, eval_every=0)
  run = RunSpec(model=model, train=train, jax=JaxPlan(scan_layers=True, offload_opt_state=False),
                sides=("jax",)).validate()
  rec = {"precision": precision, "kernel": kernel}
  try:
    kernels.set_attention_kernel(kernel)
    t = Trainer.build(run, init_params(model, seed=0))
    t.compile(batches[0].shape, None)
    rec["losses"] = [float(t.step(b)["loss"]) for b in batches]
    del t
  except Exception as e:
    rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
  finally:
    kernels.set_attention_kernel("exact")
  return rec


def child_agree(args) -> dict:
  """Losses of the same training (GPT-2 init, copy-task batches) with each attention kernel in bf16, and with the
  exact kernel in fp32: |flash - exact| in bf16 set against |bf16 - fp32| of the exact kernel, the rounding a bf16
  run already carries. Tiny: exact kernel only (CPU)."""
  import jax
  model = model_spec("tiny" if args.tiny else "d1024")
  micro, seq = (2, 32) if args.tiny else (2, 1024)
  pool = copy_batches(2, 1, micro, seq, model.vocab_size)  # two batches in turn: the loss falls within a few steps
  batches = [pool[i % 2] for i in range(args.agree_steps)]
  cases = [("bf16", "exact"), ("fp32", "exact")] + ([] if args.tiny else [("bf16", "flash")])
  rows = []
  for precision, kernel in cases:
    rows.append(_agree_run(model, precision, kernel, batches, micro, seq))
    print(json.dumps({k: rows[-1].get(k) for k in ("precision", "kernel", "error")}), flush=True)
    offload.save_partial(args, {"rows": rows})
  return {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "model": "tiny" if args.tiny
          else "d1024", "micro": micro, "seq": seq, "steps": args.agree_steps, "rows": rows}


# ----------------------------------------------------------------------------- headroom child

# (name, plan fields, stream options): offload.py's timing model and shape, no offload first (the reference)
HEADROOM_VARIANTS = (("no-offload", {"offload_opt_state": False}, {}), ("opt-deferred", {}, {"deferred": True}),
                     ("params+opt-stream", {"offload_params": True}, {}), ("opt-stream", {}, {}),
                     ("opt-ratio-0.5", {"offload_opt_ratio": 0.5}, {}),
                     ("opt-ratio-0.25", {"offload_opt_ratio": 0.25}, {}))
HEADROOM_DEFAULT = ("no-offload", "opt-deferred", "params+opt-stream", "opt-stream")
"""The layouts --headroom-variants names by default; no-offload, the reference, is measured first whatever is asked."""


def headroom_variants(text: str | None) -> list[tuple[str, dict, dict]]:
  """The HEADROOM_VARIANTS rows a --headroom-variants value names (None: HEADROOM_DEFAULT), no-offload first.
  Raises ValueError naming an unknown name and the known ones."""
  table = {v[0]: v for v in HEADROOM_VARIANTS}
  names = HEADROOM_DEFAULT if text is None else [x.strip() for x in text.split(",") if x.strip()]
  bad = [n for n in names if n not in table]
  if bad or not names:
    raise ValueError(f"unknown {', '.join(bad) or 'empty list'}; choose from {', '.join(table)}")
  return [table["no-offload"]] + [table[n] for n in names if n != "no-offload"]


def _headroom_trainer(fields: dict, options: dict, tiny: bool):
  import numpy as np
  from benchmarks.gpu_parts.common import fast_params
  from jax_impl.step import Trainer
  model = offload.model_spec(tiny)
  micro, seq, ga = (2, 32, 2) if tiny else (2, 1024, 2)
  offload._set_stream(options)
  t = Trainer.build(offload._run(model, fields, ga, micro, seq, "bf16"), fast_params(model))
  t.compile((ga, micro, seq + 1), None)
  batch = np.random.default_rng(0).integers(0, model.vocab_size, (ga, micro, seq + 1))
  return t, batch.astype(np.uint16)


def _runs_beside(t, batch, nbytes: int) -> tuple[bool, str]:
  """Whether one step runs while `nbytes` of device memory are held by another array (the ballast)."""
  import jax.numpy as jnp
  ballast = None
  try:
    ballast = jnp.zeros((max(1, nbytes // 4),), jnp.float32).block_until_ready()
    t.step(batch)
    return True, ""
  except Exception as e:  # RESOURCE_EXHAUSTED from the runtime: the step did not fit beside the ballast
    return False, f"{type(e).__name__}: {str(e)[:200]}"
  finally:
    del ballast


def _headroom(name: str, fields: dict, options: dict, args, deadline: float) -> dict:
  """The largest ballast (bisection, args.headroom_iters halvings) beside which the warmed step still runs: the
  device memory the step leaves free. A failed step may have consumed its donated state: the trainer is rebuilt."""
  import jax
  rec = {"variant": name, "plan": fields, "stream": options, "probes": []}
  try:
    t, batch = _headroom_trainer(fields, options, args.tiny)
    t.step(batch)
    stats = jax.devices()[0].memory_stats() or {}
    from jax_impl.offload import bytes_by_memory_kind
    rec.update(memory_analysis=t.memory_analysis, memory_stats_after_step=stats,
               state_bytes_by_kind=bytes_by_memory_kind(t.state, jax.devices()[0]))
    lo, hi = 0, int(stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)) or args.tiny_cap_bytes
    for _ in range(args.headroom_iters):
      if time.monotonic() > deadline:
        rec["stopped"] = "the child's budget ended"
        break
      mid = (lo + hi) // 2 >> 20 << 20
      ok, why = _runs_beside(t, batch, mid)
      rec["probes"].append({"ballast_bytes": mid, "ran": ok, "error": why or None})
      lo, hi = (mid, hi) if ok else (lo, mid)
      if not ok:
        del t
        t, batch = _headroom_trainer(fields, options, args.tiny)
    rec.update(headroom_bytes=lo, bracket_bytes=[lo, hi])
    del t
  except Exception as e:
    rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
  finally:
    offload._set_stream({})
  return rec


def child_headroom(args) -> dict:
  """Device memory each offload layout leaves free during its step (`_headroom`), against no offload: the memory
  it saves, measured by the runtime rather than read from the compiler's memory_analysis."""
  import jax
  import tempfile
  # the rebuilt trainers reuse the first compile; outside the results folder, which is tarred
  jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="parity-headroom-cache-"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  rows, deadline = [], time.monotonic() + args.budget_s
  for name, fields, options in headroom_variants(args.headroom_variants):
    rows.append(_headroom(name, fields, options, args, deadline))
    print(json.dumps({k: rows[-1].get(k) for k in ("variant", "headroom_bytes", "bracket_bytes", "error")}),
          flush=True)
    offload.save_partial(args, {"rows": rows})
  return {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "rows": rows}


CHILDREN = {"overlap": child_overlap, "mfu": child_mfu, "agree": child_agree, "headroom": child_headroom}


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
  common = ["--reps", str(args.reps), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--agree-steps", str(args.agree_steps), "--headroom-iters", str(args.headroom_iters)]
  if args.headroom_variants:
    common += ["--headroom-variants", args.headroom_variants]
  plan = [("overlap", "overlap", [], {}, 0.2), ("overlap-flags", "overlap", [], flags_env, 0.25),
          ("mfu", "mfu", [], {}, 0.8), ("headroom", "headroom", [], {}, 0.75), ("agree", "agree", [], {}, 1.0)]
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
  ap.add_argument("--only", help="driver: comma-separated children (overlap, mfu, headroom, agree)")
  ap.add_argument("--headroom-iters", type=int, default=7, help="headroom: bisection steps per layout")
  ap.add_argument("--headroom-variants", help="headroom: comma-separated layouts (default "
                  f"{','.join(HEADROOM_DEFAULT)}; also opt-ratio-0.5, opt-ratio-0.25); no-offload is always measured")
  ap.add_argument("--tiny-cap-bytes", type=int, default=64 << 20, help=argparse.SUPPRESS)
  ap.add_argument("--agree-steps", type=int, default=AGREE_STEPS, help="agree: training steps per kernel")
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
  try:
    headroom_variants(args.headroom_variants)
  except ValueError as exc:
    ap.error(f"--headroom-variants {args.headroom_variants!r}: {exc}")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  return run_child(args) if args.child else drive(args)


if __name__ == "__main__":
  sys.exit(main())
