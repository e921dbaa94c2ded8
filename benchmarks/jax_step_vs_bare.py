"""Benchmark: the JAX worker's jitted step against a bare `jax.jit` step, and offload on/off, in one process.

Three comparisons, each measured the same way:
  worker/bare        the step `jax_impl.worker` runs (`jax_impl.step.Trainer.build` + `compile`: DeepSpeed
                     clipping, masked AdamW, the schedule table, optimizer state in `pinned_host`, the micro-batch
                     scan, metrics) against a bare step of the same Flax model and weights (`jax_impl.model.loss_fn`
                     -> jax.value_and_grad -> optax.adamw -> apply_updates, jax.jit with the state donated,
                     everything in device memory): what the worker's step machinery costs (target >= 0.95);
  worker/stock_flax  the same against a bare step of the same architecture written with stock Flax layers
                     (`stock_flax_stepper`, random init): the worker's model against a plain Flax user's;
  offload            the worker step with the optimizer state in `pinned_host` (the default plan) against the same
                     step with it in device memory (jax.offload_opt_state=false; target >= 0.97).
Every step is compiled, warmed up (`--warmup` steps each), then run in `--rounds` rounds; a round runs
`--steps-per-round` steps of each (the order rotates by one each round), each step timed to block_until_ready on
its new state and metrics. ratio = tokens/s of the first / tokens/s of the other, per round; reported as
min / median / max over rounds. Same spec and batch (random token ids, fixed seed, placed once before timing);
the worker and bare steps start from the same weights (parity.weights.init_params).

Threads: `--threads N` pins this process to N CPUs (os.sched_setaffinity, what `taskset -c 0-(N-1)` does) before
jax is imported; XLA CPU sizes its Eigen thread pool from the schedulable CPUs. XLA_FLAGS is left as it is.

`--baseline-model FILE` adds a fourth pair: the worker step against the same step built with FILE as
jax_impl/model.py (another revision's), interleaved the same way: a before/after of a model change in one process.

`--hlo DIR` writes each compiled step's optimised HLO; the JSON holds, per step, a count of the ops that cost time (dots
and their operand layouts, transposes, copies, converts, fusions, while loops).

Writes benchmarks/results/jax_step_vs_bare[-<tag>].json and .md (machine, versions, threads,
command, per-round ratios).

Usage: python benchmarks/jax_step_vs_bare.py [--preset gpt2-small-cpu] [--rounds 15] [--threads 2] [--tag T]
"""
from __future__ import annotations

import argparse
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
from parity.environment import cpu_model  # noqa: E402
from parity import weights  # noqa: E402
from parity.presets import preset  # noqa: E402


def _pin_threads(n: int) -> list[int]:
  """Restricts this process to the first n schedulable CPUs (before jax starts its thread pools)."""
  cpus = sorted(os.sched_getaffinity(0))
  if n > len(cpus):
    raise SystemExit(f"--threads {n}: only {len(cpus)} CPUs are schedulable here ({cpus})")
  os.sched_setaffinity(0, cpus[:n])
  return cpus[:n]


def cpu_name() -> str:
  """The CPU model (parity.environment.cpu_model), else the machine type."""
  return cpu_model() or platform.machine()


# ----------------------------------------------------------------------------- the two kinds of step


class Stepper:
  """A compiled step with its live state: `run(batch)` performs one step and waits for it."""

  def __init__(self, name: str, fn: Callable, state: Any, batch: Any, compiled_text: str):
    self.name, self.fn, self.state, self.batch, self.compiled_text = name, fn, state, batch, compiled_text

  def run(self) -> None:
    import jax
    self.state, metrics = self.fn(self.state, self.batch)
    jax.block_until_ready((self.state, metrics))


