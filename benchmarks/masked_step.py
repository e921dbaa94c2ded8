"""Benchmark: the model's forward + backward on `packed` batches against `stream` at the same shapes (target:
masking must keep >= 0.95x the tokens/s of stream), JAX and torch, each interleaved in one process.

Per framework and shape, two steps over the same token ids (B, T + 1) and the same weights:
  stream  JAX: jax.jit(jax.value_and_grad(jax_impl.model.loss_fn)) on the tokens alone (causal mask, positions
          0..T-1, mean loss); torch: lm_loss(GPT(x), y).backward() (SDPA is_causal).
  packed  the same with the packed layout's segment_ids, positions and `tokens` loss weights of
          parity.dataset.layouts.build_batches (examples of random lengths in [T/8, T/2+1], first-fit packed):
          JAX jnp.where(segment & causal mask) before the softmax, wpe[positions] / rotary angles by positions,
          sum(w * ce); torch the boolean (B, 1, T, T) SDPA attn_mask, the same positions and weights.
Each step is compiled (JAX) and warmed up (`--warmup` calls each), then run in `--rounds` rounds of `--per-round`
calls of each, the order alternating each round; every call is timed to completion (block_until_ready / the
backward's return). ratio = tokens/s of packed / tokens/s of stream = t_stream / t_packed over one round's calls;
reported as min / median / max over rounds. Both steps process B * T tokens; the packed one also skips padding
in nothing (padding is computed and weighted 0), so the ratio is the cost of the masking alone.

Writes benchmarks/results/masked_step.json and .md (date, machine, versions, threads, command, per-round ratios).

Usage: python benchmarks/masked_step.py [--shapes gpt2-tiny,gpt2-d256-t256,llama-d256-t256] [--rounds 15]
       [--frameworks jax,torch] [--threads 2]
"""
from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import platform
import re
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from parity.dataset.examples import Example  # noqa: E402
from parity.dataset.layouts import build_batches  # noqa: E402
from parity.dataset.reference import token_weights  # noqa: E402
from parity.environment import cpu_model, load_1min, package_versions  # noqa: E402
from parity.spec import ModelSpec  # noqa: E402
from parity.weights import init_params  # noqa: E402
from jax_impl import model as jm, layout  # noqa: E402
from torch_impl.model import build_model, lm_loss  # noqa: E402

LLAMA_KW = dict(norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False, norm_eps=1e-6)
SHAPES: dict[str, tuple[ModelSpec, int, int]] = {
    "gpt2-tiny": (ModelSpec(vocab_size=256, d_model=64, n_layers=2, n_heads=2, max_seq_len=64), 4, 32),
    "gpt2-d256-t256": (ModelSpec(vocab_size=256, d_model=256, n_layers=4, n_heads=4, max_seq_len=256), 8, 256),
    "llama-d256-t256": (ModelSpec(vocab_size=256, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=688,
                                  max_seq_len=256, **LLAMA_KW), 8, 256),
}
"""name -> (model, micro batch B, seq_len T)."""


