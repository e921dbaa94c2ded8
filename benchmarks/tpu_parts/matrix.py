"""The verdict grid on a TPU VM: `parity compare --sides jax,torch` for every model family x precision x offload
plan, the plant table with JAX on the chip, and a JAX folder made from a carried request for `parity join`.

Run by `benchmarks/tpu.sh matrix [--part fp32|bf16|plants|join|accel ...]` after its install. Compares run JOBS at
a time: each JAX side on the chip waits for the chip (harness.chip: one side at a time holds it) while the others run
their PyTorch side and host-CPU reruns, so the chip is busy most of the time and the grid fits one command. A cell that
cannot start before the budget ends is listed as not run, with that reason. Writes, under --out:
  matrix/cells.json    one record per compare: name, args, exit code, wall seconds, verdict, failing gating checks,
                       the deciding figures (backend shift, envelope), the device the JAX side ran on
  matrix/log.txt       one line per compare as it ends
  matrix/<name>/       the run folder's JSON and JSONL (arrays, plots and logs removed; the join folder whole)
  matrix.tgz           all of it, for the trip back
Also works on a CPU machine (the chip lock is then not taken), which is how it is tested before a device run.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

FAMILIES = ("gpt2", "llama3", "qwen3", "gemma3", "mistral")
PLANS = ("zero2-offload", "scan-offload", "act-offload")
PRECISIONS = ("fp32", "bf16")
JT = ("--sides", "jax,torch")

# Plants with JAX on the chip and PyTorch on the host CPU as the clean reference: the planted bugs of the CPU plant
# tests, one per kind. Each must FAIL, or be stopped at step 0 by the semantics card. (name, args)
PLANT_DATA = ("--preset", "sft-tiny", "--set", "train.seq_len=48", "--set", "train.eval_every=0",
              "--data", "@PLANT_JSONL")
PLANTS = (
  ("plant-lr", ("--preset", "gpt2-tiny", *JT, "--steps", "6", "--perturb", "jax:train.lr=0.002")),
  ("plant-adam-eps", ("--preset", "gpt2-tiny", *JT, "--steps", "6", "--perturb", "jax:train.eps=1e-6")),
  ("plant-decay-biases", ("--preset", "gpt2-tiny", *JT, "--steps", "6", "--perturb", "jax:decay_biases=true")),
  ("plant-norm-eps", ("--preset", "gpt2-tiny", *JT, "--steps", "4", "--perturb", "jax:model.norm_eps=1e-3")),
  ("plant-gelu", ("--preset", "gpt2-tiny", *JT, "--steps", "4", "--perturb", "jax:model.gelu_approximate=false")),
  ("plant-rope-scaling", ("--preset", "llama3-tiny", *JT, "--steps", "4",
                          "--perturb", 'jax:model.rope_scaling={"rope_type": "linear", "factor": 2.0}')),
  ("plant-placement", ("--preset", "gpt2-tiny", *JT, "--steps", "4", "--perturb", "jax:placement_device=true")),
  ("plant-sliding-window", ("--preset", "mistral-tiny", *JT, "--steps", "4",
                            "--perturb", "jax:model.sliding_window=4")),
  ("plant-softcap", ("--preset", "gemma3-tiny", *JT, "--steps", "4", "--perturb", "jax:model.attn_softcap=50.0")),
  ("plant-qk-norm-eps", ("--preset", "qwen3-tiny", *JT, "--steps", "4", "--perturb", "jax:model.norm_eps=1e-3")),
  ("plant-labels-shifted", (*PLANT_DATA, *JT, "--steps", "3", "--set", "train.layout=padded",
                            "--perturb", "jax:labels_shifted_twice=true", "--train-anyway-on-card-diff")),
  ("plant-loss-on-prompt", (*PLANT_DATA, *JT, "--steps", "3", "--set", "train.layout=padded",
                            "--perturb", "jax:loss_on_prompt=true")),
  ("plant-positions", (*PLANT_DATA, *JT, "--steps", "3", "--set", "train.layout=packed",
                       "--perturb", "jax:positions_not_restarted=true")),
  ("plant-mask-dropped", (*PLANT_DATA, *JT, "--steps", "3", "--set", "train.layout=packed",
                          "--perturb", "jax:attention_mask_dropped=true")),
)
ACCEL_PLANTS = (("update-1.001", "accelerator_update_scale=1.001"),
                ("update-1.0003", "accelerator_update_scale=1.0003"),
                ("update-1.0001", "accelerator_update_scale=1.0001"),
                ("norm-eps-1e-6", "accelerator_norm_eps=1e-6"),
                ("matmul-default", "accelerator_matmul_default=true"))
"""Accelerator-only plants (jax_impl.accelerator_plants): applied on the chip, not in the JAX side's host-CPU rerun,
so only the cross-backend rule can see them. Every model here has norm eps 1e-5: 1e-6 is the Llama-1/2 porting slip."""


def accel_cells(request: Path) -> list[tuple[str, tuple[str, ...]]]:
  """The accelerator-only plants: on the carried gpt2-tiny request (JAX only, joined with its torch folder later,
  each folder kept whole), a clean run and each plant; and on llama3-tiny and mistral-tiny with torch on the host CPU
  (16 steps), the 0.1% and 0.03% update plants and llama3's other two."""
  out = []
  if request.is_file():
    base = ("--request", str(request), "--sides", "jax")
    out += [("accel-gpt2-clean", base)] + [(f"accel-gpt2-{n}", (*base, "--perturb", f"jax:{kv}"))
                                             for n, kv in ACCEL_PLANTS]
  for fam, names in (("llama3", [n for n, _ in ACCEL_PLANTS if n != "update-1.0001"]),
                     ("mistral", ["update-1.001", "update-1.0003"])):
    out += [(f"accel-{fam}-{n}", ("--preset", f"{fam}-tiny", *JT, "--steps", "16", "--perturb", f"jax:{kv}"))
            for n, kv in ACCEL_PLANTS if n in names]
  out += [("accel-gpt2-clean-64", ("--preset", "gpt2-tiny", *JT, "--steps", "64"))]  # the shift's growth, longer
  return out


