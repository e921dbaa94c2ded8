"""Benchmark: the torch side on a quiet and on a busy machine, with the old thread settings and with harness.env's.

Runs the torch side's real worker (`harness.runner.run_side`, what `parity compare --sides torch` starts) on one
prepared run folder, in four cases per round:
  idle/old     no background load, PARITY_THREADS=off (OpenMP's and torch's defaults: what parity ran before);
  idle/new     no background load, harness.env.thread_environ's choice (OMP_NUM_THREADS from the CPUs,
               OMP_WAIT_POLICY=PASSIVE);
  loaded/old, loaded/new   the same while `--burners` CPU-bound processes this script starts (default 2 x the
               usable CPUs; a pure-Python busy loop each) share the machine; they are killed at the end of the
               round's loaded cases, and on any exit.
A round runs idle then loaded; within each, the order of old/new alternates from round to round. tokens/s is each
side's summary.json figure (tokens per step / median step time after the first two steps). Ratios are taken per
round (the two runs of a ratio are minutes apart at most), then min / median / max over rounds. Targets:
new loaded / new idle >= 0.5; new idle / old idle >= 0.95 (idle speed not lost).
harness.env sets PASSIVE only when other jobs share the CPUs (choose_threads); the OMP_WAIT_POLICY each run got is
in the table.

The load beside each figure is measured, not assumed: the mean number of runnable tasks over the run
(`procs_running` of /proc/stat, sampled every 0.25 s; the side's own threads and the burners included) and the
1-minute load average at its end. On a shared machine 'idle' is whatever the other users leave: read the figures.

Then `--quiet-rounds` rounds of old against OMP_WAIT_POLICY=PASSIVE forced, with the worker's scheduler autogroup
at nice -20 (`Quiet`): nothing else preempts the side, the nearest a shared machine gets to an idle one for a
spinning thread (a sleeping one still waits for its core to be handed back: a pessimistic PASSIVE). It shows what
PASSIVE would cost where the machine is quiet, which is why harness.env leaves OpenMP's default there: on a quiet
machine the new settings are the old ones (the count OpenMP picks itself from the affinity mask, no wait policy),
so idle speed is kept by construction. Each quiet round also runs both beside one other job of as many busy loops as
CPUs, its autogroup at nice -20 too ('quiet+burners'): the side's threads and the job's make a load of 2x the cores,
and nothing else weighs in. The first target is measured there against the quiet machine's own figure (PASSIVE,
what harness.env picks on a busy machine, against quiet/old, what it keeps on a quiet one); the fair share caps it
at 0.5 (the side gets one of two CPUs). These rounds take nearly all of the CPU from the machine's other sessions
while they run (~1 min each).

`--jax` adds the JAX side (default settings: XLA does not read the OpenMP variables) idle and loaded each round, to
see whether it needs settings of its own.

The thread variables of this script's own environment (OMP_*, MKL_*, GOMP_*, KMP_*, PARITY_THREADS*) are removed at
start (so 'old' is OpenMP's default), and listed in the results.

Writes benchmarks/results/torch_contention[-TAG].json and .md. Usage:
  python benchmarks/torch_contention.py [--preset gpt2-small-cpu] [--steps 10] [--rounds 3] [--quiet-rounds 2]
                                        [--jax] [--tag T]
"""
from __future__ import annotations

import argparse
import atexit
import datetime as dt
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from harness.env import THREADS_SWITCH  # noqa: E402
from harness.runner import run_side  # noqa: E402
from parity.environment import cpu_model, cpu_quota, package_versions, usable_cpus  # noqa: E402
from parity.pipeline.folder import prepare_run_dir  # noqa: E402
from parity.pipeline.resolve import resolve  # noqa: E402

_THREAD_PREFIXES = ("OMP_", "MKL_", "GOMP_", "KMP_", "PARITY_THREADS")
SETTINGS = {"old": {THREADS_SWITCH: "off"}, "new": {}, "passive": {THREADS_SWITCH: "off", "OMP_WAIT_POLICY": "PASSIVE"}}
"""The worker's extra environment per setting: 'off' leaves OpenMP's defaults; {} lets harness.env choose;
'passive' forces OMP_WAIT_POLICY=PASSIVE whatever the load (the quiet rounds: what the choice avoids when quiet)."""


