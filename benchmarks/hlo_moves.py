"""Host<->device moves in an optimised GPU HLO text (`compiled.as_text()`), for benchmarks/deviceless_aot.py: the
records of jax_impl/hlo_transfers.py (the one reader of these forms, also behind placement.json) in the flat form
the fixtures of tests/fixtures/hlo/ store, plus the host-to-host copies and `trim`.

Pure text: no jax, no numpy. The forms the CUDA plugin of jax 0.10.2 emitted for the project's offload plans
(docs/deviceless-aot.md shows one line of each):

  copy-start / copy-done       %copy-start.2 = (f32[8]{0}, f32[8]{0:S(5)}, u32[]) copy-start(%p)   (dst, src, ctx)
  fusion-start / fusion-done   a dynamic-slice out of an S(5) buffer (host -> device) or a dynamic-update-slice into
                               one (device -> host), async: ((operand shapes), result, u32[]) fusion-start(...)
  copy                         a synchronous copy whose source or result is in S(5)

Memory space 5 (`S(5)` in a layout) is host memory; a scalar in device memory prints with no layout (`s32[]`), in
host memory as `s32[]{:S(5)}`.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jax_impl import hlo_transfers as ht  # (plain text, no jax)

__all__ = ["transfers", "summary", "trim", "TRIM_STEPS"]

_COMPUTE = {"fusion", "custom-call", "while", "conditional", "call", "dot", "convolution", "all-reduce",
            "all-gather", "reduce-scatter", "all-reduce-start", "all-gather-start", "collective-permute-start"}
"""Opcodes counted as compute when they sit inside a copy's window (`window_compute` of the fixtures)."""
HOST = "S(5)"
_DIRECTION = {"h2d": "host_to_device", "d2h": "device_to_host"}


def _moved_operand(mod: ht.Module, comp: ht.Computation, ins: ht.Instr, op: str) -> str:
  """The operand a move carries: a dynamic-update-slice's (largest) device update, else the host/source buffer."""
  if ins.opcode == "fusion-start":
    shapes = {o: comp.by_name[o].shape if o in comp.by_name else "" for o in ins.operands}
    if op == "dynamic-update-slice":
      device = [o for o in ins.operands if ht.memory_space(shapes[o]) not in ht.HOST_SPACES
                and ht.shape_bytes(shapes[o]) > 4]
      return device[0] if device else ins.operands[0]
    host = [o for o in ins.operands if ht.memory_space(shapes[o]) in ht.HOST_SPACES]
    return host[0] if host else ins.operands[0]
  return ins.operands[0] if ins.operands else ""


def _record(comp: ht.Computation, ins: ht.Instr, direction: str, nbytes: int, per_step: int | None, operand: str,
            done: int | None) -> dict[str, Any]:
  between = comp.instrs[ins.index + 1:done] if done is not None else []
  return {"computation": comp.name, "name": ins.name, "opcode": ins.opcode, "direction": direction, "bytes": nbytes,
          "per_step": per_step, "operand": operand, "op_name": ins.op_name or "",
          "window": len(between) if done is not None else None,
          "window_compute": sum(b.opcode in _COMPUTE for b in between),
          "position": round(ins.index / len(comp.instrs), 3)}


def transfers(hlo: str) -> list[dict[str, Any]]:
  """Every move into, out of or within host memory (S(5)) in an optimised HLO text, in schedule order.

  Returns dicts: computation, name, opcode ('copy-start' | 'fusion-start' | 'copy'), direction ('host_to_device' |
  'device_to_host' | 'host_to_host'), bytes (one execution: the device-side array), per_step (times its computation
  runs per execution), operand (the instruction moved: an entry parameter's name is the state leaf's path), op_name
  (metadata, "" if none), window (instructions strictly between the start and its done in that computation; None
  for a synchronous copy), window_compute (how many of those are `_COMPUTE` opcodes), position (start index /
  instructions in its computation, 0..1). Host-to-device and device-to-host moves are jax_impl.hlo_transfers';
  host-to-host copies (synchronous copies between two host buffers) are added here.
  """
  mod = ht.parse_module(hlo)
  found = {(c["computation"], c["start"]): c for c in ht.transfers(mod)["copies"]}
  out = []
  for comp in mod.computations.values():
    if comp.name in mod.nested:
      continue
    for ins in comp.instrs:
      c = found.get((comp.name, ins.index))
      if c is not None:
        out.append(_record(comp, ins, _DIRECTION[c["direction"]], c["bytes"], c["times_per_step"],
                           _moved_operand(mod, comp, ins, c["op"]), c["done"] if c["form"] == "async" else None))
      elif ins.opcode == "copy" and ins.operands and HOST in ins.shape \
          and HOST in (comp.by_name[ins.operands[0]].shape if ins.operands[0] in comp.by_name else ""):
        out.append(_record(comp, ins, "host_to_host", ht.shape_bytes(ins.shape), ht.times_per_step(mod, comp.name),
                           ins.operands[0], None))
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
