"""Where each side's training state lives and what crosses between host and device memory per step:
report.json 'placement' (`placement_section`, read from the run folder) and the blocks report.md and report.html
render from it (`placement_blocks`; the schedule strip's SVG: parity.report.placement_strip).

What is read (schemas: the JAX worker's placement.json, the DeepSpeed side's summary.json 'transfers'):
  <side>/placement.json          a JAX side: the compiled train step's placement per tensor class, memory_analysis
                                 split device/host, bytes per step per direction, the in-step copies when known
  <side>/summary.json transfers  a DeepSpeed side: bytes per step per direction and what moves, CPU Adam seconds
  <side>/summary.json            the torch baseline: its state_bytes_by_memory_kind (host 0: nothing is offloaded)
A file that is missing, not JSON or not of the schema is recorded as such ('missing', 'unreadable', 'invalid' with
the reason) and shown as "not recorded"; the report never fails on it. Plain text; callers escape."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from parity.protocol.placement import host_ops_of, judged_mismatches, split_host_compute
from parity.report.cells import fmt, fmt_bytes
from parity.report.placement_strip import strip_extent
from parity.report.run_record import RunRecord

__all__ = ["PLACEMENT_FILE", "PLACEMENT_SCHEMA", "read_placement", "read_transfers", "placement_section",
           "records_placement",
           "PLACEMENT_HEADERS", "class_rows", "memory_analysis_rows", "TRANSFER_HEADERS", "transfer_rows",
           "COPY_HEADERS", "copy_rows", "placement_blocks", "PLACEMENT_INTRO"]

PLACEMENT_FILE = "placement.json"
PLACEMENT_SCHEMA = "parity.placement/1"
_NUM, _INT, _STR, _OPT_STR, _DIR = "number or null", "whole number >= 0", "text", "text or null", "'h2d' or 'd2h'"
_CLASS = {"class": _STR, "role": _STR, "memory_space": _STR, "expected": _OPT_STR, "buffers": _NUM,
          "host_buffers": _NUM, "bytes": _NUM, "host_bytes": _NUM}
_COPY = {"tensor": _OPT_STR, "class": _OPT_STR, "direction": _DIR, "bytes": _NUM, "start": _INT, "done": _INT,
         "window_ops": _NUM, "window_flops": _NUM}
_MISMATCH = {"class": _STR, "role": _STR, "expected": _OPT_STR, "compiled": _OPT_STR, "detail": _STR}
_ITEM = {"tensor": _STR, "direction": _DIR, "bytes": _NUM, "times_per_step": _NUM, "from": _OPT_STR}
_PER_STEP = {"h2d": _NUM, "d2h": _NUM}
_ADAM = {"n": _NUM, "min": _NUM, "median": _NUM, "max": _NUM}
_ANALYSIS = ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "generated_code_bytes")


def _fits(v: Any, kind: str) -> bool:
  number = isinstance(v, (int, float)) and not isinstance(v, bool)
  return {_NUM: v is None or (number and math.isfinite(v)), _INT: number and isinstance(v, int) and v >= 0,
          _STR: isinstance(v, str), _OPT_STR: v is None or isinstance(v, str), _DIR: v in ("h2d", "d2h")}[kind]


def _fields(obj: Any, fields: dict[str, str], where: str) -> list[str]:
  """What `obj` lacks to be a mapping holding `fields` (key -> kind), one text per problem, naming `where`."""
  if not isinstance(obj, dict):
    return [f"{where} is not a mapping"]
  return [f"{where}.{k} is missing" if k not in obj else f"{where}.{k} is not a {kind} ({obj[k]!r})"
          for k, kind in fields.items() if k not in obj or not _fits(obj[k], kind)]


def _rows(obj: Any, fields: dict[str, str], where: str) -> list[str]:
  if not isinstance(obj, list):
    return [f"{where} is not a list"]
  return [p for i, x in enumerate(obj) for p in _fields(x, fields, f"{where}[{i}]")]


def _placement_problems(p: Any) -> list[str]:
  """Why `p` is not a placement.json of PLACEMENT_SCHEMA that the report can render; [] when it is."""
  if not isinstance(p, dict):
    return ["it is not a JSON object"]
  if p.get("schema") != PLACEMENT_SCHEMA:
    return [f"schema is {p.get('schema')!r}, not {PLACEMENT_SCHEMA!r}"]
  out = _rows(p.get("classes"), _CLASS, "classes") + _rows(p.get("mismatches"), _MISMATCH, "mismatches")
  out += _fields(p.get("bytes_per_step"), _PER_STEP, "bytes_per_step")
  tr = p.get("transfers")
  out += _fields(tr, {"why_not": _OPT_STR}, "transfers")
  if isinstance(tr, dict):
    out += [] if isinstance(tr.get("known"), bool) else [f"transfers.known is not true/false ({tr.get('known')!r})"]
    out += _rows(tr.get("copies", []), _COPY, "transfers.copies")
  ma = p.get("memory_analysis")
  if ma is not None:
    out += _fields(ma, {}, "memory_analysis")
    for space in ("device", "host") if isinstance(ma, dict) else ():
      sub = ma.get(space)
      if sub is not None:
        out += _fields(sub, {k: _NUM for k in sub if k in _ANALYSIS} if isinstance(sub, dict) else {},
                       f"memory_analysis.{space}")
  return out + ([] if p.get("activations") is None else _fields(p["activations"], {}, "activations"))


def _transfers_problems(t: Any) -> list[str]:
  """Why `t` is not a summary.json 'transfers' block the report can render; [] when it is."""
  out = _fields(t, {}, "transfers")
  if out:
    return out
  out = _fields(t.get("bytes_per_step"), _PER_STEP, "transfers.bytes_per_step")
  out += _rows(t.get("items"), _ITEM, "transfers.items")
  out += [] if t.get("cpu_adam_s") is None else _fields(t["cpu_adam_s"], _ADAM, "transfers.cpu_adam_s")
  return out + ([] if isinstance(t.get("notes"), (list, type(None))) else ["transfers.notes is not a list"])


def read_placement(path: Path) -> dict[str, Any]:
  """{status, error, placement} of a JAX side's placement.json: status 'ok' (placement: the file's object),
  'missing', 'unreadable' (not UTF-8 JSON; error: why) or 'invalid' (error: what does not fit PLACEMENT_SCHEMA);
  placement None unless 'ok'. Never raises."""
  try:
    p = json.loads(Path(path).read_text(encoding="utf-8"))
  except FileNotFoundError:
    return {"status": "missing", "error": f"{Path(path).parent.name}/{PLACEMENT_FILE} is missing", "placement": None}
  except (OSError, ValueError) as exc:
    return {"status": "unreadable", "error": f"{Path(path).parent.name}/{PLACEMENT_FILE}: {exc}", "placement": None}
  bad = _placement_problems(p)
  if bad:
    return {"status": "invalid", "error": f"{Path(path).parent.name}/{PLACEMENT_FILE}: " + "; ".join(bad[:4])
            + (f"; and {len(bad) - 4} more" if len(bad) > 4 else ""), "placement": None}
  return {"status": "ok", "error": None, "placement": p}


def read_transfers(side: str, summary: dict) -> dict[str, Any]:
  """{status, error, transfers} of a DeepSpeed side's summary.json 'transfers' (status as read_placement's)."""
  if not summary:
    return {"status": "missing", "error": f"{side} wrote no summary.json", "transfers": None}
  if "transfers" not in summary:
    return {"status": "missing", "error": f"{side}/summary.json has no 'transfers'", "transfers": None}
  bad = _transfers_problems(summary["transfers"])
  if bad:
    return {"status": "invalid", "error": f"{side}/summary.json " + "; ".join(bad[:4]), "transfers": None}
  return {"status": "ok", "error": None, "transfers": summary["transfers"]}


def _baseline(side: str, summary: dict) -> dict[str, Any]:
  """A torch side's bytes per step without a transfer count (the plain-torch and FSDP2 sides): 0 each way when its
  summary records no state in host memory; FSDP2 with state in host memory (its offload) is not counted."""
  if not summary:
    return {"status": "missing", "error": f"{side} wrote no summary.json", "bytes_per_step": None}
  kinds = summary.get("state_bytes_by_memory_kind")
  host = kinds.get("host") if isinstance(kinds, dict) else None
  if not _fits(host, _NUM) or host is None:
    return {"status": "missing", "error": f"{side}/summary.json has no state_bytes_by_memory_kind.host",
            "bytes_per_step": None}
  if host and side == "fsdp":  # CPUOffloadPolicy or save_on_cpu: host state by design, copies not counted
    return {"status": "missing", "error": f"{side}/summary.json: {host:,} bytes of state in host memory (FSDP2 "
            "offload); the FSDP2 side does not count its host-device copies", "bytes_per_step": None}
  if host:
    return {"status": "invalid", "error": f"{side}/summary.json state_bytes_by_memory_kind.host is {host} bytes: "
            "the baseline holds state in host memory, and what moves is not recorded", "bytes_per_step": None}
  return {"status": "ok", "error": None, "bytes_per_step": {"h2d": 0, "d2h": 0}}


def placement_section(run_dir: Path, sides: dict[str, dict]) -> dict[str, Any]:
  """report.json 'placement': {'sides': {side: {kind, from, status, error, placement | transfers |
  bytes_per_step}}} for every side (kind: its name, 'jax' | 'deepspeed' | 'torch'; from: the file it was read from).

  Args:
    run_dir: the run folder (<side>/placement.json of the JAX side).
    sides: report.json 'sides' (each side's 'summary', summary.json as read).
  Returns:
    JSON-ready; what report.md/.html render (`placement_blocks`) and `parity report` recomputes. Never raises for
    a missing or malformed file: its entry says why (read_placement, read_transfers).
  """
  out = {}
  for side, s in sides.items():
    summ = (s or {}).get("summary") or {}
    if side == "jax":
      out[side] = {"kind": side, "from": f"{side}/{PLACEMENT_FILE}",
                   **read_placement(Path(run_dir) / side / PLACEMENT_FILE)}
    elif side == "deepspeed":
      out[side] = {"kind": side, "from": f"{side}/summary.json transfers", **read_transfers(side, summ)}
    else:
      out[side] = {"kind": side, "from": f"{side}/summary.json state_bytes_by_memory_kind", **_baseline(side, summ)}
  return {"sides": out}


def records_placement(entry: dict) -> bool:
  """Whether a side's `placement_section` entry is a placement the side recorded itself (the JAX side's
  placement.json, DeepSpeed's transfers), not a baseline read from its state bytes (plain torch, FSDP2, any other
  side, by the entry's shape: a baseline's has 'bytes_per_step'), and was found."""
  return entry.get("status") != "missing" and "bytes_per_step" not in entry


# ---------------------------------------------------------------- rows (plain text)

PLACEMENT_INTRO = ("Where each side's state lives and what crosses between host and device memory per step, as each "
                   "side recorded it: the JAX side from its compiled train step (placement.json), DeepSpeed from its "
                   "summary.json transfers, the torch baseline from where its summary puts its state.")
PLACEMENT_HEADERS = ["class", "role", "planned", "compiled", "host / total buffers", "bytes", "host bytes",
                     "placement"]
TRANSFER_HEADERS = ["side", "read from", "h2d per step", "d2h per step", "what moves",
                    "CPU Adam s/step (min / median / max)"]
COPY_HEADERS = ["#", "tensor", "class", "direction", "bytes", "start", "done", "ops in window", "flops in window"]


def _bytes(n) -> str:
  """Exact bytes beside binary units: '1.5 MiB (1,572,864 B)'; '0 B'; 'n/a'."""
  if n is None:
    return "n/a"
  return f"{int(n)} B" if abs(n) < 1024 else f"{fmt_bytes(n)} ({int(n):,} B)"


def _mismatch_of(mismatches: list[dict], c: dict) -> str | None:
  """The detail of the mismatch for class row `c` among placement.json's judged mismatches, None when none names it."""
  return next((m["detail"] for m in mismatches if (m["class"], m["role"]) == (c["class"], c["role"])), None)


