"""Host<->device moves in an optimised GPU HLO text (`compiled.as_text()`), for benchmarks/deviceless_aot.py.

Pure text: no jax, no numpy. The forms it recognises are those the CUDA plugin of jax 0.10.2 emitted for the
project's offload plans (docs/deviceless-aot.md shows one line of each):

  copy-start / copy-done       %copy-start.2 = (f32[8]{0}, f32[8]{0:S(5)}, u32[]) copy-start(%p)   (dst, src, ctx)
  fusion-start / fusion-done   a dynamic-slice out of an S(5) buffer (host -> device) or a dynamic-update-slice into
                               one (device -> host), async: ((operand shapes), result, u32[]) fusion-start(...)
  copy                         a synchronous copy whose source or result is in S(5)

Memory space 5 (`S(5)` in a layout) is host memory; a scalar in device memory prints with no layout (`s32[]`), in
host memory as `s32[]{:S(5)}`.
"""
from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["instructions", "nbytes", "trip_counts", "transfers", "summary", "trim", "TRIM_STEPS"]

_COMP = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = ")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_COMPUTE = {"fusion", "custom-call", "while", "conditional", "call", "dot", "convolution", "all-reduce",
            "all-gather", "reduce-scatter", "all-reduce-start", "all-gather-start", "collective-permute-start"}
"""Opcodes counted as compute when they sit inside a copy's window."""
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8}
HOST = "S(5)"


def _split_top(text: str) -> list[str]:
  """`text` split at commas outside (), {} and [] (a tuple shape's elements)."""
  out, depth, cur = [], 0, ""
  for ch in text:
    depth += (ch in "({[") - (ch in ")}]")
    if ch == "," and depth == 0:
      out.append(cur.strip())
      cur = ""
    else:
      cur += ch
  return out + [cur.strip()] if cur.strip() else out


def _group_end(text: str) -> int:
  """Index just past the bracket group that opens at text[0]."""
  depth = 0
  for j, ch in enumerate(text):
    depth += (ch in "({[") - (ch in ")}]")
    if depth == 0:
      return j + 1
  return len(text)


def nbytes(shape: str) -> int:
  """Bytes of an array shape such as `f32[2,32]{1,0:S(5)}`; 0 for a tuple, a token or an unknown dtype."""
  m = _ARRAY.match(shape)
  if not m or shape.startswith("("):
    return 0
  return _DTYPE_BYTES.get(m.group(1), 0) * math.prod(int(d) for d in m.group(2).split(",") if d)


def instructions(hlo: str) -> list[dict[str, Any]]:
  """Every instruction of an HLO text, in text order (the schedule order of a scheduled module).

  Returns dicts: computation (name), entry (it is the ENTRY computation), index (position in it), name, shape
  (text), opcode, operands (names), line.
  """
  out, comp, entry, idx = [], "", False, 0
  for line in hlo.splitlines():
    if (m := _COMP.match(line)):
      comp, entry, idx = m.group(2), bool(m.group(1)), 0
      continue
    if not (m := _INSTR.match(line)):
      continue
    rest = line[m.end():]
    cut = _group_end(rest) if rest.startswith("(") else rest.find(" ")
    shape, tail = rest[:cut], rest[cut:].lstrip()
    opcode = tail.split("(", 1)[0]
    args = tail[len(opcode):]
    operands = re.findall(r"%([\w.-]+)", args[:_group_end(args)]) if args.startswith("(") else []
    out.append({"computation": comp, "entry": entry, "index": idx, "name": m.group(1), "shape": shape, "opcode": opcode,
                "operands": operands, "line": line})
    idx += 1
  return out


def trip_counts(ins: list[dict[str, Any]]) -> dict[str, int]:
  """Times each computation runs per execution: 1 for ENTRY (and any computation no while calls), a while body
  its caller's count times the while's `known_trip_count` (1 when the backend config gives none)."""
  caller: dict[str, tuple[str, int]] = {}
  for i in ins:
    if i["opcode"] == "while" and (body := re.search(r"body=%([\w.-]+)", i["line"])):
      n = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', i["line"])
      caller[body.group(1)] = (i["computation"], int(n.group(1)) if n else 1)

  def times(comp: str, depth: int = 0) -> int:
    return 1 if comp not in caller or depth > 64 else caller[comp][1] * times(caller[comp][0], depth + 1)
  return {c: times(c) for c in {i["computation"] for i in ins}}


def _classify(i: dict[str, Any], shape_of: dict[str, str]) -> tuple[str, int, str] | None:
  """(direction, bytes, operand moved) of one instruction that moves data across or within S(5); None otherwise."""
  op, sh = i["opcode"], i["shape"]
  if op == "copy-start":
    dst, src = _split_top(sh[1:-1])[:2]
    src_host, dst_host, moved, operand = HOST in src, HOST in dst, nbytes(dst), i["operands"][0]
  elif op == "fusion-start":
    ins_shapes, result = _split_top(sh[1:-1])[:2]
    parts = _split_top(ins_shapes[1:-1])
    device = [k for k, x in enumerate(parts) if HOST not in x and nbytes(x) > 4]  # not the s32[] indices
    host = [k for k, x in enumerate(parts) if HOST in x]
    if HOST in result:  # dynamic-update-slice of a device update into a host buffer
      src_host, dst_host = not device, True
      moved = sum(nbytes(parts[k]) for k in device)
      operand = i["operands"][device[0]] if device else i["operands"][0]
    else:  # dynamic-slice out of a host buffer
      src_host, dst_host, moved = bool(host), False, nbytes(result)
      operand = i["operands"][host[0]] if host else i["operands"][0]
  elif op == "copy" and i["operands"]:
    src_host, dst_host, moved, operand = HOST in shape_of.get(i["operands"][0], ""), HOST in sh, nbytes(sh), \
        i["operands"][0]
  else:
    return None
  direction = {(True, False): "host_to_device", (False, True): "device_to_host",
               (True, True): "host_to_host"}.get((src_host, dst_host))
  return None if direction is None else (direction, moved, operand)