def worker_stepper(run: Any, canonical: dict, batch_np: Any, name: str = "worker") -> Stepper:
  """The JAX worker's own step (`Trainer.build` + `Trainer.compile`, as jax_impl.worker calls them)."""
  import jax
  from jax_impl.step import Trainer  # the framework: jax is imported after the benchmark set its flags
  trainer = Trainer.build(run, canonical)
  trainer.compile(batch_np.shape, None, batch_np.dtype)
  batch = jax.device_put(batch_np, trainer.placement.batch_sharding())
  return Stepper(name, trainer.step_fn, trainer.state, batch, trainer.compiled_text)


def _bare_compile(name: str, loss: Callable, params: Any, run: Any, batch_np: Any) -> Stepper:
  """jax.value_and_grad(loss) -> optax.adamw -> apply_updates, jax.jit(donate_argnums=0), all in device memory."""
  import jax
  import optax
  t = run.train
  tx = optax.adamw(t.lr, b1=t.beta1, b2=t.beta2, eps=t.eps, weight_decay=t.weight_decay)

  def step(state: Any, tokens_amtp1: Any) -> Any:
    p, opt = state
    value, grads = jax.value_and_grad(loss)(p, tokens_amtp1[0])  # grad_accum_steps 1: the one micro batch
    updates, opt = tx.update(grads, opt, p)
    return (optax.apply_updates(p, updates), opt), {"loss": value}

  state = (params, tx.init(params))
  batch = jax.device_put(batch_np)
  compiled = jax.jit(step, donate_argnums=(0,)).lower(state, batch).compile()
  return Stepper(name, compiled, state, batch, compiled.as_text())


def worker_with_model_file(run: Any, canonical: dict, batch_np: Any, path: str) -> Stepper:
  """The worker step built with another revision's jax_impl/model.py (e.g. `git show REV:jax_impl/model.py > f`),
  loaded as its own module; the rest of jax_impl is this checkout's."""
  import importlib.util
  from jax_impl import step as step_lib  # the framework: jax is imported after the benchmark set its flags
  spec = importlib.util.spec_from_file_location("baseline_model", path)
  if spec is None or spec.loader is None:
    raise SystemExit(f"--baseline-model {path}: not a loadable Python file (name it *.py)")
  module = importlib.util.module_from_spec(spec)
  sys.modules["baseline_model"] = module
  spec.loader.exec_module(module)
  current, step_lib.model_lib = step_lib.model_lib, module
  try:  # the step traces its loss (model_lib.loss_fn) while it compiles
    return worker_stepper(run, canonical, batch_np, name="worker_baseline_model")
  finally:
    step_lib.model_lib = current


def bare_stepper(run: Any, canonical: dict, batch_np: Any) -> Stepper:
  """The worker's Flax model (`jax_impl.model.loss_fn`, same weights) in a bare step: no clip, no decay mask,
  constant lr, no offload, no micro-batch scan, loss as the only metric."""
  import jax
  from jax_impl import model as model_lib  # the framework: jax is imported after the benchmark set its flags
  from jax_impl import layout
  params = jax.device_put(layout.to_flax(canonical, run.model))
  return _bare_compile("bare", lambda p, tokens: model_lib.loss_fn(p, tokens, run.model), params, run, batch_np)