def _verdict(c: dict, why: str | None) -> str:
  if why is not None:
    return f"MISMATCH: {why}"
  if c["expected"] is None:
    return "no plan for it"
  if c["memory_space"] == c["expected"]:
    known = c["expected"] == "mixed" and c.get("bytes") and c.get("host_bytes") is not None  # both may be null
    share = c["host_bytes"] / c["bytes"] if known else None
    return "as planned" if share is None else f"as planned ({share:.0%} of its bytes in host memory)"
  return (f"{c['memory_space']}: {fmt(c['host_buffers'])} of {fmt(c['buffers'])} buffers in host memory "
          "(placement.json lists no mismatch)")


def class_rows(p: dict) -> tuple[list[list[str]], list[bool]]:
  """(PLACEMENT_HEADERS rows, mismatch flag per row) of a placement.json: one row per tensor class and role, the
  last cell 'MISMATCH: <detail>' (placement.json's mismatches), 'as planned', 'no plan for it', or, for a compiled
  memory space other than the planned one that placement.json does not call a mismatch, both spaces' buffers."""
  rows, flags = [], []
  mismatches = judged_mismatches(p)
  for c in p["classes"]:
    why = _mismatch_of(mismatches, c)
    rows.append([c["class"], c["role"], c["expected"] or "no expectation", c["memory_space"],
                 f"{fmt(c['host_buffers'])} / {fmt(c['buffers'])}", fmt_bytes(c["bytes"]), fmt_bytes(c["host_bytes"]),
                 _verdict(c, why)])
    flags.append(why is not None)
  return rows, flags