def _strip_thread_env() -> dict[str, str]:
  """Removes this process's thread variables (returned), so that 'old' means OpenMP's own defaults."""
  gone = {k: v for k, v in os.environ.items() if k.startswith(_THREAD_PREFIXES)}
  for k in gone:
    del os.environ[k]
  return gone


class Sampler:
  """Mean runnable tasks (procs_running, /proc/stat) while it runs, sampled every `period_s` seconds."""

  def __init__(self, period_s: float = 0.25):
    self.period_s, self.samples, self._stop = period_s, [], threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self) -> None:
    while not self._stop.wait(self.period_s):
      for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("procs_running"):
          self.samples.append(int(line.split()[1]) - 1)  # less this sampler, running while it reads

  def __enter__(self) -> "Sampler":
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()

  def mean(self) -> float | None:
    return round(statistics.mean(self.samples), 2) if self.samples else None


class Burners:
  """`n` busy-loop processes owned by this script; `stop()` kills exactly those (also at exit). Each is a session
  (so, under Linux autogroups, a scheduling group) of its own: a load of n other jobs, as the load average counts."""

  def __init__(self, n: int):
    self.procs: list[subprocess.Popen] = []
    self.n = n
    atexit.register(self.stop)

  def start(self) -> None:
    self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
                  for _ in range(self.n)]  # each a session of its own, like the worker and any other user's job
    time.sleep(2.0)  # let them reach the run queue before the side starts

  def start_one_job(self, n: int, nice: int) -> None:
    """`n` busy loops as one job: a session (one autogroup, put at `nice`) of one process and its n - 1 forks,
    ended together by killing the session's process group."""
    code = f"import os\nfor _ in range({n - 1}):\n  if os.fork() == 0: break\nwhile True: pass"
    lead = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    Path(f"/proc/{lead.pid}/autogroup").write_text(str(nice))  # before the forks run long: they share the group
    self.procs, self.group = [lead], lead.pid
    time.sleep(2.0)

  def stop(self) -> None:
    if getattr(self, "group", None):
      try:
        os.killpg(self.group, signal.SIGKILL)  # the job's own process group: its forks, nothing else
      except ProcessLookupError:
        pass
      self.group = None
    for p in self.procs:
      p.kill()
    for p in self.procs:
      p.wait()
    self.procs = []


class Quiet:
  """Puts the worker's scheduler autogroup at nice -20 while it runs (Linux with autogroups; root or CAP_SYS_NICE).

  Each worker is a session of its own (harness.lifetime.spawn), so under autogroups the CPU is shared between
  sessions first: with its group at nice -20 the worker outweighs every other session ~87:1, an idle machine as near
  as a shared one gets. A thread watches this process's children (/proc/self/task/*/children) for one that is not
  in `skip` (the burners) and writes its /proc/PID/autogroup right after the spawn; `ok` says whether the kernel
  took it (False: nothing changed, the rounds stop)."""

  def __init__(self, skip: set[int] = frozenset()):
    self.skip, self.ok, self._stop = set(skip), False, threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  @staticmethod
  def _children() -> set[int]:
    kids = set()
    for task in Path("/proc/self/task").iterdir():
      try:
        kids |= {int(x) for x in (task / "children").read_text().split()}
      except OSError:
        continue
    return kids

  def _run(self) -> None:
    while not self._stop.wait(0.01):
      for pid in self._children() - self.skip:
        try:
          group = Path(f"/proc/{pid}/autogroup")
          group.write_text("-20")
          self.ok = "nice -20" in group.read_text()
          return
        except OSError:
          continue

  def __enter__(self) -> "Quiet":
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()


def run_case(rd: Path, side: str, setting: str, timeout_s: float) -> dict:
  """One side run in `setting`: tokens/s, the thread record of its summary, and the load it ran under."""
  with Sampler() as s:
    res = run_side(rd, side, timeout_s=timeout_s, env=SETTINGS[setting])
  summ = res.summary or {}
  if res.status != "ok":
    raise SystemExit(f"{side} ({setting}) ended '{res.status}': {res.error}")
  threads = summ.get("threads") or {}
  return {"tokens_per_s": summ.get("tokens_per_s"), "wall_s": round(res.wall_s, 1), "runnable_mean": s.mean(),
          "load_1min_end": round(os.getloadavg()[0], 2),
          "threads": {k: threads.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "torch_num_threads",
                                                  "torch_interop_threads")} if threads else None}