KEEP = (".json", ".jsonl", ".txt", ".md")  # what comes back of a run folder (the join folder comes back whole)


def plant_jsonl(folder: Path) -> Path:
  """The data of the CPU plant tests (parity.dataset.demo.short_prompt_jsonl)."""
  from parity.dataset.demo import short_prompt_jsonl
  return short_prompt_jsonl(folder / "plant-data.jsonl")


def grid(precision: str, steps: int) -> list[tuple[str, tuple[str, ...]]]:
  """The cells of one precision: every family under every plan."""
  out = []
  for fam in FAMILIES:
    for plan in PLANS:
      args = ("--preset", f"{fam}-tiny", *JT, "--plan", plan, "--steps", str(steps))
      if precision != "fp32":
        args += ("--set", f"train.precision={precision}")
      out.append((f"{fam}-{precision}-{plan}", args))
  return out


def join_cells(request: Path) -> list[tuple[str, tuple[str, ...]]]:
  return [("join-B-jax", ("--request", str(request), "--sides", "jax"))] if request.is_file() else []


def summarize(folder: Path) -> dict:
  """The figures a cell is judged by, from its report.json (None where the run left none)."""
  try:
    rep = json.loads((folder / "report.json").read_text())
  except (OSError, ValueError):
    return {"verdict": None}
  checks = rep.get("checks") or []
  verdict = rep.get("verdict") or {}
  failed = [c for c in checks if not c.get("passed", True)]
  gating_failed = [c.get("name") for c in failed if c.get("gating")]
  pick = {c.get("name"): [c.get("value"), c.get("tolerance")] for c in checks
          if any(k in str(c.get("name")) for k in ("backend", "envelope", "semantics", "placement"))}
  jax = (rep.get("sides") or {}).get("jax") or {}
  summ = jax.get("summary") or {}
  return {"verdict": "PASS" if verdict.get("passed") else "FAIL", "message": str(verdict.get("message"))[:400],
          "first_failure": verdict.get("first_failure"), "gating_failed": gating_failed,
          "reported_only_over": [c.get("name") for c in failed if not c.get("gating")], "checks": pick,
          "jax_device": summ.get("device") or summ.get("device_kind"), "jax_status": jax.get("status")}


def run_cell(name: str, args: tuple[str, ...], root: Path, deadline: float, limit: float, log) -> dict:
  left = deadline - time.time()
  if left < 30:
    rec = {"name": name, "args": list(args), "rc": None, "wall_s": 0.0,
           "not_run": "the command's time budget ended before this compare could start"}
    log(f"{name}: not run (out of time)")
    return rec
  out = root / name
  cmd = [sys.executable, "-m", "parity", "compare", "--out", str(out), "--no-progress", "--determinism-steps", "0",
         *args]
  t0 = time.time()
  with open(root / f"{name}.txt", "w") as console:
    try:
      rc = subprocess.run(cmd, stdout=console, stderr=subprocess.STDOUT, timeout=min(limit, left)).returncode
    except subprocess.TimeoutExpired:
      rc = 124
  rec = {"name": name, "args": list(args), "rc": rc, "wall_s": round(time.time() - t0, 1), **summarize(out)}
  log(f"{name}: rc {rc} {rec['wall_s']} s {rec.get('verdict')} gating_failed={rec.get('gating_failed')}")
  return rec


def prune(root: Path, whole: set[str]) -> None:
  for folder in root.iterdir():
    if not folder.is_dir() or folder.name in whole:
      continue
    for f in folder.rglob("*"):
      if f.is_file() and not f.name.endswith(KEEP):
        f.unlink()