def _unplaced_mismatches(p: dict) -> list[str]:
  """Mismatches placement.json lists for no class row (activations): 'class role: detail'."""
  shown = {(c["class"], c["role"]) for c in p["classes"]}
  return [f"{m['class']} {m['role']}: {m['detail']}" for m in judged_mismatches(p)
          if (m["class"], m["role"]) not in shown]


def _host_ops(p: dict) -> list[tuple]:
  """A block listing the scalar ops XLA computes in host memory (bookkeeping, not failed), or none."""
  _, small, moves = split_host_compute(host_ops_of(p))
  if not small:
    return []
  names = ", ".join(f"{op.get('opcode')} {op.get('name')} ({op.get('bytes')} B)" for op in small[:8])
  more = f", and {len(small) - 8} more" if len(small) > 8 else ""
  return [("p", f"Listed, not failed: {len(small)} scalar ops of at most 8 bytes that XLA computes in host memory "
                f"(the offloaded update count's bookkeeping): {names}{more}."
                + (f" {len(moves)} async halves of host moves are not compute." if moves else ""))]


def memory_analysis_rows(p: dict) -> list[list[str]]:
  """[item, device, host] rows of placement.json memory_analysis ('n/a' where a figure is not recorded); []
  without one."""
  ma = p.get("memory_analysis")
  if not isinstance(ma, dict):
    return []
  dev, host = ma.get("device") or {}, ma.get("host") or {}
  keys = [k for k in _ANALYSIS if k in dev or k in host]
  return [[k, fmt_bytes(dev.get(k)), fmt_bytes(host.get(k)) if k in host else "n/a"] for k in keys]


