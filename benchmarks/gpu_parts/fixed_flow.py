"""The fixed flow of benchmarks/gpu.py (the default on a GPU; docs/benchmarks.md). Imports neither jax nor torch.

Per side (JAX, then DeepSpeed, then FSDP2: those --sides names; all at once in --tiny): raw (jax_raw / torch_raw,
the latter once for both torch sides), train (one fixed GPT size that needs offload by the memory model: the fixed
run with offload and the offload-cost pair; the FSDP2 side runs parity's ZeRO-3 pairs' FSDP2 plans,
sizing.TRAIN_PLANS), largest (one training process per probed depth: doubling from the memory model's prediction,
then bisection). A part this machine cannot run (torch without a CUDA device outside --tiny, DeepSpeed and FSDP2
where sockets are refused: device.not_run_reasons) is recorded as not run with its reason instead of being started.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.gpu_parts import sizing
from benchmarks.gpu_parts.common import (classify_failure, mfu_fields, peak_flops, sizing_modules, tail,
                                         write_spec)
from benchmarks.gpu_parts.suite import Suite, not_run, run_part, say
from harness import lifetime
from harness.launch import worker_env

ROOT = Path(__file__).resolve().parents[2]
SIDES = {"jax": "jax_train", "deepspeed": "ds_train", "fsdp": "fsdp_train"}
"""Side -> the part module of its train and largest runs, in the order the sides run on a GPU."""
FAMILY = {"jax": None, "deepspeed": "deepspeed", "fsdp": "fsdp"}
"""Side -> the not-run family that stops its train and largest parts (device.not_run_reasons); its raw part:
RAW_FAMILY."""
RAW_FAMILY = {"jax": None, "deepspeed": "torch", "fsdp": "torch"}


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

RAW = {"jax": "jax_raw", "deepspeed": "torch_raw", "fsdp": "torch_raw"}


def sides_of(suite: Suite) -> list[str]:
  """The sides this run measures (--sides; every side where the driver gave none), in SIDES order."""
  chosen = getattr(suite.args, "sides", None) or list(SIDES)
  return [s for s in SIDES if s in chosen]


def raw_owner(suite: Suite, side: str) -> bool:
  """Whether `side` runs its raw part: the first of the chosen sides with that part (DeepSpeed's torch_raw serves the
  FSDP2 side too)."""
  return next(s for s in sides_of(suite) if RAW[s] == RAW[side]) == side


def part_raw(suite: Suite, side: str) -> None:
  """The side's framework: bandwidth and matmul (jax_raw; torch_raw for DeepSpeed and FSDP2)."""
  a = suite.args
  sizes = ["--mib", str(a.mib), "--n", str(a.matmul_n), "--reps", str(a.reps)]
  why = suite.not_run.get(RAW_FAMILY[side] or "")
  suite.records[RAW[side]] = (not_run(RAW[side], why) if why else
                              run_part(suite, RAW[side], RAW[side], sizes, a.part_timeout_s))


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
    dev = suite.device
    fx = sizing.fixed_size(dev["memory_total_bytes"], dev["host_available_bytes"], device_name=dev.get("name"),
                           kind=kind(suite))
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
    run = sizing.train_run(run, side, offload=cname != "cost_none")  # FSDP2: the ZeRO-3 pairs' FSDP2 plans
    spec = write_spec(run, suite.out / "parts" / f"{name}.spec.json")
    # DeepSpeed without offload: torch.optim.AdamW (torch_adam), as FusedAdam's CUDA op needs nvcc and minutes
    adam = ["--torch-adam"] if side == "deepspeed" and cname == "cost_none" else []
    env, pool = sizing.jax_pool(run, kind=kind(suite)) if side == "jax" else ({}, None)
    rec = run_part(suite, name, SIDES[side], ["--spec", str(spec), "--steps", str(a.steps), "--warmup",
                                             str(a.warmup), *init, *adam], a.train_timeout_s, env=env)
    if pool:
      rec["pool"] = pool
    rec["config"] = {"plan": sizing.TRAIN_PLANS[side][cname == "cost_none"],
                     "micro_batch": run.train.micro_batch_size, "seq_len": run.train.seq_len,
                     "n_layers": run.model.n_layers, "d_model": run.model.d_model, "precision": run.train.precision}
    if rec["ok"]:
      rec["derived"] = derived(suite, side, run, rec["result"])
    suite.records[name] = rec


def derived(suite: Suite, side: str, run, res: dict) -> dict:
  """MFU against the device's bf16 peak, by the 6N convention and the strict count (common.mfu_fields: both
  sides' attention computes every score, dense), and the link bandwidth the side measured, for one train record."""
  peak = peak_flops(res.get("device"), "fp32" if run.train.precision == "fp32" else "bf16")
  counts = mfu_fields(run.model, run.train.seq_len, res["tokens_per_s"], peak)
  out = {**counts, "model_tflops_per_s": res["tokens_per_s"] * counts["flops_per_token"] / 1e12,
         "peak_tflops": peak / 1e12 if peak else None, "link": link_gbs(suite, side)}
  if side != "jax":  # the JAX part reads its moves from the compiled step; the torch sides' come from the planner
    memory, _ = sizing_modules()
    from parity.sizing import cost
    rows = memory.estimate(run, sides=(side,))
    out["moved_bytes_per_step_model"] = cost.transfer_bytes(run, side, rows)
    out["model_peak_bytes"] = {"device": memory.peak_device_bytes(rows, side),
                               "host": memory.peak_host_bytes(rows, side)}  # the memory model's, beside the measured
  return out


