"""Assembling report.json from a run folder."""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from parity.environment import cpu_model
from parity.verdict.check import Check
from parity.verdict.sides import Verdict
from parity.spec import RunSpec, config_hash, to_dict
from parity.verdict.tolerances import TOLERANCES

__all__ = ["Report", "build_report", "REPORT_SCHEMA", "RUN_ARTIFACTS", "SIDE_ARTIFACTS", "artifact_hashes",
           "file_digest"]

REPORT_SCHEMA = "parity.report/1"
RUN_ARTIFACTS = ("request.json", "init.safetensors", "batches.npy", "val_batches.npy")
SIDE_ARTIFACTS = ("steps.jsonl", "summary.json", "final.safetensors", "final_moments.safetensors")
"""The files a verdict rests on (the inputs both sides read, each side's outputs the checks read); report.json
records their sha256 and size at write time so that `parity report` can say which changed since the run."""
SERIES_KEYS = ("loss", "grad_norm", "lr", "loss_scale", "skipped", "step_time_s", "tokens")


@dataclasses.dataclass
class Report:
  """A finished comparison. `data` is exactly what report.json holds; `post` what ran after it was written
  (parity.report.after.PostRunResult: the --baseline gate, --tracker mirroring), None when nothing was asked."""
  data: dict[str, Any]
  run_dir: Path
  post: Any = dataclasses.field(default=None, repr=False, compare=False)

  @property
  def passed(self) -> bool:
    return bool(self.data["verdict"]["passed"])

  @property
  def message(self) -> str:
    return self.data["verdict"]["message"]

  @property
  def exit_code(self) -> int:
    """0 when parity holds and every report file was written; 1 when parity does not hold, or a report file could
    not be written (`write_errors`: a result nobody can cite), or the --baseline gate found a metric that moved;
    bad input exits 2 before a report exists."""
    gate_ok = self.post is None or self.post.passed
    return 0 if self.passed and not self.data.get("write_errors") and gate_ok else 1

  @property
  def checks(self) -> list[dict]:
    return self.data["checks"]

  def side(self, name: str) -> dict:
    return self.data["sides"][name]

  def __repr__(self) -> str:
    return f"Report({self.run_dir}, {self.message!r})"


def _versions() -> dict[str, str]:
  out = {}
  for pkg in ("parity", "numpy", "safetensors", "jax", "jaxlib", "flax", "optax", "torch", "deepspeed"):
    try:
      out[pkg] = metadata.version(pkg)
    except metadata.PackageNotFoundError:
      pass
  return out


def _git_state() -> dict[str, Any] | None:
  """{rev, dirty} of the git checkout holding this package (dirty: uncommitted changes to tracked files), or None
  when it is not a checkout or git is missing (an installed wheel)."""
  import subprocess
  root = Path(__file__).resolve().parents[2]
  if not (root / ".git").exists():
    return None
  try:
    rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    st = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                        capture_output=True, text=True, timeout=20)
  except (OSError, subprocess.TimeoutExpired):
    return None
  if rev.returncode != 0:
    return None
  return {"rev": rev.stdout.strip(), "dirty": bool(st.stdout.strip()) if st.returncode == 0 else None}


def _environment() -> dict[str, Any]:
  """The harness's environment (report.json 'environment'): Python, OS, CPU, load, versions, git state."""
  try:
    load = [round(x, 2) for x in os.getloadavg()]
  except OSError:
    load = None
  return {"python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
          "cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "load_avg_1_5_15": load,
          "hostname": platform.node(), "versions": _versions(), "git": _git_state()}


def _migration(run_dir: Path) -> dict[str, Any] | None:
  """{source, status, file} of the DeepSpeed config port (migration.json) the run was given, or None."""
  try:
    m = json.loads((Path(run_dir) / "migration.json").read_text())
  except (OSError, ValueError):
    return None
  return {"source": m.get("source"), "status": m.get("status"), "file": "migration.md",
          "entries": len(m.get("entries") or [])}


def _series(steps: list[dict]) -> dict[str, list]:
  s = {"step": [r["step"] for r in steps]}
  for k in SERIES_KEYS:
    s[k] = [_num(r.get(k)) for r in steps]
  s["val_step"] = [r["step"] for r in steps if "val_loss" in r]
  s["val_loss"] = [_num(r["val_loss"]) for r in steps if "val_loss" in r]
  return s


def _num(v):
  if isinstance(v, float) and not math.isfinite(v):
    return None if math.isnan(v) else str(v)
  return v


