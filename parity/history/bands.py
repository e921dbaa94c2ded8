"""What two runs share, and so how the gate may hold one against the other: the machine, the package versions and
the thread settings (the notes: `machine_notes`, `version_notes`, `thread_notes`), each side's per-step band
(`side_bands`: bit for bit where the baseline proves its side reproduces, else the cross-framework tolerance) and the
precision whose tolerance applies when the two differ (`looser_precision`)."""
from __future__ import annotations

from parity.history.gates import GATES, Band
from parity.history.snapshot import Snapshot
from parity.inputs import InputError
from parity.report.runconfig import THREAD_KEYS
from parity.sides import find_side
from parity.verdict.tolerances import TOLERANCES

__all__ = ["looser_precision", "machine_notes", "version_notes", "thread_notes", "side_bands", "thread_difference",
           "pair_bitwise", "records_threads", "flag_changes", "flag_notes"]


def looser_precision(a: str, b: str) -> str:
  """Of two precisions, the one whose loss tolerance is wider (both are named in the notes when they differ)."""
  known = [p for p in (a, b) if p in TOLERANCES]
  if not known:
    raise InputError(f"no tolerance table for precision {a!r}; known: {sorted(TOLERANCES)}")
  return max(known, key=lambda p: TOLERANCES[p]["loss"].atol)


def machine_notes(new: dict[str, str], base: dict[str, str]) -> tuple[list[str], bool]:
  """Notes on where each run was written; True when the baseline's machine differs in a field both recorded."""
  common = [k for k in ("host", "cpu_model", "cpu_count", "gpu", "backend", "machine") if k in new and k in base]
  moved = [f"{k} {base[k]!r} -> {new[k]!r}" for k in common if new[k] != base[k]]
  if moved:
    return [f"the baseline was written on another machine ({'; '.join(moved)}): absolute-time gates "
            f"({', '.join(k for k, g in GATES.items() if g.absolute_time)}) are skipped, not failed"], True
  if not {"host", "cpu_model"} & set(common):
    return [f"machine: neither run recorded its host or CPU model together (compared: {', '.join(common) or 'none'})"
            "; taken as the same machine, so time gates apply"], False
  return [f"same machine ({', '.join(f'{k} {new[k]}' for k in common)})"], False


def version_notes(new: dict[str, str], base: dict[str, str]) -> list[str]:
  """Versions of the packages both runs recorded (a card keeps fewer than a run folder's environment.json: a
  package one side did not record is not a difference)."""
  both = sorted(set(new) & set(base))
  changed = [f"{k} {base[k]} -> {new[k]}" for k in both if new[k] != base[k]]
  if changed:
    return [f"versions differ (not a gate; they explain what moved, and the per-step gates use the cross-framework "
            f"band, not bit for bit): {', '.join(changed)}"]
  if not both:  # nothing to compare is not "the same": a card or an older run may have recorded no versions
    side = "the baseline" if not base else "the new run" if not new else "the two runs"
    return [f"package versions not compared: {side} recorded none in common"]
  return [f"same package versions ({', '.join(both)})"]


def side_bands(new: Snapshot, base: Snapshot, config_same: bool) -> dict[str, Band]:
  """The band of each baseline side's per-step gates: 'bitwise' when the baseline proves the side reproduces bit for
  bit here (its determinism rerun was bit-identical; the machine is positively the same: host or CPU model recorded
  by both and no identity field differs; every package version both recorded is equal; the configuration is
  equal; the side's thread settings are known and equal, `thread_difference`), else 'tolerance', its reason naming
  the first condition that fails."""
  why = _not_reproducible(new, base, config_same)
  out = {}
  for side in base.sides:
    steps = base.determinism.get(side)
    threads = thread_difference(side, new, base)
    if why or threads:
      out[side] = Band("tolerance", f"cross-framework band: {why or threads}")
    elif not steps:
      out[side] = Band("tolerance", f"cross-framework band: the baseline did not prove {side} bit-identical (its "
                                    "determinism rerun did not run or differed; --determinism-steps)")
    else:
      out[side] = Band("bitwise", f"bit for bit: the baseline's own rerun of {side} in a new process was "
                                  f"bit-identical over steps 0-{steps - 1}, on this machine, with these package "
                                  "versions and this configuration")
  return out


def _not_reproducible(new: Snapshot, base: Snapshot, config_same: bool) -> str:
  """Why the runs are not the same computation on the same stack ('' when they are)."""
  if not config_same:
    return "the configuration differs"
  common = [k for k in ("host", "cpu_model", "cpu_count", "gpu", "backend", "machine")
            if k in new.machine and k in base.machine]
  if not {"host", "cpu_model"} & set(common):
    return "the runs do not both record their host or CPU model"
  if any(new.machine[k] != base.machine[k] for k in common):
    return "the baseline was written on another machine"
  shared = set(new.versions) & set(base.versions)
  if not shared:
    return "the runs do not both record their package versions"
  if any(new.versions[k] != base.versions[k] for k in shared):
    return "package versions differ"
  if flag_changes(new, base):
    return "numerics flags differ"
  return ""


