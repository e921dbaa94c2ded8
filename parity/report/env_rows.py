"""Readable rows of environment.json's structured blocks for the report's Environment table: one row per setting
('worker threads' | 'OMP_NUM_THREADS = 2 (set by parity: <reason>)'), never a JSON blob; the raw blocks stay in
environment.json and report.json. Plain text; callers escape."""
from __future__ import annotations

from parity.report.cells import fmt_bytes

__all__ = ["readable", "worker_thread_rows", "numerics_flag_rows", "host_limit_rows", "host_pool_rows",
           "block_rows"]

Rows = list[tuple[str, str]]


def readable(v) -> str:
  """Any JSON value as plain text: a mapping 'key value; key value' (nested ones in parentheses), a list joined
  with ', ', None 'none', *_bytes integers in GiB/MiB."""
  if v is None:
    return "none"
  if isinstance(v, bool):
    return "yes" if v else "no"
  if isinstance(v, dict):
    parts = []
    for k, x in v.items():
      text = fmt_bytes(x) if str(k).endswith("_bytes") and isinstance(x, (int, float)) else readable(x)
      parts.append(f"{str(k).replace('_', ' ')} " + (f"({text})" if isinstance(x, dict) and x else text))
    return "; ".join(parts) or "none"
  if isinstance(v, (list, tuple)):
    return ", ".join(readable(x) for x in v) or "none"
  return str(v)


def worker_thread_rows(block) -> Rows:
  """One row per variable parity set for the workers: 'worker threads' | 'OMP_NUM_THREADS = 2 (set by parity:
  <reason>)'; the inputs the count came from on a row of their own."""
  if not isinstance(block, dict):
    return [("worker threads", readable(block))]
  by, reason = block.get("set_by") or {}, block.get("reason") or ""
  rows = [("worker threads", f"{k} = {v} (set by {by.get(k, '?')}" + (f": {reason})" if reason else ")"))
          for k, v in (block.get("values") or {}).items()]
  if block.get("user"):
    rows.append(("worker threads: the user's own", readable(block["user"])))
  if block.get("inputs"):
    rows.append(("worker threads: inputs", readable(block["inputs"])))
  return rows or [("worker threads", f"none set: {reason}" if reason else "none set")]


def numerics_flag_rows(block) -> Rows:
  """One row per numerics flag (parity.numerics_flags): 'numerics flag' | 'JAX_REMAT3 = unset (the
  framework's default)' or 'JAX_REMAT3 = 1 (set)'; XLA_FLAGS entries recorded but not compared on one row."""
  if not isinstance(block, dict):
    return [("numerics flags", readable(block))]
  by = block.get("set_by") or {}
  rows = []
  for k, v in (block.get("values") or {}).items():
    who = f"set by {by[k]}" if k in by else "the framework's default" if v is None else "set"
    text = ("unset" if v is None else str(v)) + f" ({who})"
    rows.append(("numerics flag", f"{k} = {text}"))
  if block.get("other_xla_flags"):
    rows.append(("numerics flags: other XLA_FLAGS (recorded, not compared)", readable(block["other_xla_flags"])))
  if block.get("side_records"):
    rows.append(("numerics flags: the sides' own records", str(block["side_records"])))
  return rows


def host_limit_rows(block) -> Rows:
  """The host limits: XLA's pinned-host pool ('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB = 64 GiB (set by
  default: <where it applies>)'), MemAvailable, the cgroup memory controller and what a run may use, one row each."""
  if not isinstance(block, dict):
    return [("host limits", readable(block))]
  rows = []
  pool = block.get("xla_pool")
  if isinstance(pool, dict):
    var = pool.get("variable", "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB")
    val = f"{pool.get('gib')} GiB" if pool.get("value") is None else f"{pool.get('value')}"
    why = f": {pool['error']}" if pool.get("error") else f": {pool['applies']}" if pool.get("applies") else ""
    rows.append(("host limit", f"{var} = {val} (set by {pool.get('source', '?')}{why})"))
  for key, label in (("mem_available_bytes", "MemAvailable"), ("cgroup_headroom_bytes", "cgroup headroom"),
                     ("available_bytes", "memory a run may use")):
    if key in block:
      rows.append(("host limit", f"{label} = " + ("none" if block[key] is None else fmt_bytes(block[key]))))
  cg = block.get("cgroup", "absent")
  if cg != "absent":
    rows.append(("host limit", "cgroup = " + ("no cgroup memory controller readable" if cg is None else readable(cg))))
  rest = {k: v for k, v in block.items() if k not in ("xla_pool", "mem_available_bytes", "cgroup_headroom_bytes",
                                                      "available_bytes", "cgroup")}
  rows += [("host limit", f"{k.replace('_', ' ')} = {readable(v)}") for k, v in rest.items()]
  return rows


def host_pool_rows(block) -> Rows:
  """Each side's pinned-host pool decision: 'host pool' | 'jax = <its statement> (set by ...)."""
  if not isinstance(block, dict):
    return [("host pool", readable(block))]
  return [("host pool", f"{side} = " + (f"{p.get('statement')} (set by {p.get('set_by', '?')})"
                                        if isinstance(p, dict) and p.get("statement") else readable(p)))
          for side, p in block.items()]


def block_rows(key: str, val) -> Rows:
  """The rows of one environment.json key: the blocks above by name, anything else one readable row."""
  by_key = {"worker_threads": worker_thread_rows, "numerics_flags": numerics_flag_rows,
            "host_limits": host_limit_rows, "host_pool": host_pool_rows}
  if key in by_key:
    return by_key[key](val)
  return [(key.replace("_", " "), "none" if val is None else val if isinstance(val, str) else readable(val))]
