"""The grid flow of benchmarks/gpu.py (the default on a TPU; `--flow grid` elsewhere). Imports neither jax nor torch.

In order, each part a process of its own (one at a time holds the chip), each within its share of the budget:
  raw      jax_raw: bandwidth (the donated in-jit round trip is the in-step rate), matmul; torch_raw where torch
           has a device
  compile  jax_largest, one process: the train grid's depth (the memory model's, checked by compiling every grid
           plan at the largest accumulation with the planner's reserve) and the largest n_layers each --largest-plans
           plan compiles within the device's memory (doubling, then bisection)
  train    jax_train --grad-accum, one process per --jax-plans plan at the grid's depth: tokens/s, step time, MFU,
           compiled device peak, bytes moved; then the offload figures (grid.summary)
  confirm  the largest depth of each plan run for 2 steps in a process of its own (by_compile.confirm_run: a timeout
           is HUNG, an allocation failure OOM_AT_RUN); not started when the memory model's host bytes exceed the host
Budget shares (`shares`, SHARES): the largest-model search gets min(--largest-budget-s, 55 %) of what is left when
the flow starts, 65 % of it for compiling and 35 % for confirming; the train grid 33 %; raw the rest (12 % or more).
A part may use time an earlier part left over, never the later parts' shares.
"""
from __future__ import annotations

from typing import Any

from benchmarks.gpu_parts import by_compile, grid, sizing
from benchmarks.gpu_parts.common import mfu_fields, peak_flops, write_spec
from benchmarks.gpu_parts.suite import Suite, chip, not_run, reserve_timeout, run_part, say

EXIT_MARGIN_S = 20.0
"""Seconds a searching part keeps between its own budget and its process's limit: the import and the chip's opening
(~4-15 s on a TPU VM) come before its clock starts, and the last JSON write after."""


SHARES = {"raw": 0.12, "train": 0.33, "largest": 0.55, "compile_of_largest": 0.65, "grid_check": 0.15}
"""Fractions of the budget left when the flow starts: raw (jax_raw: ~11 s to open a TPU chip, then its copies and
matmuls), the train grid, the largest-model search (at most --largest-budget-s; 65 % of it compiling, the rest
confirming), and, when the search is not asked for, the compile part's check of the grid's depth."""


def shares(suite: Suite) -> dict[str, float]:
  """Seconds of the budget left now that each later part keeps (module docstring, SHARES)."""
  a, total = suite.args, suite.left()
  parts = a.parts
  largest = min(a.largest_budget_s, SHARES["largest"] * total) if "largest" in parts else 0.0
  train = SHARES["train"] * total if "train" in parts else 0.0
  compile_ = SHARES["compile_of_largest"] * largest if largest else (
      SHARES["grid_check"] * total if "train" in parts else 0.0)
  return {"compile": compile_, "train": train, "confirm": largest - compile_ if largest else 0.0}


def base_run(suite: Suite):
  """The grid's model at micro batch 1: --model (default gpt2-1.5b's width and sequence); --tiny gpt2-tiny."""
  return sizing.tiny_run() if suite.tiny else sizing.fixed_run(suite.args.model)


def part_raw(suite: Suite, share: dict[str, float]) -> None:
  a = suite.args
  sizes = ["--mib", str(a.mib), "--n", str(a.matmul_n), "--reps", str(a.reps)]
  later = share["compile"] + share["train"] + share["confirm"]
  if "torch" in suite.not_run:
    suite.records["torch_raw"] = not_run("torch_raw", suite.not_run["torch"])
  else:
    suite.records["torch_raw"] = run_part(suite, "torch_raw", "torch_raw", sizes,
                                          reserve_timeout(suite, a.part_timeout_s, later))
  suite.records["jax_raw"] = run_part(suite, "jax_raw", "jax_raw", sizes, reserve_timeout(suite, a.part_timeout_s,
                                                                                            later))


def grid_start(suite: Suite, base) -> tuple[int, list[str]]:
  """The grid's depth by the memory model (tiny: the preset's)."""
  a = suite.args
  if suite.tiny:
    return base.model.n_layers, []
  dev = suite.device
  limit = min(dev["memory_total_bytes"], a.bytes_limit or dev["memory_total_bytes"])  # --bytes-limit: a smaller one
  hw = sizing.hardware(limit, dev["host_available_bytes"], dev.get("name"), dev.get("kind"))
  return sizing.grid_depth(base, tuple(a.jax_plans), a.micro_tokens, max(a.grad_accum), hw,
                           dev["host_available_bytes"])