def flag_changes(new: Snapshot, base: Snapshot) -> list[str]:
  """Each numerics flag (parity.numerics_flags) both runs recorded whose value differs: 'JAX_REMAT3 unset -> 1'; []
  when equal or when either run recorded none. A key only one run holds is not compared (a card keeps the
  environment's flags, not the sides' semantics cards); a key held with no value is 'unset'."""
  nf, bf = new.numerics_flags, base.numerics_flags
  if nf is None or bf is None:
    return []
  show = lambda v: "unset" if v is None else repr(v)
  return [f"{k} {show(bf.get(k))} -> {show(nf.get(k))}" for k in sorted(set(nf) & set(bf)) if nf[k] != bf[k]]


def flag_notes(new: Snapshot, base: Snapshot) -> list[str]:
  """The numerics-flags note, as the versions note: not a gate; a difference turns the bitwise band off (the flags
  change where XLA copies to the host, which residuals a remat policy keeps, how matmuls round)."""
  if new.numerics_flags is None or base.numerics_flags is None:
    who = " and ".join(w for w, s in (("the baseline", base), ("the new run", new)) if s.numerics_flags is None)
    return [f"numerics flags not compared: {who} recorded none (written before environment.json kept them)"]
  changed = flag_changes(new, base)
  if changed:
    return ["numerics flags differ (not a gate; the per-step gates use the cross-framework band, not bit for bit): "
            + "; ".join(changed)]
  set_ = [f"{k}={v}" for k, v in sorted(base.numerics_flags.items()) if v is not None]
  return [f"same numerics flags ({', '.join(set_) or 'none set'})"]


def records_threads(side: str) -> bool:
  """Whether `side`'s worker records its thread settings in every summary (its record's `records_threads`; the torch
  sides: torch_impl.doctor.thread_settings): such a side without a record is a run written before it was kept, and
  its thread count (torch's summation order) is unknown. The jax side records none: XLA's CPU pool follows the CPU
  count, which the machine identity compares; a jax record (XLA_FLAGS) is compared where a run has one."""
  record = find_side(side)
  return record is not None and record.records_threads


def thread_difference(side: str, new: Snapshot, base: Snapshot) -> str:
  """Why `side`'s thread settings do not prove the same summation order ('' when they do): they differ ('thread
  settings differ: torch 2 -> 1 threads; OMP_NUM_THREADS 2 -> 1'), or one run did not record them (unknown)."""
  changed = _thread_changes(side, new, base)
  if changed is None:
    return (f"thread settings unknown: {_thread_missing(side, new, base)} recorded none for {side} (written before "
            "runs kept them), and the thread count sets torch's float summation order")
  return f"thread settings differ: {'; '.join(changed)}" if changed else ""


def _thread_missing(side: str, new: Snapshot, base: Snapshot) -> str:
  """'the baseline', 'the new run' or both: which run kept no thread record of `side`."""
  return " and ".join(w for w, snap in (("the baseline", base), ("the new run", new))
                      if (snap.threads or {}).get(side) is None)


def _thread_changes(side: str, new: Snapshot, base: Snapshot) -> list[str] | None:
  """Each thread setting of `side` that differs (_thread_change text; [] when equal), None when unknown: one run
  has no record of a side that `records_threads`, or only one run has a record of another side."""
  nt, bt = ((s.threads or {}).get(side) for s in (new, base))
  if nt is None and bt is None and not records_threads(side):
    return []
  if nt is None or bt is None:
    return None
  return [_thread_change(k, bt.get(k), nt.get(k)) for k in THREAD_KEYS if bt.get(k) != nt.get(k)]


def _thread_change(key: str, b, n) -> str:
  """One thread setting that differs, as the notes say it: 'torch 2 -> 1 threads', 'OMP_NUM_THREADS unset -> 1'
  (an empty value: '')."""
  label = {"torch_num_threads": "torch {} -> {} threads", "torch_interop_threads": "torch interop {} -> {} threads"}
  show = ["unset" if v is None else v or "''" for v in (b, n)]
  return label.get(key, key + " {} -> {}").format(*show)


def thread_notes(new: Snapshot, base: Snapshot) -> list[str]:
  """The thread-settings note (as the versions note: not a gate; a difference or a missing record turns that side's
  bitwise band off): 'thread settings differ (...): torch: torch 2 -> 1 threads; ...', or 'same thread settings'."""
  sides = [s for s in base.sides if s in new.sides]
  changes = {s: _thread_changes(s, new, base) for s in sides}
  differ = [f"{s}: {'; '.join(c)}" for s, c in changes.items() if c]
  unknown = [f"{s} ({_thread_missing(s, new, base)} recorded none)" for s, c in changes.items() if c is None]
  out = []
  if differ:
    out.append("thread settings differ (not a gate; they set the float summation order, so those sides use the "
               f"cross-framework band, not bit for bit): {' | '.join(differ)}")
  if unknown:
    out.append(f"thread settings unknown, so no bitwise band: {', '.join(unknown)}")
  recorded = [s for s, c in changes.items() if c == [] and (base.threads or {}).get(s) is not None]
  if recorded and not out:
    out.append(f"same thread settings ({', '.join(recorded)})")
  return out


def pair_bitwise(pair: str, bands: dict[str, Band]) -> bool:
  sides = pair.split("~")
  return all(s in bands and bands[s].bitwise for s in sides)