def run_rounds(rd: Path, args, burners: Burners) -> list[dict]:
  """`args.rounds` rounds of idle then loaded cases (module docstring); returns one dict per round."""
  rounds = []
  for r in range(args.rounds):
    order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
    rec: dict[str, dict] = {}
    for load in ("idle", "loaded"):
      if load == "loaded":
        burners.start()
      try:
        for setting in order:
          rec[f"{load}/{setting}"] = run_case(rd, "torch", setting, args.timeout_s)
          print(f"round {r} {load}/{setting}: {rec[f'{load}/{setting}']}", flush=True)
        if args.jax:
          rec[f"{load}/jax"] = run_case(rd, "jax", "new", args.timeout_s)
          print(f"round {r} {load}/jax: {rec[f'{load}/jax']}", flush=True)
      finally:
        burners.stop()
    rounds.append(rec)
  return rounds


def run_quiet(rd: Path, args, burners: Burners) -> list[dict]:
  """`args.quiet_rounds` rounds of old/passive (order alternating), the worker's autogroup at nice -20 (`Quiet`),
  alone ('quiet/...': what PASSIVE costs where nothing preempts the side) and beside the burners at nice -20 too
  ('quiet+burners/passive': the side and one job of as many busy loops as CPUs, 2x the cores; the old settings
  are left out there, they take minutes: the rounds above show them). Stops (keeping what it has)
  where the priority cannot be raised."""
  rounds = []
  for r in range(args.quiet_rounds):
    rec = {}
    for load in ("quiet", "quiet+burners"):
      if load == "quiet+burners":
        burners.start_one_job(usable_cpus(), nice=-20)
      try:
        order = ["old", "passive"] if r % 2 == 0 else ["passive", "old"]
        for setting in order if load == "quiet" else ["passive"]:  # old beside the job: minutes (rounds above)
          with Quiet(skip={b.pid for b in burners.procs}) as q:
            rec[f"{load}/{setting}"] = run_case(rd, "torch", setting, args.timeout_s)
          if not q.ok:
            print("quiet rounds skipped: the worker's autogroup could not be set to nice -20 (needs root/"
                  "CAP_SYS_NICE and a kernel with autogroups)", flush=True)
            return rounds
      finally:
        burners.stop()
    print(f"quiet round {r}: {rec}", flush=True)
    rounds.append(rec)
  return rounds


RATIOS = (("new loaded / new idle", "loaded/new", "idle/new", ">= 0.5"),
          ("new idle / old idle", "idle/new", "idle/old", ">= 0.95 (idle speed not lost)"),
          ("new loaded / old loaded", "loaded/new", "loaded/old", "(the gain under load)"),
          ("old loaded / old idle", "loaded/old", "idle/old", "(what the old settings kept)"),
          ("jax loaded / jax idle", "loaded/jax", "idle/jax", "(JAX: does it need settings?)"),
          ("quiet: PASSIVE forced / old", "quiet/passive", "quiet/old",
           "(why the choice leaves OpenMP's default on a quiet machine)"),
          ("quiet+burners PASSIVE / quiet old", "quiet+burners/passive", "quiet/old",
           ">= 0.5 (load 2x the cores vs quiet; the fair share is 0.5)"),
)


def summarise(rounds: list[dict]) -> list[dict]:
  """Per ratio: the per-round values and their min / median / max."""
  out = []
  for name, a, b, target in RATIOS:
    vals = [round(r[a]["tokens_per_s"] / r[b]["tokens_per_s"], 2) for r in rounds if a in r and b in r]
    if vals:  # rounded once, so the per-round values and min / median / max print alike
      out.append({"ratio": name, "target": target, "per_round": vals,
                  "min": min(vals), "median": statistics.median(vals), "max": max(vals)})
  return out


