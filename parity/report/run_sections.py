"""The sections of a finished run's report.json as typed records (parity.report.run_record builds a RunRecord of
them; the reader is the two modules together): a check, a side with its summary and series, the verdict, the run's
configuration and plans, the plan pair chosen, the DeepSpeed config port, the environment, the run folder, the data
and a side's determinism/resume rerun. Each keeps what report.json states (`json`: its section as stored)."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from parity.fields import from_dict
from parity.sides import all_sides
from parity.spec import RunSpec, SpecError

__all__ = ["CheckRecord", "SideRecord", "FailureRecord", "VerdictRecord", "RunConfig", "PlanChoice", "MigrationRecord",
           "EnvironmentRecord", "RunFolderRecord", "DataRecord", "RerunRecord", "NotRunRecord", "as_mapping"]


_DEFAULT_RUN = RunSpec()
"""A RunSpec at its defaults: the type of each plan section (RunConfig.plans)."""


def as_mapping(x: Any) -> Mapping:
  """x when it is a mapping, else {} (a section an edited report stores as another type)."""
  return x if isinstance(x, Mapping) else {}


def _text(x: Any) -> str | None:
  return None if x is None else str(x)


@dataclasses.dataclass(frozen=True)
class CheckRecord:
  """One stored check (parity.verdict.check.Check.to_json): its fields as stored (value and tolerance: a number,
  None for NaN, or text such as 'inf'); gating True unless stored false; `json` the stored mapping."""
  name: str
  metric: str
  sides: tuple[str, ...]
  value: Any
  tolerance: Any
  passed: Any
  first_failing_step: Any
  worst: Any
  detail: str | None
  reason: str | None
  gating: Any
  json: Mapping

  @classmethod
  def of(cls, c: Any) -> "CheckRecord":
    c = as_mapping(c)
    return cls(name=c.get("name"), metric=c.get("metric"), sides=tuple(c.get("sides") or ()), value=c.get("value"),
               tolerance=c.get("tolerance"), passed=c.get("passed"), first_failing_step=c.get("first_failing_step"),
               worst=c.get("worst"), detail=c.get("detail"), reason=c.get("reason"), gating=c.get("gating", True),
               json=c)


@dataclasses.dataclass(frozen=True)
class SideRecord:
  """One side of the run (report.json sides.<side>): status, error, returncode, wall_s, harness_peak_rss_bytes (the
  harness's wait4 figure), summary (the side's summary.json, {} when none), series (per-step lists: step, loss,
  grad_norm, lr, loss_scale, skipped, step_time_s, tokens, val_step, val_loss; {} when none), load ({start, end}
  os.getloadavg() triples, or None); `json` as stored."""
  name: str
  status: str
  error: str | None
  returncode: Any
  wall_s: Any
  harness_peak_rss_bytes: Any
  summary: Mapping
  series: Mapping
  load: Mapping | None
  json: Mapping

  @classmethod
  def of(cls, name: str, s: Any) -> "SideRecord":
    s = as_mapping(s)
    return cls(name=name, status=s.get("status"), error=s.get("error"), returncode=s.get("returncode"),
               wall_s=s.get("wall_s"), harness_peak_rss_bytes=s.get("harness_peak_rss_bytes"),
               summary=as_mapping(s.get("summary")), series=as_mapping(s.get("series")),
               load=s.get("load") if isinstance(s.get("load"), Mapping) else None, json=s)

  def values(self, key: str) -> list:
    """The per-step list `key` of its series ([] when not stored)."""
    return list(self.series.get(key) or [])

  @property
  def device(self) -> str:
    """The device its summary names ('' when none: a side that did not finish)."""
    return str(self.summary.get("device") or "")

  @property
  def peak_rss_bytes(self) -> Any:
    """Its peak host RSS: the side's own figure, else the harness's wait4 figure."""
    return self.summary.get("peak_host_rss_bytes") or self.harness_peak_rss_bytes


@dataclasses.dataclass(frozen=True)
class FailureRecord:
  """report.json verdict.first_failure: the first gating check that failed (its name: `check`), its metric, pair,
  step, value and tolerance."""
  check: str | None
  metric: str | None
  sides: tuple[str, ...]
  step: Any
  value: Any
  tolerance: Any

  @classmethod
  def of(cls, f: Any) -> "FailureRecord | None":
    if not isinstance(f, Mapping) or not f:
      return None
    return cls(check=f.get("check"), metric=f.get("metric"), sides=tuple(f.get("sides") or ()), step=f.get("step"),
               value=f.get("value"), tolerance=f.get("tolerance"))


@dataclasses.dataclass(frozen=True)
class VerdictRecord:
  """report.json 'verdict': passed, message, first_failure (a FailureRecord, None when nothing failed)."""
  passed: Any
  message: str
  first_failure: FailureRecord | None
  json: Mapping

  @classmethod
  def of(cls, v: Any) -> "VerdictRecord":
    v = as_mapping(v)
    return cls(passed=v.get("passed"), message=str(v.get("message") or ""),
               first_failure=FailureRecord.of(v.get("first_failure")), json=v)

  @property
  def interrupted(self) -> bool:
    """A Ctrl-C stopped the run before everything ran (its message says INTERRUPTED)."""
    return self.message.startswith("INTERRUPTED")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """report.json 'run': the resolved RunSpec as a dict (`json`), with what the pages read of it."""
  json: Mapping

  @property
  def train(self) -> Mapping:
    return as_mapping(self.json.get("train"))

  @property
  def model(self) -> Mapping:
    return as_mapping(self.json.get("model"))

  @property
  def precision(self) -> str | None:
    """train.precision; None when missing or not text (an edited report)."""
    p = self.train.get("precision")
    return p if isinstance(p, str) else None

  @property
  def steps(self) -> int | None:
    """train.steps; None when missing or not an integer (an edited report)."""
    n = self.train.get("steps")
    return n if isinstance(n, int) and not isinstance(n, bool) else None

  @property
  def lr_schedule(self) -> str | None:
    return self.train.get("lr_schedule")

  def section(self, name: str) -> Mapping | None:
    """A plan section of the run as stored ('jax', 'deepspeed', 'fsdp'), None when it holds none."""
    x = self.json.get(name)
    return x if isinstance(x, Mapping) else None

  @property
  def plans(self) -> dict[str, Any]:
    """RunSpec plan section ('jax', 'deepspeed', 'fsdp': a side record's `plan`, parity.sides) -> the plan it stores
    (JaxPlan, DeepSpeedPlan, FsdpPlan: the type RunSpec holds there), in the records' order; a section the report
    lacks, or that does not read as its plan (an edited report), is left out."""
    out = {}
    for section in dict.fromkeys(r.plan for r in all_sides() if r.plan):
      stored = self.section(section)
      try:
        out[section] = from_dict(type(getattr(_DEFAULT_RUN, section)), stored, path=section)
      except (SpecError, TypeError, ValueError, AttributeError):
        continue  # stored None (not a mapping), an unknown key or a section RunSpec does not have
    return out

  @property
  def spec(self) -> RunSpec | None:
    """The RunSpec it stores, None when it stores none or it does not read as one (an edited or a newer report)."""
    if not self.json:
      return None
    try:
      return from_dict(RunSpec, self.json)
    except (SpecError, TypeError, ValueError):
      return None


@dataclasses.dataclass(frozen=True)
class PlanChoice:
  """report.json 'plan': the named plan pair the run ran (name, chosen_by: 'default' | 'auto' | 'user', why, the
  overrides applied after it, fsdp: what the pair says of an fsdp side)."""
  name: str | None
  chosen_by: str | None
  why: str | None
  overrides: tuple
  fsdp: Any

  @classmethod
  def of(cls, p: Any) -> "PlanChoice | None":
    if not isinstance(p, Mapping):
      return None
    return cls(name=p.get("name"), chosen_by=p.get("chosen_by"), why=p.get("why"),
               overrides=tuple(p.get("overrides") or ()), fsdp=p.get("fsdp"))


@dataclasses.dataclass(frozen=True)
class MigrationRecord:
  """report.json 'migration': the DeepSpeed config the run was ported from (source), the port's status, its table
  (file), how many entries it has, the loss normalisation the config implies (text or None)."""
  source: str | None
  status: str | None
  file: str
  entries: Any
  loss_normalization: str | None

  @classmethod
  def of(cls, m: Any) -> "MigrationRecord | None":
    if not isinstance(m, Mapping) or not m:
      return None
    return cls(source=m.get("source"), status=m.get("status"), file=m.get("file") or "migration.md",
               entries=m.get("entries"), loss_normalization=m.get("loss_normalization"))


@dataclasses.dataclass(frozen=True)
class EnvironmentRecord:
  """report.json 'environment' (the harness's machine at report time: git {rev, dirty}, None outside a git checkout);
  `json` as stored."""
  python: str | None
  platform: str | None
  machine: str | None
  cpu_count: Any
  cpu_model: str | None
  load_avg: tuple
  hostname: str | None
  versions: Mapping
  git: Mapping | None
  json: Mapping

  @classmethod
  def of(cls, e: Any) -> "EnvironmentRecord":
    e = as_mapping(e)
    return cls(python=e.get("python"), platform=e.get("platform"), machine=e.get("machine"),
               cpu_count=e.get("cpu_count"), cpu_model=e.get("cpu_model"),
               load_avg=tuple(e.get("load_avg_1_5_15") or ()), hostname=e.get("hostname"),
               versions=as_mapping(e.get("versions")), git=e.get("git") if isinstance(e.get("git"), Mapping) else None,
               json=e)


@dataclasses.dataclass(frozen=True)
class RunFolderRecord:
  """report.json 'run_folder': run_id, the command, where --force moved an earlier run, whether a dead run's lock
  was taken over, and a joined folder's record (join: parity.pipeline.join, None otherwise)."""
  run_id: str | None
  command: str | None
  moved_aside_to: str | None
  stale_lock_taken_over: Any
  join: Mapping | None

  @classmethod
  def of(cls, f: Any) -> "RunFolderRecord":
    f = as_mapping(f)
    join = f.get("join")
    return cls(run_id=_text(f.get("run_id")), command=f.get("command"), moved_aside_to=f.get("moved_aside_to"),
               stale_lock_taken_over=f.get("stale_lock_taken_over"), join=join if isinstance(join, Mapping) else None)


@dataclasses.dataclass(frozen=True)
class DataRecord:
  """report.json 'data': what the run trained on (source, sha256, the token counts), the data card of a
  padded/packed run (card, parity.dataset.card) and its loss normalisation; `json` as stored."""
  sha256: str | None
  card: Mapping | None
  loss_normalization: str | None
  json: Mapping

  @classmethod
  def of(cls, d: Any) -> "DataRecord":
    d = as_mapping(d)
    card = d.get("card")
    return cls(sha256=d.get("sha256"), card=card if isinstance(card, Mapping) and card else None,
               loss_normalization=d.get("loss_normalization"), json=d)

  @property
  def loss_tokens_per_step(self) -> list | None:
    """The loss tokens of each optimizer step (the card's loss_tokens_per_step), None on a stream run."""
    per_step = (self.card or {}).get("loss_tokens_per_step")
    return list(per_step) if isinstance(per_step, list) and per_step else None


@dataclasses.dataclass(frozen=True)
class RerunRecord:
  """One side's determinism rerun (report.json determinism.<side>: deterministic, steps_checked, detail, status) or
  resume (resume.<side>: resumed_at_step, bit_identical, detail); the fields the other has are None."""
  deterministic: Any = None
  steps_checked: Any = None
  resumed_at_step: Any = None
  bit_identical: Any = None
  detail: str | None = None
  status: str | None = None

  @classmethod
  def of(cls, x: Any) -> "RerunRecord":
    x = as_mapping(x)
    return cls(**{f.name: x.get(f.name) for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class NotRunRecord:
  """report.json sides_not_run.<side>: why this machine could not start it, and whether the user named it."""
  reason: str | None
  named: Any