def part_compile(suite: Suite, share: dict[str, float], base, start: int) -> dict[str, Any]:
  """The jax_largest process: the grid's depth checked by compiling, and the largest-model search."""
  a, dev = suite.args, suite.device
  spec = write_spec(base, suite.out / "parts" / "largest_base.spec.json")
  timeout = reserve_timeout(suite, share["compile"], share["train"] + share["confirm"])
  argv = ["--base", str(spec), "--plans", ",".join(a.largest_plans) if "largest" in a.parts else "",
          "--budget-s", f"{max(1.0, timeout - EXIT_MARGIN_S):.0f}", "--host-bytes", str(dev["host_available_bytes"]),
          "--kind", dev.get("kind") or "cpu", "--max-probes", str(a.max_probes),
          "--min-probe-s", "2" if suite.tiny else "8", "--fit-by", a.largest_fit_by,
          "--resolution", str(getattr(a, "largest_resolution", 0.125))]
  if a.bytes_limit:
    argv += ["--bytes-limit", str(a.bytes_limit)]
  if "train" in a.parts and not suite.tiny:
    argv += ["--grid-plans", ",".join(a.jax_plans), "--grid-ga", str(max(a.grad_accum)), "--grid-micro-tokens",
             str(a.micro_tokens), "--grid-start", str(start)]
  rec = run_part(suite, "jax_largest", "jax_largest", argv, timeout)
  suite.records["jax_largest"] = rec
  return rec.get("result") or rec.get("partial") or {}


def grid_depth_choice(found: dict[str, Any], start: int, why: list[str]) -> tuple[int, str]:
  """(depth, how) of the train grid: the compiled check's depth; where it found none, half the smallest depth it saw
  refused (its bisection's next point, unchecked); without a check, the memory model's."""
  g = found.get("grid") or {}
  if g.get("depth"):
    return g["depth"], f"compiled: every grid plan fits at {g['depth']} layers ({g.get('stopped')})"
  refused = [p["n_layers"] for p in g.get("probes", []) if p.get("status") == "oom"]
  if refused and min(refused) > 1:
    n = min(refused) // 2
    return n, (f"unchecked: half of {min(refused)} layers, the smallest the compiled check refused (it found no "
               f"depth that fits: {g.get('stopped')}); the memory model's was {start}")
  if g:
    return start, f"the memory model's ({start} layers): the compiled check found none ({g.get('stopped')})"
  if not why:
    return start, "the preset's (tiny CPU check: not checked by compiling)"
  return start, f"the memory model's ({start} layers): not checked by compiling"


def part_train(suite: Suite, share: dict[str, float], base, depth: int) -> None:
  """One jax_train --grad-accum process per plan at the grid's depth."""
  a = suite.args
  init = [] if suite.tiny else ["--fast-init"]
  gas = ",".join(str(g) for g in a.grad_accum)
  for i, plan in enumerate(a.jax_plans):
    run = sizing.grid_run(base, plan, a.micro_tokens, 1, depth)
    spec = write_spec(run, suite.out / "parts" / f"grid_{plan}.spec.json")
    left_plans = len(a.jax_plans) - i
    timeout = reserve_timeout(suite, a.train_timeout_s, share["confirm"])
    timeout = min(timeout, max(timeout / left_plans, a.min_part_s))
    rec = run_part(suite, f"grid_{plan}", "jax_train", ["--spec", str(spec), "--grad-accum", gas, "--steps",
                                                         str(a.steps), "--warmup", str(a.warmup), *init], timeout)
    rec["config"] = {"plan": plan, "micro_batch": run.train.micro_batch_size, "seq_len": run.train.seq_len,
                     "n_layers": depth, "d_model": run.model.d_model, "precision": run.train.precision}
    if rec.get("ok"):
      rec["derived"] = mfu_rows(suite, run, rec["result"])
    suite.records[f"grid_{plan}"] = rec