def build_report(*, spec: RunSpec, preset_name: str, run_dir: Path, data_info: dict, side_runs: dict,
                 side_steps: dict[str, list[dict]], checks: list[Check], params_table: list[dict],
                 verdict: Verdict, wall_s: float, prepare_s: float, plan: dict | None = None,
                 reruns: dict[str, Any] | None = None, reruns_s: float = 0.0, run_folder: dict | None = None,
                 interrupted: bool = False, side_loads: dict[str, dict] | None = None) -> Report:
  """Assembles report.json (schema in parity.report), the one place its data is made: nothing is patched afterwards.

  Args:
    spec, preset_name, run_dir, data_info: the run, its name, folder and corpus (parity.pipeline.folder.PreparedRun.data_info).
    side_runs: side -> harness.runner.SideRun; side_steps: side -> StepRecords.
    checks, params_table, verdict: parity.verdict.sides.compare_sides + reruns' checks, and their verdict.
    wall_s: seconds from the call to now; prepare_s: seconds writing the inputs.
    plan: the plan pair chosen (parity.pipeline.resolve.ResolvedRun.plan) or None.
    reruns: {'noise_envelope', 'determinism', 'resume'} sections (parity.pipeline.reruns.Reruns.sections); reruns_s: the
      seconds their workers were busy. timing.overhead_ratio = wall_s / (sum(sides_s) + reruns_s), computed here.
    run_folder: {run_id, moved_aside_to, stale_lock_taken_over} of the claimed folder.
    interrupted: a Ctrl-C stopped the run: the verdict fails and its message says so.
    side_loads: side -> {start, end}: os.getloadavg() (1/5/15-minute load) when the side started and ended
      (the sides run one after another on a shared machine: their timings are only as good as the load).
  Returns:
    The Report (JSON-ready data; not written: parity.report.write_all).
  """
  from parity.sizing import memory
  sides, sides_s = _sides(side_runs, side_steps, side_loads)
  busy_total = sum(sides_s.values()) + reruns_s
  reruns = reruns if reruns is not None else {"noise_envelope": None, "determinism": {}, "resume": {}}
  data = {
      "schema": REPORT_SCHEMA,
      "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
      "run_dir": str(run_dir),
      "preset": preset_name,
      "config_hash": config_hash(spec),
      "run": to_dict(spec),
      "data": data_info,
      "environment": _environment(),
      "migration": _migration(run_dir),
      "verdict": _verdict_json(verdict, interrupted),
      "tolerances": {p: {m: dataclasses.asdict(t) for m, t in tab.items()} for p, tab in TOLERANCES.items()
                     if p == spec.train.precision},
      "checks": [c.to_json() for c in checks],
      "params_table": [{k: _num(v) for k, v in row.items()} for row in params_table],
      "sides": sides,
      "timing": {"wall_s": wall_s, "prepare_s": prepare_s, "sides_s": sides_s, "self_runs_s": reruns_s,
                 "overhead_ratio": (wall_s / busy_total) if busy_total > 0 else None},
      "plan": plan,
      "noise_envelope": reruns.get("noise_envelope"),
      "determinism": reruns.get("determinism", {}),
      "resume": reruns.get("resume", {}),
      "memory": None,
      "run_folder": run_folder,
      "artifacts": artifact_hashes(run_dir, list(sides)),
  }
  data = json.loads(json.dumps(data, default=str))
  data["memory"] = {"predicted_vs_measured": memory.predicted_vs_measured(data),  # reads the sides' summaries
                    "note": "predicted by parity.sizing.memory (parity estimate); measured from the live "
                            "state arrays / engine tensors of each side"}
  return Report(data=data, run_dir=run_dir)


def _sides(side_runs: dict, side_steps: dict[str, list[dict]], side_loads: dict[str, dict] | None
           ) -> tuple[dict[str, dict], dict[str, float]]:
  """report.json's 'sides' (status, error, summary, per-step series, load) and each side's busy seconds: its own
  init + compile + train times, or the wall time the harness saw for a side that did not finish."""
  sides, sides_s = {}, {}
  for name, sr in side_runs.items():
    summ = sr.summary or {}
    sides[name] = {"status": sr.status, "error": sr.error, "returncode": sr.returncode, "wall_s": sr.wall_s,
                   "harness_peak_rss_bytes": sr.peak_rss_bytes, "summary": summ,
                   "series": _series(side_steps.get(name, [])), "load": (side_loads or {}).get(name)}
    busy = sum(float(summ.get(k) or 0.0) for k in ("init_s", "compile_s", "train_s"))
    sides_s[name] = busy if sr.status == "ok" else sr.wall_s
  return sides, sides_s


def _verdict_json(verdict: Verdict, interrupted: bool) -> dict:
  """The verdict as report.json holds it; an interrupted run never passes, and its message says it stopped early."""
  out = verdict.to_json()
  if interrupted:
    msg = out["message"]
    out["message"] = ("INTERRUPTED: stopped before every run and check finished; so far: "
                      + (msg.replace("PASS: ", "", 1) if msg.startswith("PASS") else msg))
    out["passed"] = False
  return out


def file_digest(path: Path) -> dict[str, Any]:
  """{'sha256': hex digest, 'bytes': size} of a file, read in 8 MiB blocks (~1 s per GB on one core).
  Raises OSError when it cannot be read."""
  import hashlib
  h, n = hashlib.sha256(), 0
  with open(path, "rb") as f:
    while block := f.read(8 * 2**20):
      h.update(block)
      n += len(block)
  return {"sha256": h.hexdigest(), "bytes": n}


def artifact_hashes(run_dir: Path, sides: list[str]) -> dict[str, dict]:
  """relative path -> file_digest for each RUN_ARTIFACTS file of `run_dir` and SIDE_ARTIFACTS file of each side
  folder that exists (a side that failed early has no final.safetensors: it is simply not listed); a file that
  cannot be read is listed as {'error': strerror}."""
  out: dict[str, dict] = {}
  rels = [*RUN_ARTIFACTS, *(f"{side}/{name}" for side in sides for name in SIDE_ARTIFACTS)]
  for rel in rels:
    p = Path(run_dir) / rel
    if p.is_file():
      try:
        out[rel] = file_digest(p)
      except OSError as exc:
        out[rel] = {"error": exc.strerror or str(exc)}
  return out