def write_results(result: dict, out: Path, tag: str = "") -> str:
  """benchmarks/results/torch_contention[-TAG].json and .md; returns the markdown."""
  out.mkdir(parents=True, exist_ok=True)
  stem = "torch_contention" + (f"-{tag}" if tag else "")
  (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
  m = result["machine"]
  md = [f"# The torch side on a quiet and a busy machine: old vs harness.env thread settings ({result['date']})", "",
        f"Command: `{result['command']}`", "",
        f"Machine: {m['cpu']}, {m['cpus_usable']} usable CPUs (cgroup quota: {m['cpu_quota']}), {m['platform']}; "
        f"{result['burners']} burners for 'loaded'. Versions: "
        + ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v), "",
        f"Preset `{result['preset']}`, {result['steps']} steps per run, {len(result['rounds'])} rounds (+ "
        f"{len(result['quiet_rounds'])} quiet), {result['benchmark_s']:.0f} s in all. Thread "
        f"variables removed from this script's environment at start: {result['stripped_env'] or 'none'}.", "",
        "| ratio | per round | min | median | max | target |", "|---|---|---|---|---|---|"]
  for s in result["ratios"]:
    md.append(f"| {s['ratio']} | {', '.join(f'{v:.2f}' for v in s['per_round'])} | {s['min']:.2f} | "
              f"{s['median']:.2f} | {s['max']:.2f} | {s['target']} |")
  md += ["", "Every run (tokens/s; load = mean runnable tasks during the run, the side's own threads and the burners "
         "included / 1-min load average at its end):", "",
         "| round | case | tokens/s | load (runnable mean / 1-min) | wall s | OMP_NUM_THREADS, OMP_WAIT_POLICY, "
         "torch threads, interop |", "|---|---|---|---|---|---|"]
  for i, r in [*enumerate(result["rounds"]), *enumerate(result["quiet_rounds"])]:
    for case, v in r.items():
      t = v["threads"] or {}
      md.append(f"| {i} | {case} | {v['tokens_per_s']:,.0f} | {v['runnable_mean']} / {v['load_1min_end']} | "
                f"{v['wall_s']} | {t.get('OMP_NUM_THREADS')}, {t.get('OMP_WAIT_POLICY')}, "
                f"{t.get('torch_num_threads')}, {t.get('torch_interop_threads')} |")
  md += ["", result["notes"]] if result.get("notes") else []
  text = "\n".join(md) + "\n"
  (out / f"{stem}.md").write_text(text)
  return text


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="gpt2-small-cpu")
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--burners", type=int, default=None, help="background busy loops when loaded (default 2 x CPUs)")
  ap.add_argument("--jax", action="store_true", help="also run the JAX side idle and loaded each round")
  ap.add_argument("--quiet-rounds", type=int, default=2,
                  help="rounds of old vs PASSIVE forced, the worker at autogroup nice -20 (an emulated quiet machine)")
  ap.add_argument("--timeout-s", type=float, default=900.0)
  ap.add_argument("--notes", default="")
  ap.add_argument("--tag", default="", help="results in torch_contention-TAG.json/.md")
  ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
  args = ap.parse_args()
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still runs the finally/atexit that stops burners
  stripped = _strip_thread_env()
  burners = Burners(args.burners if args.burners is not None else 2 * usable_cpus())
  rd = Path(tempfile.mkdtemp(prefix="parity-contention-"))
  sides = ("torch", "jax") if args.jax else ("torch",)
  prepare_run_dir(resolve(args.preset, steps=args.steps, sides=sides), rd)
  t0 = time.time()
  rounds = run_rounds(rd, args, burners)
  quiet = run_quiet(rd, args, burners)
  result = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(["python", "benchmarks/torch_contention.py", *sys.argv[1:]]),
            "machine": {"cpu": cpu_model() or platform.machine(), "cpus_usable": usable_cpus(),
                        "cpu_quota": cpu_quota(), "platform": platform.platform(), "gpu": None},
            "versions": {k: v for k, v in package_versions().items() if k in ("torch", "deepspeed", "jax", "numpy")},
            "preset": args.preset, "steps": args.steps, "burners": burners.n, "stripped_env": stripped,
            "benchmark_s": round(time.time() - t0, 1), "rounds": rounds, "quiet_rounds": quiet,
            "ratios": summarise(rounds) + summarise(quiet),
            "notes": args.notes}
  print(write_results(result, Path(args.results), args.tag))
  return 0


if __name__ == "__main__":
  sys.exit(main())