def stock_flax_stepper(run: Any, batch_np: Any) -> Stepper:
  """The same architecture written with stock Flax layers (nn.Embed, nn.LayerNorm, nn.Dense on (B, T, D),
  einsum attention, tanh GELU, tied head), random init, in the bare step: what a plain Flax user would run.
  GPT-2 options only (layernorm, gelu, learned positions, tied head, bias)."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import optax
  s = run.model
  if (s.norm, s.mlp, s.position, s.tie_embeddings, s.bias, s.kv_heads) != ("layernorm", "gelu", "learned", True,
                                                                           True, s.n_heads):
    raise SystemExit("the stock-Flax bare step covers GPT-2 models only (layernorm, gelu, learned positions, "
                     "tied head, bias, no grouped-query attention)")

  class StockGPT(nn.Module):
    @nn.compact
    def __call__(self, tok: Any) -> Any:
      b, t = tok.shape
      n, h = s.n_heads, s.head_dim
      wte = nn.Embed(s.vocab_size, s.d_model)
      x = wte(tok) + nn.Embed(s.max_seq_len, s.d_model)(jnp.arange(t))[None]
      mask = jnp.tril(jnp.ones((t, t), bool))
      for _ in range(s.n_layers):
        q, k, v = jnp.split(nn.Dense(3 * s.d_model)(nn.LayerNorm(s.norm_eps)(x)).reshape(b, t, 3 * n, h), 3, axis=2)
        att = jax.nn.softmax(jnp.where(mask, jnp.einsum("btnh,bsnh->bnts", q, k) * s.scale, -1e30), axis=-1)
        x = x + nn.Dense(s.d_model)(jnp.einsum("bnts,bsnh->btnh", att, v).reshape(b, t, n * h))
        y = nn.Dense(s.ffn_dim)(nn.LayerNorm(s.norm_eps)(x))
        x = x + nn.Dense(s.d_model)(jax.nn.gelu(y, approximate=s.gelu_approximate))
      return wte.attend(nn.LayerNorm(s.norm_eps)(x))

  model = StockGPT()
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 2), jnp.int32))["params"]

  def loss(p: Any, tokens_mtp1: Any) -> Any:
    tokens = tokens_mtp1.astype(jnp.int32)
    logits = model.apply({"params": p}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  return _bare_compile("stock_flax", loss, params, run, batch_np)


# ----------------------------------------------------------------------------- measuring


def interleave(first: Stepper, others: list[Stepper], rounds: int, per_round: int, warmup: int,
               tokens: int) -> dict[str, dict]:
  """Tokens/s ratio first/other per round for each other step (module docstring), from the same rounds.

  Each round runs `per_round` steps of every step, in an order rotated by one each round, so none always runs
  right after another. Returns {"<first>/<other>": summary} with ratio min/median/max and tokens/s medians.
  """
  steppers = [first, *others]
  for s in steppers:
    for _ in range(warmup):
      s.run()
  secs: dict[str, list[float]] = {s.name: [] for s in steppers}
  for r in range(rounds):
    k = r % len(steppers)
    for s in steppers[k:] + steppers[:k]:
      t0 = time.perf_counter()
      for _ in range(per_round):
        s.run()
      secs[s.name].append(time.perf_counter() - t0)
  out = {}
  for o in others:
    ratios = [b / a for a, b in zip(secs[first.name], secs[o.name])]
    out[f"{first.name}/{o.name}"] = {
        "pair": f"{first.name}/{o.name}", "rounds": rounds, "steps_per_round": per_round, "warmup_steps": warmup,
        "ratio_min": min(ratios), "ratio_median": statistics.median(ratios), "ratio_max": max(ratios),
        "ratios": ratios,
        "tokens_per_s_median": {s.name: statistics.median(tokens * per_round / t for t in secs[s.name])
                                for s in (first, o)}}
  return out


_OP = re.compile(r"=\s*(\S+)\s+([a-z][a-z0-9-]*)\(")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_YNN_CALL = re.compile(r'calls=%([^,\s]+).*"kind":"__ynn_fusion"')


def hlo_counts(text: str) -> dict[str, Any]:
  """Counts of the ops that cost time in an optimised XLA CPU HLO module.

  `dot_outside_ynn`: dots not inside a YNNPACK fusion (`__ynn_fusion`, XLA CPU's fast path), i.e. run as
  standalone thunks on the generic Eigen path; `dots_outside_ynn` lists their lines (shape, contracting dims,
  op name), the form the issue counted.
  """
  counts: dict[str, int] = {}
  ynn = set(_YNN_CALL.findall(text))
  comp, outside = "", []
  for line in text.splitlines():
    c = _COMPUTATION.match(line)
    if c:
      comp = c.group(1)
    m = _OP.search(line)
    if not m:
      continue
    op = m.group(2)
    if op in ("dot", "transpose", "copy", "convert", "fusion", "while", "custom-call", "reduce", "all-reduce"):
      counts[op] = counts.get(op, 0) + 1
    if op == "dot" and comp not in ynn:
      outside.append(re.sub(r", metadata=\{op_name=\"([^\"]*)\".*", r"  @ \1", line.strip())[:300])
  counts["dot_outside_ynn"] = len(outside)
  counts["ynn_fusion"] = len(ynn)
  return {"counts": counts, "dots_outside_ynn": outside}


def versions() -> dict[str, str]:
  import flax
  import jax
  import jaxlib
  import optax
  return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__, "optax": optax.__version__}


def _fmt(p: dict) -> str:
  return f"{p['ratio_median']:.3f} ({p['ratio_min']:.3f}-{p['ratio_max']:.3f})"


def write_results(out: dict, results: Path, stem: str) -> tuple[Path, Path]:
  results.mkdir(parents=True, exist_ok=True)
  jpath, mpath = results / f"{stem}.json", results / f"{stem}.md"
  jpath.write_text(json.dumps(out, indent=2) + "\n")
  lines = [f"# JAX worker step vs bare jax.jit step ({out['preset']}, {out['date']})", "",
           f"Command: `{out['command']}`", "",
           f"Machine: {out['cpu']}, {out['cpus_total']} CPUs; this process pinned to {out['threads']} "
           f"({out['thread_setting']}). Versions: " + ", ".join(f"{k} {v}" for k, v in out["versions"].items()), "",
           "| pair | rounds x steps | ratio median (min-max) | tokens/s medians | target |", "|---|---|---|---|---|"]
  for key, target in (("worker_vs_bare", ">= 0.95"), ("worker_vs_stock_flax", "(reference)"),
                      ("offload_on_vs_off", ">= 0.97"), ("worker_vs_baseline_model", "(before/after)")):
    if key not in out:
      continue
    p = out[key]
    tps = ", ".join(f"{k} {v:,.0f}" for k, v in p["tokens_per_s_median"].items())
    lines.append(f"| {p['pair']} | {p['rounds']} x {p['steps_per_round']} | {_fmt(p)} | {tps} | {target} |")
  lines += ["", "ratio = tokens/s of the first step / tokens/s of the second, per round (one round: "
            "`steps_per_round` steps of each, order rotating), after `warmup_steps` steps each.", ""]
  if out.get("hlo"):
    lines += ["Compiled HLO op counts:", "", "| step | " + " | ".join(_HLO_COLS) + " |",
              "|---|" + "---|" * len(_HLO_COLS)]
    for name, h in out["hlo"].items():
      lines.append(f"| {name} | " + " | ".join(str(h["counts"].get(c, 0)) for c in _HLO_COLS) + " |")
    lines.append("")
  if out.get("notes"):
    lines += [out["notes"], ""]
  mpath.write_text("\n".join(lines))
  return jpath, mpath


_HLO_COLS = ("dot", "dot_outside_ynn", "ynn_fusion", "transpose", "copy", "convert", "fusion", "while", "custom-call")


def _args() -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="gpt2-small-cpu")
  ap.add_argument("--rounds", type=int, default=15)
  ap.add_argument("--steps-per-round", type=int, default=2)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--threads", type=int, default=2, help="pin to this many CPUs (0: leave the affinity alone)")
  ap.add_argument("--hlo", default=None, help="folder for both steps' optimised HLO text")
  ap.add_argument("--no-offload-pair", action="store_true", help="skip the offload on/off pair")
  ap.add_argument("--baseline-model", default=None,
                  help="also time the worker step built with this model.py (another revision's) against the current")
  ap.add_argument("--tag", default="", help="suffix of the result files")
  ap.add_argument("--notes", default="", help="a line added to the Markdown")
  ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
  return ap.parse_args()


def _later_pairs(args: argparse.Namespace, run: Any, canonical: dict, batch_np: Any, worker: Stepper,
                 tokens: int) -> dict[str, Any]:
  """The offload on/off pair and, with --baseline-model, the worker step against another revision's model."""
  import dataclasses
  out: dict[str, Any] = {}
  if not args.no_offload_pair:
    no_off = dataclasses.replace(run, jax=dataclasses.replace(run.jax, offload_opt_state=False))
    on = worker if run.jax.offload_opt_state else worker_stepper(run, canonical, batch_np)
    on.name = "offload_on"
    off = worker_stepper(no_off, canonical, batch_np, name="offload_off")
    out["offload_on_vs_off"] = interleave(on, [off], args.rounds, args.steps_per_round, args.warmup,
                                          tokens)["offload_on/offload_off"]
    print("offload on/off", _fmt(out["offload_on_vs_off"]), flush=True)
  if args.baseline_model:
    base = worker_with_model_file(run, canonical, batch_np, args.baseline_model)
    worker.name = "worker"
    out["worker_vs_baseline_model"] = interleave(worker, [base], args.rounds, args.steps_per_round, args.warmup,
                                                 tokens)["worker/worker_baseline_model"]
    out["baseline_model"] = args.baseline_model
    print("worker/worker_baseline_model", _fmt(out["worker_vs_baseline_model"]), flush=True)
  return out


def main() -> int:
  args = _args()
  pinned = _pin_threads(args.threads) if args.threads else sorted(os.sched_getaffinity(0))
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  import numpy as np
  run = preset(args.preset)
  if run.train.precision != "fp32" or run.train.grad_accum_steps != 1:
    raise SystemExit(f"{args.preset}: the bare step is fp32 with one micro batch; this preset is "
                     f"{run.train.precision} with grad_accum_steps={run.train.grad_accum_steps}")
  canonical = weights.init_params(run.model, seed=0)
  t = run.train
  batch_np = np.random.default_rng(0).integers(0, run.model.vocab_size, (1, t.micro_batch_size, t.seq_len + 1),
                                               dtype=np.uint16)
  tokens = t.micro_batch_size * t.seq_len
  worker = worker_stepper(run, canonical, batch_np)
  bare = bare_stepper(run, canonical, batch_np)
  stock = stock_flax_stepper(run, batch_np)
  out: dict[str, Any] = {
      "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "preset": args.preset,
      "host": platform.node(), "cpu": cpu_name(), "cpus_total": os.cpu_count(), "threads": len(pinned),
      "thread_setting": f"os.sched_setaffinity to CPUs {pinned} (taskset equivalent); "
                        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
      "versions": versions(), "command": shlex.join([Path(sys.executable).name, *sys.argv]),
      "tokens_per_step": tokens, "notes": args.notes, "load_avg_before": os.getloadavg()}
  pairs = interleave(worker, [bare, stock], args.rounds, args.steps_per_round, args.warmup, tokens)
  out["worker_vs_bare"], out["worker_vs_stock_flax"] = pairs["worker/bare"], pairs["worker/stock_flax"]
  for p in pairs.values():
    print(p["pair"], _fmt(p), flush=True)
  out["hlo"] = {s.name: hlo_counts(s.compiled_text) for s in (worker, bare, stock)}
  if args.hlo:
    Path(args.hlo).mkdir(parents=True, exist_ok=True)
    for s in (worker, bare, stock):
      (Path(args.hlo) / f"{s.name}.hlo.txt").write_text(s.compiled_text)
  del bare, stock
  out.update(_later_pairs(args, run, canonical, batch_np, worker, tokens))
  out["load_avg_after"] = os.getloadavg()
  stem = "jax_step_vs_bare" + (f"-{args.tag}" if args.tag else "")
  for p in write_results(out, Path(args.results), stem):
    print("wrote", p)
  return 0


if __name__ == "__main__":
  sys.exit(main())