MOVED_SOURCE = {"jax": "compiled step's S(5) entry buffers",
                "deepspeed": "planner transfer model (grads down, params up: 2 x e x N)",
                "fsdp": "planner transfer model (fp32 param shards up for forward and backward, grad shards down: "
                        "4 x N x (2 x GAS + 1))"}
"""Where each side's bytes moved per step come from (parity.sizing.cost.transfer_bytes for the torch sides)."""


def offload_summary(suite: Suite) -> dict:
  """Per side: offload cost (tokens/s kept) and overlap (bytes moved, their time at the measured bandwidth, the
  step time offload adds)."""
  out = {}
  for side in sides_of(suite):
    off = suite.records.get(f"{side}_cost_offload", {})
    if "same_as" in off:
      off = suite.records.get(off["same_as"], {})
    none = suite.records.get(f"{side}_cost_none", {})
    if off.get("not_run") or none.get("not_run"):
      out[side] = {"not_run": off.get("not_run") or none.get("not_run")}
      continue
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
                 "moved_source": MOVED_SOURCE[side],
                 "transfer_s_at_measured_bw": transfer_s, "link": link,
                 "hidden_fraction": (1 - extra / transfer_s) if transfer_s else None}
  return out


# ----------------------------------------------------------------------------- largest

def part_largest(suite: Suite, side: str) -> None:
  """Doubling then bisection over n_layers at the fixed width, one probe process each, within the side's budget."""
  a = suite.args
  base = sizing.tiny_run() if suite.tiny else sizing.fixed_run()
  dev = suite.device.get("memory_total_bytes")
  host = suite.device["host_available_bytes"]
  if side == "deepspeed":
    wait_op_build(suite)
  if suite.tiny:
    start, why = base.model.n_layers, "tiny: the preset's depth"
  else:
    start = max(1, sizing.predicted_largest(base, side, dev, host, kind=kind(suite)))
    why = f"the memory model's largest n_layers ({sizing.PROBE_PLANS[side]}, micro batch 1)"

  def probe(n: int) -> dict:
    run = sizing.probe_run(base, side, n)
    if not suite.tiny:
      ok, text = sizing.predicted_fits(run, side, None, host, kind(suite))  # the host is the hard limit
      if not ok:
        return {"status": "host-limit", "detail": f"not started: {text}"}
    spec = write_spec(run, suite.out / "parts" / f"largest_{side}_{n}.spec.json")
    env, pool = sizing.jax_pool(run, kind=kind(suite)) if side == "jax" else ({}, None)  # a GPU's pool, sized
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


def kind(suite: Suite) -> str:
  """'tpu' on a TPU (no GPU pinned pool: sizing.jax_pool, sizing.predicted_fits), else 'gpu'."""
  return "tpu" if suite.tpu else "gpu"


def run_side(suite: Suite, side: str, configs: dict, deadline: float) -> None:
  """One side's chain (raw, train, largest: those asked for) against its own deadline; a crash of the driver's
  code for one side is recorded, not raised, so the other side and the files still come. A side this machine cannot
  run (device.not_run_reasons) has its train and largest parts recorded as not run."""
  suite.local.deadline = deadline
  why = suite.not_run.get(FAMILY[side] or "")
  try:
    if "raw" in suite.args.parts and raw_owner(suite, side):
      part_raw(suite, side)
    if "train" in suite.args.parts and configs:
      if why:
        suite.records.update({f"{side}_{c}": not_run(f"{side}_{c}", why) for c in configs})
      else:
        part_train(suite, side, configs)
    if "largest" in suite.args.parts:
      if why:
        suite.records[f"largest_{side}"] = not_run(f"largest_{side}", why)
      else:
        part_largest(suite, side)
  except Exception as exc:  # the suite must still write what it has
    import traceback
    suite.records[f"driver_{side}"] = {"ok": False, "failure": "error", "detail": f"{type(exc).__name__}: {exc}",
                                       "stderr_tail": tail(traceback.format_exc())}
    say(f"{side}: driver error {type(exc).__name__}: {exc}")


def run_sides(suite: Suite, configs: dict) -> None:
  """GPU: the chosen sides' chains one after the other (JAX, DeepSpeed, FSDP2), each with an equal share of the budget
  left (they must not share the device). --tiny: all at once on the CPU (the figures are checks, not measurements),
  the links read again once every raw part is in (the FSDP2 side reads DeepSpeed's torch_raw)."""
  sides = sides_of(suite)
  if suite.tiny:
    threads = [threading.Thread(target=run_side, args=(suite, side, configs, suite.deadline), daemon=True)
               for side in sides]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    relink(suite, sides)
    return
  for i, side in enumerate(sides):
    run_side(suite, side, configs, time.monotonic() + suite.left() / (len(sides) - i))


def relink(suite: Suite, sides: list[str]) -> None:
  """Each side's measured link in its train and largest records, read from the raw records as they are now."""
  for side in sides:
    recs = [r for name, r in suite.records.items() if name.startswith(f"{side}_") and "derived" in r]
    for r in recs:
      r["derived"]["link"] = link_gbs(suite, side)
    if "link" in suite.records.get(f"largest_{side}", {}):
      suite.records[f"largest_{side}"]["link"] = link_gbs(suite, side)