def _jax_moves(p: dict) -> str:
  """What crosses on the JAX side: the entry buffers in host memory, then the in-step copies (or why not known)."""
  host = [f"{c['class']} {c['role']} {fmt_bytes(c['host_bytes'])}" for c in p["classes"] if c["host_bytes"]]
  tr = p["transfers"]
  copies = tr.get("copies") or []
  if tr["known"]:
    n = {k: sum(c["direction"] == k for c in copies) for k in ("h2d", "d2h")}
    inside = (f"{len(copies)} copies in the compiled step ({n['h2d']} h2d, {n['d2h']} d2h, "
              f"{fmt_bytes(sum(c['bytes'] or 0 for c in copies))})")
  else:
    inside = f"in-step copies not known: {tr.get('why_not') or 'no reason recorded'}"
  return f"entry buffers in host memory: {', '.join(host) or 'none'}; {inside}"


def _ds_moves(t: dict) -> str:
  items = [f"{i['tensor']} {i['direction']} {fmt_bytes(i['bytes'])} x {fmt(i['times_per_step'])}/step"
           + (f" ({i['from']})" if i.get("from") else "") for i in t["items"]]
  return "; ".join(items) or "nothing (no offload)"


def _adam(t: dict) -> str:
  a = t.get("cpu_adam_s")
  if not a:
    return "not measured"
  return f"{fmt(a['min'])} / {fmt(a['median'])} / {fmt(a['max'])} (n={fmt(a['n'])})"


def transfer_rows(sec: dict) -> list[list[str]]:
  """TRANSFER_HEADERS rows, one per side: h2d and d2h bytes per step (JAX: placement.json bytes_per_step, per
  device; DeepSpeed: summary.json transfers, per rank; torch: 0, derived), what moves, CPU Adam seconds per step."""
  out = []
  for side, e in sec["sides"].items():
    if e["status"] != "ok":
      out.append([side, e["from"], "not recorded", "not recorded", e["error"], "n/a"])
      continue
    if e["kind"] == "jax":
      bps, moves, adam = e["placement"]["bytes_per_step"], _jax_moves(e["placement"]), "n/a (no CPU optimizer)"
    elif e["kind"] == "deepspeed":
      bps, moves, adam = e["transfers"]["bytes_per_step"], _ds_moves(e["transfers"]), _adam(e["transfers"])
    else:
      bps, adam = e["bytes_per_step"], "n/a (no CPU optimizer)"
      moves = "nothing: no state in host memory (summary.json state_bytes_by_memory_kind.host 0 B); derived"
    out.append([side, e["from"], _bytes(bps["h2d"]), _bytes(bps["d2h"]), moves, adam])
  return out