def mfu_rows(suite: Suite, run, res: dict[str, Any]) -> dict[str, Any]:
  """MFU per accumulation against the device's peak at the run's precision (PEAK_FLOPS), by the 6N convention
  ('mfu') and the strict count ('mfu_strict', common.mfu_fields: the exact kernel's attention, dense)."""
  name = res.get("device") if suite.device.get("kind") in ("gpu", "tpu") else None
  peak = peak_flops(name, "fp32" if run.train.precision == "fp32" else "bf16")
  counts = mfu_fields(run.model, run.train.seq_len, 0.0, peak)
  out = {"flops_per_token": counts["flops_per_token"], "strict_flops_per_token": counts["strict_flops_per_token"],
         "attention_counted": counts["attention_counted"], "peak_tflops": peak / 1e12 if peak else None,
         "mfu": {}, "mfu_strict": {}}
  for r in res.get("runs", []):
    if r.get("status") == "ok":
      got = mfu_fields(run.model, run.train.seq_len, r["tokens_per_s"], peak)
      out["mfu"][str(r["grad_accum"])] = got["mfu"]
      out["mfu_strict"][str(r["grad_accum"])] = got["mfu_strict"]
  return out


def part_confirm(suite: Suite, base, found: dict[str, Any]) -> None:
  """Runs each plan's largest compiled depth for 2 steps, one process each, with the time left shared out."""
  a, dev = suite.args, suite.device
  plans = [p for p in a.largest_plans if (found.get("largest") or {}).get(p, {}).get("largest_ok")]
  kind = dev.get("kind") or "cpu"
  for i, plan in enumerate(plans):
    n = found["largest"][plan]["largest_ok"]
    name = f"confirm_{plan}_{n}"
    run = sizing.with_plan(base, plan, micro_batch=1, n_layers=n)
    ok, why = sizing.predicted_fits(run, "jax", None, dev["host_available_bytes"], kind,
                                    sizing.FAST_BUILD_COPIES)
    timeout = min(a.probe_timeout_s, suite.left() / (len(plans) - i))
    if not ok:
      suite.records[name] = {"ok": None, "plan": plan, "n_layers": n, "status": "host-limit", "detail": why}
      continue
    if timeout < a.min_part_s:
      suite.records[name] = {"ok": False, "plan": plan, "n_layers": n, "failure": "skipped", "status": "skipped",
                             "detail": f"suite budget spent ({suite.left():.0f} s left)"}
      continue
    spec = write_spec(run, suite.out / "parts" / f"{name}.spec.json")
    path = suite.out / "parts" / f"{name}.json"
    say(f"{name}: start (timeout {timeout:.0f} s)")
    with chip(suite, "jax_train"):
      res = by_compile.confirm_run("benchmarks.gpu_parts.jax_train", ["--spec", str(spec), "--json", str(path),
                                   "--steps", "2", "--warmup", "0", "--fast-init"], path, timeout)
    rec = {"ok": res["status"] == "ok", "plan": plan, "n_layers": n, **res}
    if not rec["ok"]:
      rec.update(failure=res["status"])
    say(f"{name}: {res['status']} ({res['wall_s']:.0f} s)")
    suite.records[name] = rec


def run_grid_flow(suite: Suite) -> None:
  """The flow of the module docstring; the DeepSpeed parts are recorded as not run (this flow times JAX)."""
  a = suite.args
  share = shares(suite)
  suite.records["grid_plan"] = {"shares_s": share, "jax_plans": a.jax_plans, "grad_accum": a.grad_accum,
                                "micro_tokens": a.micro_tokens, "largest_plans": a.largest_plans}
  suite.records["deepspeed"] = not_run("deepspeed", suite.not_run.get("deepspeed") or (
      "not run: the grid flow times the JAX side (--flow fixed runs DeepSpeed's parts)"))
  if "raw" in a.parts:
    part_raw(suite, share)
  base = base_run(suite)
  start, why = grid_start(suite, base) if "train" in a.parts else (0, [])
  found = part_compile(suite, share, base, start) if {"train", "largest"} & set(a.parts) else {}
  if "train" in a.parts:
    depth, how = grid_depth_choice(found, start, why)
    suite.records["grid_plan"].update(depth=depth, depth_how=how, memory_model=why)
    say(f"train grid: {depth} layers ({how})")
    if depth:
      part_train(suite, share, base, depth)
    rate = grid.in_step_rate(suite.records.get("jax_raw"))
    results = {p: suite.records[f"grid_{p}"].get("result") for p in a.jax_plans if f"grid_{p}" in suite.records}
    suite.records["grid_summary"] = grid.summary(results, a.jax_plans, rate)
  if "largest" in a.parts:
    part_confirm(suite, base, found)