def packed_arrays(spec: ModelSpec, b: int, t: int, seed: int = 0) -> dict[str, np.ndarray]:
  """One packed micro batch: tokens (B, T+1), segment_ids / positions (B, T) int32, weights (B, T) float32."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(max(2, t // 8), t // 2 + 2, size=8 * b)  # 2..8 examples a row
  examples = [Example(ids=rng.integers(0, spec.vocab_size, n).astype(np.uint32), loss=np.arange(n) >= n // 3,
                      record=i + 1) for i, n in enumerate(lengths)]
  bb = build_batches(examples, steps=1, grad_accum_steps=1, micro_batch_size=b, seq_len=t, seed=seed,
                     vocab_size=spec.vocab_size, layout="packed")
  return {"tokens": bb.tokens[0, 0].astype(np.int32), "segment_ids": bb.segment_ids[0, 0],
          "positions": bb.positions[0, 0], "weights": token_weights(bb.loss_mask, "tokens")[0, 0].astype(np.float32),
          "padding_fraction": float((bb.segment_ids == 0).mean()), "examples": int(bb.segment_ids[0, 0].max(1).sum())}


def jax_steps(spec: ModelSpec, arrays: dict) -> dict[str, Callable[[], None]]:
  import jax
  jax.config.update("jax_default_matmul_precision", "highest")
  params = jax.device_put(layout.to_flax(init_params(spec, seed=0), spec))
  tok, seg, pos, w = (jax.device_put(arrays[k]) for k in ("tokens", "segment_ids", "positions", "weights"))
  stream = jax.jit(jax.value_and_grad(lambda p, x: jm.loss_fn(p, x, spec)))
  packed = jax.jit(jax.value_and_grad(lambda p, x, s, q, ww: jm.loss_fn(p, x, spec, segment_ids_bt=s,
                                                                           positions_bt=q, weights_bt=ww)))
  stream_c, packed_c = stream.lower(params, tok).compile(), packed.lower(params, tok, seg, pos, w).compile()
  steps = {"stream": lambda: jax.block_until_ready(stream_c(params, tok)),
           "packed": lambda: jax.block_until_ready(packed_c(params, tok, seg, pos, w))}
  steps["hlo"] = {"stream": hlo_summary(stream_c), "packed": hlo_summary(packed_c)}
  return steps


HLO_OPS = ("dot", "fusion", "select", "gather", "scatter", "transpose", "copy", "sort", "while")


def hlo_summary(compiled: Any) -> dict[str, float]:
  """Counts of the ops that cost time in the optimised HLO, and XLA's cost analysis (flops, bytes accessed):
  the load-independent half of the comparison (the same dots and fusions = the same fast path)."""
  counts = collections.Counter(re.findall(r"= \S+ (" + "|".join(HLO_OPS) + r")\(", compiled.as_text()))
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, list) else cost) or {}
  return {**{k: counts.get(k, 0) for k in HLO_OPS}, "flops": float(cost.get("flops", 0.0)),
          "bytes_accessed": float(cost.get("bytes accessed", 0.0))}


def torch_steps(spec: ModelSpec, arrays: dict) -> dict[str, Callable[[], None]]:
  import torch
  model = build_model(spec, init_params(spec, seed=0))
  tok = torch.from_numpy(arrays["tokens"].astype(np.int64))
  seg, pos = (torch.from_numpy(arrays[k].astype(np.int64)) for k in ("segment_ids", "positions"))
  w = torch.from_numpy(arrays["weights"])
  x, y = tok[:, :-1], tok[:, 1:]

  def stream() -> None:
    model.zero_grad(set_to_none=True)
    lm_loss(model(x), y).backward()

  def packed() -> None:
    model.zero_grad(set_to_none=True)
    lm_loss(model(x, seg, pos), y, w).backward()

  return {"stream": stream, "packed": packed, "sdpa_kernels": {"stream": sdpa_kernels(stream),
                                                                 "packed": sdpa_kernels(packed)}}


def sdpa_kernels(step: Callable[[], None]) -> list[str]:
  """The aten attention kernels one call of `step` runs (torch.profiler): the flash kernel for both steps means
  the boolean attn_mask kept SDPA's fast path."""
  from torch.profiler import profile
  with profile() as prof:
    step()
  return sorted({e.name for e in prof.events() if "scaled_dot_product" in e.name})