def transfers(hlo: str) -> list[dict[str, Any]]:
  """Every move into, out of or within host memory (S(5)) in an optimised HLO text, in schedule order.

  Returns dicts: computation, name, opcode ('copy-start' | 'fusion-start' | 'copy'), direction ('host_to_device' |
  'device_to_host' | 'host_to_host'), bytes (one execution: the device-side array), per_step (times its computation
  runs per execution, `trip_counts`), operand (the instruction moved: an entry parameter's name is the state leaf's
  path), op_name (metadata, "" if none), window (instructions strictly between the start and its done in that
  computation; None for a synchronous copy or a start with no done there), window_compute (how many of those are
  `_COMPUTE` opcodes), position (start index / instructions in its computation, 0..1).
  """
  ins = instructions(hlo)
  shape_of = {i["name"]: i["shape"] for i in ins}
  by_comp: dict[str, list[dict[str, Any]]] = {}
  for i in ins:
    by_comp.setdefault(i["computation"], []).append(i)
  trips, out = trip_counts(ins), []
  for i in ins:
    if (kind := _classify(i, shape_of)) is None:
      continue
    comp = by_comp[i["computation"]]
    done = next((d for d in comp[i["index"] + 1:] if d["opcode"].endswith("-done") and i["name"] in d["operands"]),
                None) if i["opcode"].endswith("-start") else None
    between = comp[i["index"] + 1:done["index"]] if done else []
    name = re.search(r'op_name="([^"]*)"', i["line"])
    out.append({"computation": i["computation"], "name": i["name"], "opcode": i["opcode"], "direction": kind[0],
                "bytes": kind[1], "per_step": trips[i["computation"]], "operand": kind[2],
                "op_name": name.group(1) if name else "", "window": len(between) if done else None,
                "window_compute": sum(b["opcode"] in _COMPUTE for b in between),
                "position": round(i["index"] / len(comp), 3)})
  return out


def summary(moves: list[dict[str, Any]]) -> dict[str, Any]:
  """Per direction: instructions, bytes_per_step (sum of bytes x per_step), and instruction counts by computation
  ('name (xN)', N = per_step) and by opcode."""
  out: dict[str, Any] = {}
  for c in moves:
    d = out.setdefault(c["direction"], {"instructions": 0, "bytes_per_step": 0, "by_computation": {},
                                        "by_opcode": {}})
    d["instructions"] += 1
    d["bytes_per_step"] += c["bytes"] * c["per_step"]
    for key, val in (("by_computation", f'{c["computation"]} (x{c["per_step"]})'), ("by_opcode", c["opcode"])):
      d[key][val] = d[key].get(val, 0) + 1
  return out


TRIM_STEPS = (
    "every computation that does not mention S(5) dropped (ENTRY kept)",
    "the FileNames/FunctionNames/FileLocations/StackFrames tables dropped, with the metadata fields that point into "
    "them or repeat the instruction name (stack_frame_id, scheduling_name)",
    "the async wrapped computations (%wrapped_*, called by fusion-start) dropped but the first of each kind",
)
"""What `trim` applies, in order, until the text fits."""


def _thin(block: str) -> str:
  block = re.sub(r' ?(scheduling_name="[^"]*"|stack_frame_id=\d+)', "", block)
  return block.replace("metadata={}, ", "").replace(", metadata={}", "")


def trim(hlo: str, max_bytes: int) -> tuple[str, str]:
  """The HLO text, or over `max_bytes` cut by as many of `TRIM_STEPS` as it takes (each keeps the rest in its
  order; the last one may still leave it over); and a note saying which were applied and the sizes."""
  size = len(hlo.encode())
  if size <= max_bytes:
    return hlo, f"untrimmed ({size} bytes)"
  first = re.search(r"^(%|ENTRY )", hlo, re.M)
  header, blocks, cur = hlo[:first.start()], [], []
  for line in hlo[first.start():].splitlines(keepends=True):
    cur.append(line)
    if line.startswith("}"):
      blocks.append("".join(cur).lstrip("\n"))
      cur = []
  blocks = [b for b in blocks if HOST in b or b.startswith("ENTRY")]
  out, steps = header + "\n".join(blocks), 1
  if len(out.encode()) > max_bytes:
    header, blocks, steps = header.split("\n", 1)[0] + "\n\n", [_thin(b) for b in blocks], 2
    out = header + "\n".join(blocks)
  if len(out.encode()) > max_bytes:
    seen: set[str] = set()
    stem = lambda b: re.match(r"%(wrapped_[\w-]+?)(\.\d+)? ", b).group(1)
    blocks = [b for b in blocks if not b.startswith("%wrapped_") or (stem(b) not in seen and not seen.add(stem(b)))]
    out, steps = header + "\n".join(blocks), 3
  return out, (f"trimmed from {size} to {len(out.encode())} bytes (no longer parseable by XLA): "
               + "; ".join(TRIM_STEPS[:steps]))
