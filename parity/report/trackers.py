"""Mirroring a run's per-step records to an experiment tracker (`--tracker KIND:TARGET`), off by default.

One small interface, `Tracker` (log_step(side, step, metrics), close()), and one implementation per tool, each
importing its package only when asked for: TensorBoard event files (tensorboardX, else tensorboard's own event
writer; never torch.utils.tensorboard: parity/ does not import torch), Weights & Biases, MLflow. None is a
dependency of parity: asking for one that is not installed is refused before the run starts, naming the package
to install. The records are read after the run from each side's steps.jsonl (the workers do not change), so the
two sides' curves sit side by side in the tool a team already uses:

  tensorboard:DIR    one event-file folder per side under DIR/<run folder name>/<side>; scalars per metric
  wandb:PROJECT      one W&B run per side, named <run>/<side>, grouped by the run folder's name
  mlflow:EXPERIMENT  one MLflow run per side in EXPERIMENT (the tracking URI from MLFLOW_TRACKING_URI)
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Callable, Protocol, Sequence

from parity.inputs import InputError
from parity.protocol.layout import read_steps

__all__ = ["Tracker", "TRACKERS", "parse_tracker", "check_trackers", "open_tracker", "mirror_run", "STEP_METRICS"]

STEP_METRICS = ("loss", "grad_norm", "lr", "loss_scale", "step_time_s", "val_loss")
"""The per-step fields of steps.jsonl mirrored (numbers only; a skipped fp16 step's inf grad norm is left out)."""


class Tracker(Protocol):
  """Where per-step records go. log_step may be called for any side in any order of steps; close flushes."""

  def log_step(self, side: str, step: int, metrics: dict[str, float]) -> None: ...

  def close(self) -> None: ...


def installed_module(*modules: str) -> str | None:
  """The first module of `modules` that can be imported (found without importing it), else None."""
  for m in modules:
    try:
      if importlib.util.find_spec(m) is not None:
        return m
    except (ImportError, ValueError):
      continue
  return None


TRACKERS: dict[str, tuple[tuple[str, ...], str]] = {
    "tensorboard": (("tensorboardX", "tensorboard"), "pip install tensorboardX"),
    "wandb": (("wandb",), "pip install wandb"),
    "mlflow": (("mlflow",), "pip install mlflow"),
}
"""kind -> (modules any of which provides it, the install command named when none is installed)."""


def parse_tracker(text: str) -> tuple[str, str]:
  """'tensorboard:runs/tb' -> ('tensorboard', 'runs/tb'). Raises InputError naming the form and the known kinds."""
  kind, sep, target = str(text).partition(":")
  kind = kind.strip().lower()
  if kind not in TRACKERS or not sep or not target.strip():
    raise InputError(f"--tracker {text!r}: expected KIND:TARGET with KIND one of {', '.join(TRACKERS)} "
                     "(tensorboard:DIR, wandb:PROJECT, mlflow:EXPERIMENT)")
  return kind, target.strip()


def check_trackers(specs: Sequence[str]) -> list[tuple[str, str]]:
  """Parses every --tracker and checks its package is installed, before anything runs.

  Returns [(kind, target)]. Raises InputError (exit 2) naming the tracker and the package to install."""
  out = []
  for text in specs:
    kind, target = parse_tracker(text)
    modules, install = TRACKERS[kind]
    if installed_module(*modules) is None:
      raise InputError(f"--tracker {text}: {kind} is not installed (none of {', '.join(modules)} can be imported); "
                       f"`{install}` into this environment, or drop --tracker (trackers are optional)")
    out.append((kind, target))
  return out


class _PerSide:
  """A tracker that keeps one writer per side, made on first use by `make(side)`; close() closes each."""

  def __init__(self, make: Callable[[str], object], log: Callable[[object, int, dict], None],
               finish: Callable[[object], None]):
    self._make, self._log, self._finish = make, log, finish
    self._writers: dict[str, object] = {}

  def log_step(self, side: str, step: int, metrics: dict[str, float]) -> None:
    if side not in self._writers:
      self._writers[side] = self._make(side)
    self._log(self._writers[side], step, metrics)

  def close(self) -> None:
    for w in self._writers.values():
      self._finish(w)
    self._writers.clear()


def _tensorboard(folder: Path) -> Tracker:
  """Event files under folder/<side>: tensorboardX's SummaryWriter, else tensorboard's EventFileWriter."""
  if installed_module("tensorboardX"):
    from tensorboardX import SummaryWriter

    def log_x(w, step, metrics):
      for k, v in metrics.items():
        w.add_scalar(k, v, step)
    return _PerSide(lambda side: SummaryWriter(str(folder / side)), log_x, lambda w: w.close())
  from tensorboard.compat.proto import event_pb2, summary_pb2
  from tensorboard.summary.writer.event_file_writer import EventFileWriter

  def log_tb(w, step, metrics):
    summ = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in metrics.items()])
    w.add_event(event_pb2.Event(step=step, summary=summ))
  return _PerSide(lambda side: EventFileWriter(str(folder / side)), log_tb, lambda w: w.close())


def _wandb(project: str, group: str) -> Tracker:
  import wandb

  def make(side):
    return wandb.init(project=project, group=group, name=f"{group}/{side}", reinit=True,
                      config={"parity_run": group, "side": side})
  return _PerSide(make, lambda run, step, m: run.log(m, step=step), lambda run: run.finish())


def _mlflow(experiment: str, group: str) -> Tracker:
  import mlflow
  client = mlflow.tracking.MlflowClient()
  exp = client.get_experiment_by_name(experiment)
  exp_id = exp.experiment_id if exp is not None else client.create_experiment(experiment)

  def log(run_id, step, m):
    for k, v in m.items():
      client.log_metric(run_id, k, v, step=step)
  return _PerSide(lambda side: client.create_run(exp_id, run_name=f"{group}/{side}").info.run_id, log,
                  lambda run_id: client.set_terminated(run_id))


def open_tracker(kind: str, target: str, run_name: str) -> Tracker:
  """A Tracker of `kind` ('tensorboard', 'wandb', 'mlflow') writing to `target` for the run named `run_name`.
  Raises InputError when the kind is unknown or its package is not installed."""
  check_trackers([f"{kind}:{target}"])
  if kind == "tensorboard":
    return _tensorboard(Path(target) / run_name)
  if kind == "wandb":
    return _wandb(target, run_name)
  return _mlflow(target, run_name)


def _metrics(record: dict) -> dict[str, float]:
  out = {}
  for k in STEP_METRICS:
    v = record.get(k)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
      out[k] = float(v)
  return out


def mirror_run(run_dir: str | Path, trackers: Sequence[Tracker], sides: Sequence[str] | None = None) -> int:
  """Sends every step record of each side's steps.jsonl in `run_dir` to every tracker, then closes them.

  Args:
    run_dir: a run folder. trackers: Tracker objects (open_tracker). sides: the sides to mirror (default: every
      side folder holding a steps.jsonl, in name order).
  Returns:
    The number of records sent (per tracker).
  """
  rd = Path(run_dir)
  names = list(sides) if sides is not None else sorted(p.parent.name for p in rd.glob("*/steps.jsonl"))
  n = 0
  try:
    for side in names:
      for rec in read_steps(rd / side / "steps.jsonl"):
        m = _metrics(rec)
        if m and isinstance(rec.get("step"), int):
          for t in trackers:
            t.log_step(side, rec["step"], m)
          n += 1
  finally:
    for t in trackers:
      t.close()
  return n