def interleave(steps: dict[str, Any], rounds: int, per_round: int, warmup: int) -> dict[str, Any]:
  """Per round, per_round timed calls of each step (order alternating); ratio = t_stream / t_packed.
  per_round 0: as many calls as fill ~0.5 s (from the last warm-up call)."""
  for fn in (steps["stream"], steps["packed"]):
    for _ in range(warmup):
      t0 = time.perf_counter()
      fn()
  per_round = per_round or max(1, round(0.5 / (time.perf_counter() - t0)))
  times: dict[str, list[float]] = {"stream": [], "packed": []}
  ratios, cpu_ratios = [], []
  for r in range(rounds):
    order = ["stream", "packed"] if r % 2 == 0 else ["packed", "stream"]
    spent, cpu = {}, {}
    for name in order:
      t0, c0 = time.perf_counter(), time.process_time()
      for _ in range(per_round):
        steps[name]()
      spent[name], cpu[name] = (time.perf_counter() - t0) / per_round, time.process_time() - c0
      times[name].append(spent[name])
    ratios.append(spent["stream"] / spent["packed"])
    cpu_ratios.append(cpu["stream"] / cpu["packed"])
  return {"ratio_min": min(ratios), "ratio_median": statistics.median(ratios), "ratio_max": max(ratios),
          "ratio_of_fastest": min(times["stream"]) / min(times["packed"]), "ratios": ratios,
          "cpu_ratio_median": statistics.median(cpu_ratios), "cpu_ratios": cpu_ratios, "per_round": per_round,
          "stream_s_median": statistics.median(times["stream"]), "packed_s_median": statistics.median(times["packed"]),
          "stream_s_min": min(times["stream"]), "packed_s_min": min(times["packed"])}


def header_lines(out: dict, title: str) -> list[str]:
  """The head of a results .md from a pinned_record: title with the date, machine and load (at the end too when
  host.load_1min_end is recorded), versions, command; shared with train_step_layouts.py."""
  host = out["host"]
  end = f", at end {host['load_1min_end']}" if "load_1min_end" in host else ""
  return [f"# {title}, {out['date']}", "",
          f"Machine: {host['cpu']}, {host['cpus']} schedulable CPUs, threads {out['threads']}, "
          f"1-min load at start {host['load_1min']}{end} (the CPUs are shared with other work; the rounds "
          "interleave the two steps so that load hits both alike).", "",
          "Versions: " + ", ".join(f"{k} {v}" for k, v in out["versions"].items() if v), "",
          f"Command: `{out['command']}`", ""]


def _markdown(out: dict) -> str:
  lines = [*header_lines(out, "Masked (packed) step vs stream, forward + backward"),
           "ratio = tokens/s packed / tokens/s stream (= t_stream / t_packed per round; target >= 0.95); "
           "fastest = the ratio of the two fastest calls (the least disturbed by other load); cpu = the median over "
           "rounds of the ratio of this process's CPU time (time.process_time, all threads), less sensitive to "
           "other processes' load than wall time.", "",
           "| framework | shape | B x T | padding | examples | stream ms (median) | packed ms (median) "
           "| ratio min | median | max | fastest | cpu |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in out["results"]:
    lines.append(f"| {r['framework']} | {r['shape']} | {r['B']} x {r['T']} | {r['padding_fraction']:.3f} "
                 f"| {r['examples']} | {1e3 * r['stream_s_median']:.2f} | {1e3 * r['packed_s_median']:.2f} "
                 f"| {r['ratio_min']:.3f} | {r['ratio_median']:.3f} | {r['ratio_max']:.3f} "
                 f"| {r['ratio_of_fastest']:.3f} | {r['cpu_ratio_median']:.3f} |")
  for r in out["results"]:
    if "sdpa_kernels" in r:
      lines += ["", f"torch {r['shape']}: SDPA kernels stream {', '.join(r['sdpa_kernels']['stream'])}; packed "
                    f"{', '.join(r['sdpa_kernels']['packed'])}."]
  hlo = [r for r in out["results"] if "hlo" in r]
  if hlo:
    lines += ["", "JAX optimised HLO of the two steps (op counts; XLA cost analysis):", "",
              "| shape | step | " + " | ".join(HLO_OPS) + " | GFLOP | GB accessed |",
              "|---|---|" + "---|" * (len(HLO_OPS) + 2)]
    for r in hlo:
      for k, h in r["hlo"].items():
        lines.append(f"| {r['shape']} | {k} | " + " | ".join(str(h[o]) for o in HLO_OPS)
                     + f" | {h['flops'] / 1e9:.2f} | {h['bytes_accessed'] / 1e9:.3f} |")
  lines += ["", "Per-round ratios are in masked_step.json."]
  return "\n".join(lines) + "\n"


def pinned_record(script: str, argv: list[str] | None, threads: int) -> dict[str, Any]:
  """Pins this process to its first `threads` schedulable CPUs (before jax starts its pool) and returns the result
  record's head: date, threads, the command, host (CPU model, CPUs, 1-min load) and package versions.
  Raises SystemExit when fewer CPUs are schedulable."""
  cpus = sorted(os.sched_getaffinity(0))
  if threads > len(cpus):
    raise SystemExit(f"--threads {threads}: only {len(cpus)} CPUs are schedulable here")
  os.sched_setaffinity(0, cpus[:threads])
  return {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "threads": threads,
          "command": f"python benchmarks/{script} " + shlex.join(argv if argv is not None else sys.argv[1:]),
          "host": {"cpu": cpu_model() or platform.machine(), "cpus": len(cpus), "load_1min": load_1min()},
          "versions": package_versions(), "results": []}


def interleaved_parser(doc: str, name: str, rounds: int) -> argparse.ArgumentParser:
  """The options every interleaved layout benchmark takes: --shapes (of SHAPES), --frameworks, --rounds, --per-round,
  --warmup, --threads, --out (benchmarks/results/<name>)."""
  ap = argparse.ArgumentParser(description=doc.splitlines()[0])
  ap.add_argument("--shapes", default=",".join(SHAPES))
  ap.add_argument("--frameworks", default="jax,torch")
  ap.add_argument("--rounds", type=int, default=rounds)
  ap.add_argument("--per-round", type=int, default=0, help="calls of each step per round (0: ~0.5 s of them)")
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--threads", type=int, default=2, help="CPUs this process is pinned to (before jax starts)")
  ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / name))
  return ap