def chip_open_probe(root: Path, log) -> dict:
  """Seconds to open the chip (`jax.devices()` in a fresh process), with the runtime's default host buffer and
  with a 256 MiB one (TPU_PREMAPPED_BUFFER_SIZE)."""
  code = ("import time; t = time.time(); import jax; d = jax.devices(); "
          "print(round(time.time() - t, 2), d[0].device_kind)")
  out = {}
  for label, extra in (("default", {}), ("premapped_256MiB", {"TPU_PREMAPPED_BUFFER_SIZE": str(256 << 20)})):
    t0 = time.time()
    try:
      p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90,
                         env={**os.environ, **extra})
      out[label] = {"wall_s": round(time.time() - t0, 2), "stdout": p.stdout.strip()[-200:],
                    "stderr": p.stderr.strip()[-400:], "rc": p.returncode}
    except subprocess.TimeoutExpired:
      out[label] = {"wall_s": 90.0, "rc": 124}
    log(f"chip open {label}: {out[label]}")
  (root / "chip_open.json").write_text(json.dumps(out, indent=1))
  return out


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--part", action="append", choices=("fp32", "bf16", "plants", "join", "accel", "probe"),
                  help="repeatable; default: fp32, join")
  ap.add_argument("--budget", type=float, default=float(os.environ.get("BUDGET_S", 480)),
                  help="seconds for the whole part (default BUDGET_S or 480)")
  ap.add_argument("--jobs", type=int, default=4, help="compares at once (default 4)")
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--limit", type=float, default=300, help="seconds one compare may take, chip wait included")
  ap.add_argument("--only", default="", help="comma-separated cell names (a CPU rehearsal)")
  ap.add_argument("--request", default="runs/join-A/request.json", help="the carried request for the join part")
  a = ap.parse_args()
  if a.jobs < 1:
    ap.error(f"--jobs {a.jobs}: at least 1")
  deadline = float(os.environ.get("TPU_SH_T0") or time.time()) + a.budget  # from benchmarks/tpu.sh's start
  root = Path(a.out) / "matrix"
  root.mkdir(parents=True, exist_ok=True)
  lock = threading.Lock()

  def log(line: str) -> None:
    with lock, open(root / "log.txt", "a") as f:
      f.write(f"{time.strftime('%H:%M:%S')} {line}\n")
    print(line, flush=True)

  # the persistent compilation cache: a rerun of a cell (its noise envelope, a plant of the same model) reuses the
  # compiled step instead of compiling again on the chip; the executables are the same, so are the numbers
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(os.environ.get("TMPDIR", "/tmp")) / "parity-jax-cache"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  parts = a.part or ["fp32", "join"]
  if "probe" in parts:
    probe = chip_open_probe(root, log)
    d, s = probe["default"].get("wall_s", 0), probe["premapped_256MiB"].get("wall_s", 99)
    if probe["premapped_256MiB"].get("rc") == 0 and d - s > 4:
      os.environ["TPU_PREMAPPED_BUFFER_SIZE"] = str(256 << 20)
      log(f"using TPU_PREMAPPED_BUFFER_SIZE={256 << 20} for the compares (opens the chip {d - s:.1f} s sooner)")
  cells: list[tuple[str, tuple[str, ...]]] = []
  for part in parts:
    if part in PRECISIONS:
      cells += grid(part, a.steps)
    elif part == "plants":
      data = str(plant_jsonl(root))
      cells += [(n, tuple(data if x == "@PLANT_JSONL" else x for x in args)) for n, args in PLANTS]
    elif part == "accel":
      cells += accel_cells(Path(a.request))
    elif part == "join":
      cells += join_cells(Path(a.request))
      if not Path(a.request).is_file():  # said, not skipped in silence: the part needs a request from elsewhere
        print(f"[matrix] --part join: no request at {a.request}: run `parity compare --sides torch --out runs/join-A` "
              "on the other machine, carry its folder here (or pass --request FILE); the join part is skipped",
              file=sys.stderr, flush=True)
  if a.only:
    keep = set(a.only.split(","))
    unknown = sorted(keep - {c[0] for c in cells})
    if unknown:
      ap.error(f"--only {','.join(unknown)}: no such cell in --part {' '.join(parts)} (names: "
               f"{', '.join(c[0] for c in cells[:4])}, ...)")
    cells = [c for c in cells if c[0] in keep]
  log(f"{len(cells)} compares, {a.jobs} at a time, budget {a.budget:.0f} s; TPU_PREMAPPED_BUFFER_SIZE="
      f"{os.environ.get('TPU_PREMAPPED_BUFFER_SIZE')}, "
      f"JAX_COMPILATION_CACHE_DIR={os.environ['JAX_COMPILATION_CACHE_DIR']}")
  records = []
  with cf.ThreadPoolExecutor(a.jobs) as pool:
    futs = [pool.submit(run_cell, n, args, root, deadline, a.limit, log) for n, args in cells]
    for f in futs:
      records.append(f.result())
  (root / "cells.json").write_text(json.dumps(records, indent=1))
  prune(root, {"join-B-jax"} | {n for n, _ in cells if n.startswith("accel-gpt2-")})
  with tarfile.open(Path(a.out) / "matrix.tgz", "w:gz") as tar:
    tar.add(root, arcname="matrix")
  shutil.copy(root / "log.txt", Path(a.out) / "log.txt")
  log(f"matrix.tgz {os.path.getsize(Path(a.out) / 'matrix.tgz') / 1e6:.1f} MB")
  return 0


if __name__ == "__main__":
  sys.exit(main())