def copy_rows(p: dict) -> list[list[str]]:
  """COPY_HEADERS rows of the in-step copies (transfers.copies, by start position)."""
  copies = sorted(p["transfers"].get("copies") or [], key=lambda c: (c["start"], c["done"]))
  return [[str(i), c["tensor"] or "(untraced)", c["class"] or "(untraced)", c["direction"], _bytes(c["bytes"]),
           str(c["start"]), str(c["done"]),
           fmt(c["window_ops"]), "not measured" if c["window_flops"] is None else fmt(c["window_flops"])]
          for i, c in enumerate(copies)]


# ---------------------------------------------------------------- blocks both pages render

def _jax_head(side: str, p: dict) -> str:
  v = p.get("versions") or {}
  plan = ", ".join(f"{k} {json.dumps(x) if isinstance(x, bool) else x}" for k, x in (p.get("plan") or {}).items())
  return (f"{side}: backend {p.get('backend', 'n/a')}, read from the {p.get('source') or 'compiled step'} (jax "
          f"{v.get('jax', 'n/a')}, jaxlib {v.get('jaxlib', 'n/a')}, jax_remat3 {json.dumps(p.get('jax_remat3'))}); "
          f"plan: {plan or 'not recorded'}. Bytes are per device.")


def _activations(p: dict) -> str:
  a = p.get("activations")
  if not isinstance(a, dict):
    return "Activations: not recorded."
  return (f"Activations: policy {a.get('policy')}, planned {a.get('expected')}; device_puts to host that the remat "
          f"policy adds (beyond the same step with remat 'none'): {fmt(a.get('jaxpr_to_host_by_policy'))}. All "
          f"device_puts in the differentiated step's jaxpr, the state's streaming included: "
          f"{fmt(a.get('jaxpr_to_host'))} to host, {fmt(a.get('jaxpr_to_device'))} to device; host-bound copies of "
          f"values other than the state in the compiled step: {fmt(a.get('compiled_to_host_copies'))}.")


def _jax_blocks(side: str, e: dict) -> list[tuple]:
  """The blocks of one JAX side: heading, its placement table, activations, memory_analysis, schedule strip."""
  if e["status"] != "ok":
    return [("h3", f"{side}: placement"), ("p", f"Not recorded: {e['error']}.")]
  p = e["placement"]
  rows, flags = class_rows(p)
  out = [("h3", f"{side}: placement of the compiled step"), ("p", _jax_head(side, p)),
         ("table", PLACEMENT_HEADERS, rows, flags), ("p", _activations(p))]
  out += [("warn", f"MISMATCH {m}.") for m in _unplaced_mismatches(p)] + _host_ops(p)
  ma = memory_analysis_rows(p)
  note = (p.get("memory_analysis") or {}).get("note")
  out += [("p", "memory_analysis of the compiled step: not recorded.")] if not ma else [
      ("p", "memory_analysis of the compiled step, split device/host" + (f" ({note})." if note else ".")),
      ("table", ["item", "device", "host"], ma, [False] * len(ma))]
  tr = p["transfers"]
  if not tr["known"]:
    return out + [("p", f"Copy schedule: not known: {tr.get('why_not') or 'no reason recorded'}.")]
  extent, counted = strip_extent(tr)
  axis = (f"the {extent} instruction positions of the entry computation" if counted else f"positions 0 to {extent} "
          "of the entry computation (its instruction count is not recorded: the axis ends at the last copy's done)")
  return out + [("p", f"Copy schedule: {len(tr.get('copies') or [])} host↔device copies of the compiled step, "
                      f"each from its start to its done position over {axis}."), ("strip", side, p)]


def placement_blocks(rec: RunRecord) -> list[tuple]:
  """What report.md and report.html show of report.json 'placement', medium-neutral: ('p', text), ('h3', text),
  ('warn', text: a mismatch no table row shows), ('table', headers, rows, mismatch flags), ('strip', side, placement)
  (the copy schedule: an SVG in report.html, a table of the copies in report.md). [] when the report has no 'placement'
  section (written before it existed)."""
  sec = rec.placement
  if not isinstance(sec, dict) or not isinstance(sec.get("sides"), dict):
    return []
  rows = transfer_rows(sec)
  out = [("p", PLACEMENT_INTRO), ("h3", "Host↔device bytes per step, side by side"),
         ("table", TRANSFER_HEADERS, rows, [False] * len(rows))]
  notes = [n for e in sec["sides"].values() if e["status"] == "ok" and e["kind"] == "deepspeed"
           for n in e["transfers"].get("notes") or []]
  out += [("p", f"DeepSpeed: {n}") for n in notes]
  for side, e in sec["sides"].items():
    if e["kind"] == "jax":
      out += _jax_blocks(side, e)
  return out