def run_shapes(a: argparse.Namespace, out: dict, measure: Callable[[str, str], tuple[dict, dict]]) -> None:
  """For each framework and shape of the parsed `a` (interleaved_parser): torch's thread count set before its first
  op, then `measure(framework, shape)` -> (the record's own fields, interleave's result), appended to out['results']
  as {framework, shape, **fields, **result}, and one ratio line printed. Shared by this script and
  train_step_layouts.py."""
  for fw in a.frameworks.split(","):
    if fw == "torch":
      import torch  # threads before the first torch op
      torch.set_num_threads(a.threads)
    for shape in a.shapes.split(","):
      fields, res = measure(fw, shape)
      out["results"].append({"framework": fw, "shape": shape, **fields, **res})
      print(f"{fw} {shape}: ratio min {res['ratio_min']:.3f} median {res['ratio_median']:.3f} "
            f"max {res['ratio_max']:.3f} fastest {res['ratio_of_fastest']:.3f} cpu {res['cpu_ratio_median']:.3f} "
            f"(stream {1e3 * res['stream_s_median']:.2f} ms, packed "
            f"{1e3 * res['packed_s_median']:.2f} ms)", flush=True)


def main(argv: list[str] | None = None) -> None:
  a = interleaved_parser(__doc__, "masked_step", 15).parse_args(argv)
  out = pinned_record("masked_step.py", argv, a.threads)
  builders = {"jax": jax_steps, "torch": torch_steps}

  def measure(fw: str, shape: str) -> tuple[dict, dict]:
    spec, b, t = SHAPES[shape]
    arrays = packed_arrays(spec, b, t)
    steps = builders[fw](spec, arrays)
    res = interleave(steps, a.rounds, a.per_round, a.warmup)
    res.update({k: steps[k] for k in ("hlo", "sdpa_kernels") if k in steps})
    return {"B": b, "T": t, "d_model": spec.d_model, "n_layers": spec.n_layers,
            "padding_fraction": arrays["padding_fraction"], "examples": arrays["examples"]}, res

  run_shapes(a, out, measure)
  Path(a.out + ".json").write_text(json.dumps(out, indent=1) + "\n")
  Path(a.out + ".md").write_text(_markdown(out))

if __name__ == "__main__":
  main()
