"""Host<->device transfers in the text of an optimised HLO module: what XLA planned to copy, how many bytes, in which
direction, which tensor, and the window the schedule gives each copy.

Plain text in, JSON-ready dicts out (no jax): it reads `jax.stages.Compiled.as_text()` of any backend. What it
recognises, after openxla/xla's host offloading (`HostOffloader` turns the MoveToHost / MoveToDevice annotations into
copies and dynamic-(update-)slices on host memory space S(5); `HostMemoryTransferAsyncifier`,
xla/hlo/transforms/simplifiers/host_memory_transfer_asyncifier.cc, makes them asynchronous):

  copy-start / copy-done              shape (destination, source, u32[] context): d2h when the destination is in a
                                      host memory space, h2d when the source is; bytes: the destination's
  dynamic-slice-start / -done         ((operands...), result, u32[]): a slice of a host buffer into device memory,
                                      h2d, the slice's bytes
  dynamic-update-slice-start / -done  a device update written into a host buffer: d2h, the update's bytes
  async-start / async-done, calls=%c  the same three without the printer's sugar (c's root is the wrapped op)
  fusion-start / fusion-done          XLA:GPU's asynchronous dynamic-(update-)slice on host memory (calls=
                                      %wrapped_dynamic-slice_computation...; seen in the H100 fixtures of
                                      tests/fixtures/hlo/, jax 0.10.2)
  copy, dynamic-slice, dynamic-update-slice   their synchronous forms (not made asynchronous): a window of 0 ops

Host memory spaces: HOST_SPACES (S(5), XLA's host memory space; S(6), what XLA:CPU gives `unpinned_host` in jax
0.10.2, measured). A transfer inside a while body happens once per iteration: `times_per_step` multiplies the
`known_trip_count` of every loop around it (None when a loop has none). The window is read from the instruction
order of the computation holding the pair, which is the schedule when the module says `is_scheduled=true`.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

__all__ = ["HOST_SPACES", "Instr", "Computation", "Module", "parse_module", "entry_layout", "layout_buffers",
           "shape_bytes", "memory_space", "tuple_elements", "times_per_step", "transfers", "host_compute"]

HOST_SPACES = (5, 6)
"""Layout memory spaces that are host memory: 5 (pinned_host; XLA's kHostMemorySpaceColor) and 6 (unpinned_host on
XLA:CPU, jax 0.10.2, measured)."""

_DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
                "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([\d,]*)\](\{[^}]*\})?")
_SPACE = re.compile(r"S\((\d+)\)")
_ASYNC_OPS = ("copy", "dynamic-slice", "dynamic-update-slice")
_NOT_COMPUTE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-start", "copy-done",
                          "async-start", "async-update", "async-done", "opt-barrier", "optimization-barrier",
                          "dynamic-slice-start", "dynamic-slice-done", "dynamic-update-slice-start",
                          "dynamic-update-slice-done", "partition-id", "replica-id", "after-all"})
"""Opcodes that are bookkeeping, not compute, when a copy's window is counted (`window_compute_ops`)."""
_HOST_OK = _NOT_COMPUTE | frozenset({"copy", "dynamic-slice", "dynamic-update-slice", "while", "call", "conditional"})
"""Opcodes whose result may lie in host memory without computing there (moves, loops, plumbing)."""
_MOVE_TARGETS = ("MoveToHost", "MoveToDevice", "annotate_device_placement", "AllocateBuffer")
"""custom-call targets that place or allocate a buffer in host memory without computing there (HostOffloader
allocates a host buffer for the dynamic-update-slices of an offloaded scan as AllocateBuffer)."""
_PASS = frozenset({"bitcast", "copy", "reshape", "copy-start", "copy-done", "dynamic-slice", "dynamic-update-slice",
                   "dynamic-slice-start", "dynamic-slice-done", "dynamic-update-slice-start",
                   "dynamic-update-slice-done", "async-start", "async-update", "async-done", "while",
                   "opt-barrier", "optimization-barrier"})
"""Opcodes whose operand 0 is (a view or a move of) the same tensor: a trace back to an entry parameter passes them."""


@dataclasses.dataclass
class Instr:
  """One HLO instruction: name (no '%'), shape text, opcode, operand names, the attribute text after the operands,
  its position in its computation, and whether it is the ROOT."""
  name: str
  shape: str
  opcode: str
  operands: list[str]
  attrs: str
  index: int
  root: bool = False

  @property
  def op_name(self) -> str | None:
    """metadata={op_name="..."}, or None."""
    m = re.search(r'op_name="((?:[^"\\]|\\.)*)"', self.attrs)
    return m.group(1).replace("\\'", "'") if m else None

  def called(self, key: str) -> str | None:
    """The computation named by attribute `key` (calls, body, condition, to_apply), or None."""
    m = re.search(rf"\b{key}=%?([\w.\-]+)", self.attrs)
    return m.group(1) if m else None


@dataclasses.dataclass
class Computation:
  name: str
  entry: bool
  instrs: list[Instr] = dataclasses.field(default_factory=list)
  by_name: dict[str, Instr] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Module:
  """A parsed module: computations by name, the entry's name, is_scheduled, and for every computation a while loop,
  call or async op calls: (calling computation, calling instruction)."""
  computations: dict[str, Computation]
  entry: str
  scheduled: bool
  callers: dict[str, tuple[str, Instr]]
  nested: set[str] = dataclasses.field(default_factory=set)
  """Computations that are part of one instruction (a fusion's, an async op's wrapped op, a reduction's), not a
  sequence of their own: their ops are not transfers of the step."""


def _close(text: str, i: int) -> int:
  """Index just past the bracket group opening at text[i] ('(' or '{'), brackets of both kinds nested."""
  depth = 0
  for j in range(i, len(text)):
    depth += {"(": 1, "{": 1, ")": -1, "}": -1}.get(text[j], 0)
    if depth == 0:
      return j + 1
  return len(text)


def _split_top(text: str) -> list[str]:
  """text split at the commas outside any bracket."""
  out, depth, cur = [], 0, []
  for ch in text:
    depth += {"(": 1, "{": 1, "[": 1, ")": -1, "}": -1, "]": -1}.get(ch, 0)
    if ch == "," and depth == 0:
      out.append("".join(cur).strip())
      cur = []
    else:
      cur.append(ch)
  if "".join(cur).strip():
    out.append("".join(cur).strip())
  return out


def tuple_elements(shape: str) -> list[str]:
  """The top-level elements of a tuple shape '(a, (b, c), u32[])'; [shape] for an array shape."""
  s = re.sub(r"/\*[^*]*\*/", "", shape).strip()
  return _split_top(s[1:-1]) if s.startswith("(") else [s]


def shape_bytes(shape: str) -> int:
  """Bytes of every array in a shape's text (a tuple: all its elements), from dtype and dimensions."""
  total = 0
  for dtype, dims, _ in _ARRAY.findall(shape):
    n = _DTYPE_BYTES.get(dtype, 0)
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n
  return total


def memory_space(shape: str) -> int:
  """Memory space of an array shape's layout ('f32[4]{0:S(5)}' -> 5); 0 (device) when its layout names none."""
  arrays = _ARRAY.findall(shape)
  m = _SPACE.search(arrays[0][2] or "") if arrays else None
  return int(m.group(1)) if m else 0


def _host(shape: str) -> bool:
  return memory_space(shape) in HOST_SPACES


def _parse_instr(line: str, index: int) -> Instr | None:
  m = re.match(r"\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$", line)
  if not m:
    return None
  rest = m.group(3)
  end = _close(rest, 0) if rest.startswith("(") else rest.find(" ")
  if end <= 0:
    return None
  shape, tail = rest[:end], rest[end:].lstrip()
  op = re.match(r"([\w\-]+)\(", tail)
  if not op:
    return None
  close = _close(tail, op.end() - 1)
  operands = [a.split()[-1].lstrip("%") for a in _split_top(tail[op.end():close - 1]) if a.split()]
  return Instr(m.group(2), shape, op.group(1), operands, tail[close:], index, bool(m.group(1)))


def parse_module(text: str) -> Module:
  """Parses an HLO module's text (one instruction per line, as `as_text()` prints it).

  Returns:
    Module; a text without computations gives one with none (entry '').
  """
  comps: dict[str, Computation] = {}
  entry, cur = "", None
  for line in text.splitlines():
    header = re.match(r"(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$", line)
    if header and not line.startswith((" ", "\t", "HloModule")):
      cur = Computation(header.group(2), bool(header.group(1)))
      comps[cur.name] = cur
      entry = cur.name if cur.entry else entry
    elif cur is not None and line.strip() == "}":
      cur = None
    elif cur is not None:
      ins = _parse_instr(line, len(cur.instrs))
      if ins is not None:
        cur.instrs.append(ins)
        cur.by_name[ins.name] = ins
  callers, nested = {}, set()
  for comp in comps.values():
    for ins in comp.instrs:
      for key in ("body", "condition", "calls", "to_apply"):
        callee = ins.called(key)
        if callee and (ins.opcode in ("while", "call") or (ins.opcode == "async-start" and key == "calls")):
          callers[callee] = (comp.name, ins)
        if callee and ins.opcode not in ("while", "call"):
          nested.add(callee)
  head = text.split("\n", 1)[0]
  return Module(comps, entry, "is_scheduled=true" in head, callers, nested)


def entry_layout(text: str) -> str:
  """The `entry_computation_layout={...}` attribute of the module header ('' when absent)."""
  key = "entry_computation_layout={"
  start = text.find(key)
  return "" if start < 0 else text[start + len(key):_close(text, start + len(key) - 1) - 1]


def layout_buffers(text: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
  """Entry parameters and results of a compiled module, each (bytes per device, memory space), from
  `entry_computation_layout`, e.g. '(f32[64,32]{1,0:S(5)}, s32[]{:S(5)})->(...)'; ([], []) when absent."""
  layout = entry_layout(text)
  if "->" not in layout:
    return [], []
  depth, cut = 0, -1
  for i, ch in enumerate(layout):  # the '->' outside every bracket
    depth += {"(": 1, "{": 1, ")": -1, "}": -1}.get(ch, 0)
    if depth == 0 and layout.startswith("->", i):
      cut = i
      break
  parse = lambda s: [(shape_bytes(e), memory_space(e)) for e in tuple_elements(s.strip()) if e]
  return parse(layout[:cut]), parse(layout[cut + 2:])


# ----------------------------------------------------------------------------- transfers


def _moved(kind: str, operand_shapes: Sequence[str], result: str) -> tuple[str, int] | None:
  """(direction, bytes) of a copy / dynamic-slice / dynamic-update-slice between device and host memory, or None."""
  if not operand_shapes:
    return None
  src = operand_shapes[1] if kind == "dynamic-update-slice" and len(operand_shapes) > 1 else operand_shapes[0]
  nbytes = shape_bytes(src if kind == "dynamic-update-slice" else result)
  if _host(result) and not _host(src):
    return "d2h", nbytes
  if _host(src) and not _host(result):
    return "h2d", nbytes
  return None


def _start_kind(mod: Module, ins: Instr) -> tuple[str, list[str], str] | None:
  """(wrapped op, its operand shapes, its result shape) of an asynchronous start, or None."""
  parts = tuple_elements(ins.shape)
  if ins.opcode == "copy-start" and len(parts) >= 2:
    return "copy", [parts[1]], parts[0]
  if ins.opcode in ("dynamic-slice-start", "dynamic-update-slice-start") and len(parts) >= 2:
    return ins.opcode[:-len("-start")], tuple_elements(parts[0]), parts[1]
  if ins.opcode == "fusion-start" and len(parts) >= 2 and (kind := _wrapped_move(mod, ins)) is not None:
    operands = tuple_elements(parts[0])
    if kind == "dynamic-update-slice":  # canonical order: the host buffer, then the (largest) device update
      host = [x for x in operands if _host(x)]
      device = sorted((x for x in operands if not _host(x)), key=shape_bytes, reverse=True)
      operands = host[:1] + device[:1]
    else:
      operands = [x for x in operands if _host(x)][:1] or operands[:1]
    return kind, operands, parts[1]
  if ins.opcode == "async-start" and len(parts) >= 2:
    callee = mod.computations.get(ins.called("calls") or "")
    root = next((i for i in callee.instrs if i.root), None) if callee else None
    if root is not None and root.opcode in _ASYNC_OPS:
      return root.opcode, tuple_elements(parts[0]), parts[1]
  return None


def _wrapped_move(mod: Module, ins: Instr) -> str | None:
  """'dynamic-slice' | 'dynamic-update-slice' when a `fusion-start` wraps one (XLA:GPU's asynchronous form of the
  host-offload slices: `calls=%wrapped_dynamic-slice_computation...`, whose root is the op), else None. The callee's
  root (through copies and bitcasts) decides; where the module text lacks the callee (a trimmed fixture) its name
  does."""
  callee_name = ins.called("calls") or ""
  callee = mod.computations.get(callee_name)
  root = next((i for i in callee.instrs if i.root), None) if callee else None
  for _ in range(8):  # the root may be a copy / bitcast of the slice (measured: `ROOT copy(dynamic-slice)`)
    if root is None or root.opcode not in ("copy", "bitcast", "reshape") or not root.operands:
      break
    root = callee.by_name.get(root.operands[0])
  if root is not None:
    return root.opcode if root.opcode in _ASYNC_OPS[1:] else None
  m = re.match(r"wrapped_(dynamic-slice|dynamic-update-slice)_computation", callee_name)
  return m.group(1) if m else None


def _done_of(comp: Computation, start: Instr) -> Instr | None:
  """The *-done (through any async-update) that completes `start`."""
  name = start.name
  for ins in comp.instrs[start.index + 1:]:
    if ins.operands[:1] == [name]:
      if ins.opcode in ("async-update",):
        name = ins.name
        continue
      if ins.opcode.endswith("-done"):
        return ins
  return None


def times_per_step(mod: Module, comp_name: str) -> int | None:
  """How often per run of the entry computation `comp_name` runs: the product of its loops' known trip counts."""
  n, seen = 1, set()
  while comp_name != mod.entry and comp_name not in seen:
    seen.add(comp_name)
    if comp_name not in mod.callers:
      return None
    comp_name, ins = mod.callers[comp_name]
    if ins.opcode == "while":
      m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', ins.attrs)
      if not m:
        return None
      n *= int(m.group(1))
    elif ins.opcode == "conditional":
      return None
  return n


def _source_param(mod: Module, comp: Computation, name: str) -> int | None:
  """The entry parameter number a value is (a view or a move of), traced back through tuples, loops and moves."""
  path: tuple[int, ...] = ()
  for _ in range(256):
    ins = comp.by_name.get(name)
    if ins is None:
      return None
    if ins.opcode == "parameter":
      if comp.entry:
        return int(ins.operands[0]) if not path and ins.operands else None
      if comp.name not in mod.callers:
        return None
      caller, call = mod.callers[comp.name]
      k = 0 if call.opcode == "while" else int(ins.operands[0]) if ins.operands else 0  # a call: its k-th operand
      comp, name = mod.computations[caller], call.operands[k] if k < len(call.operands) else ""
    elif ins.opcode == "get-tuple-element":
      m = re.search(r"index=(\d+)", ins.attrs)
      if not m or not ins.operands:
        return None
      path, name = path + (int(m.group(1)),), ins.operands[0]
    elif ins.opcode == "tuple" and path and path[-1] < len(ins.operands):
      path, name = path[:-1], ins.operands[path[-1]]
    elif ins.opcode in _PASS and ins.operands:
      name = ins.operands[0]
    else:
      return None
  return None


def _result_index(comp: Computation, name: str) -> int | None:
  """The entry result index a value becomes (through bitcasts/copies into the ROOT tuple), or None."""
  for _ in range(64):
    users = [i for i in comp.instrs if name in i.operands]
    root = next((u for u in users if u.root and u.opcode == "tuple"), None)
    if root is not None:
      return root.operands.index(name)
    nxt = next((u for u in users if u.opcode in ("bitcast", "copy", "reshape")), None)
    if nxt is None:
      return None
    name = nxt.name
  return None


@dataclasses.dataclass(frozen=True)
class _Labels:
  """Names and tensor classes of the entry parameters and results (flat, in entry order), where the caller knows
  them; a parameter without one is named by its op_name metadata."""
  arg_names: Sequence[str] | None = None
  arg_classes: Sequence[str] | None = None
  result_names: Sequence[str] | None = None
  result_classes: Sequence[str] | None = None

  def arg(self, mod: Module, k: int) -> tuple[str, str | None]:
    if self.arg_names is not None and k < len(self.arg_names):
      cls = self.arg_classes[k] if self.arg_classes is not None and k < len(self.arg_classes) else None
      return self.arg_names[k], cls
    entry = mod.computations[mod.entry]
    param = next((i for i in entry.instrs if i.opcode == "parameter" and i.operands == [str(k)]), None)
    return (param.op_name if param is not None and param.op_name else f"parameter {k}"), None

  def result(self, j: int) -> tuple[str, str | None]:
    name = self.result_names[j] if self.result_names is not None and j < len(self.result_names) else f"result {j}"
    cls = self.result_classes[j] if self.result_classes is not None and j < len(self.result_classes) else None
    return name, cls


def _label(mod: Module, comp: Computation, ins: Instr, done: Instr, labels: _Labels) -> tuple[str | None, str | None]:
  """(tensor, class) a transfer moves: the entry parameter its buffer traces back to, else the entry result it
  becomes, else its op_name metadata and no class (an intermediate value, e.g. an offloaded residual)."""
  k = _source_param(mod, comp, ins.operands[0]) if ins.operands else None
  if k is not None:
    return labels.arg(mod, k)
  j = _result_index(comp, done.name) if comp.entry else None
  if j is not None:
    return labels.result(j)
  return ins.op_name or done.op_name, None


def _is_move_fusion(mod: Module, comp: Computation, ins: Instr) -> bool:
  """A `fusion-start` wrapping a host-offload slice, or the `fusion-done` of one (moves, not compute)."""
  if ins.opcode == "fusion-done" and ins.operands:
    ins = comp.by_name.get(ins.operands[0], ins)
  return ins.opcode == "fusion-start" and _wrapped_move(mod, ins) is not None


def _computes(mod: Module, comp: Computation, ins: Instr) -> bool:
  """Whether an instruction in a copy's window is compute (not bookkeeping, a move or a buffer allocation)."""
  return (ins.opcode not in _NOT_COMPUTE and not any(t in ins.attrs for t in _MOVE_TARGETS)
          and not _is_move_fusion(mod, comp, ins))


def _copy_record(mod: Module, comp: Computation, ins: Instr, labels: _Labels) -> dict[str, Any] | None:
  """The transfer record of one instruction (an asynchronous start or a synchronous move), or None."""
  if ins.opcode in _ASYNC_OPS:
    kind, done = ins.opcode, ins
    operand_shapes = [comp.by_name[o].shape if o in comp.by_name else "" for o in ins.operands]
    moved = _moved(kind, operand_shapes, ins.shape)
  else:
    started = _start_kind(mod, ins)
    if started is None:
      return None
    kind, operand_shapes, result = started
    moved, done = _moved(kind, operand_shapes, result), _done_of(comp, ins)
  if moved is None or done is None:
    return None
  tensor, cls = _label(mod, comp, ins, done, labels)
  between = comp.instrs[ins.index + 1:done.index]
  return {"tensor": tensor, "class": cls, "direction": moved[0], "bytes": moved[1], "op": kind,
          "form": "sync" if done is ins else "async", "computation": comp.name, "start": ins.index,
          "done": done.index, "window_ops": len(between),
          "window_compute_ops": sum(_computes(mod, comp, i) for i in between), "window_flops": None,
          "times_per_step": times_per_step(mod, comp.name)}


def transfers(text: "str | Module", arg_names: Sequence[str] | None = None, arg_classes: Sequence[str] | None = None,
              result_names: Sequence[str] | None = None, result_classes: Sequence[str] | None = None
              ) -> dict[str, Any]:
  """Every host<->device transfer of an optimised HLO module (the forms of the module docstring).

  Args:
    text: `Compiled.as_text()` (or its `parse_module`).
    arg_names, arg_classes, result_names, result_classes: per entry parameter / result (flat, entry order, only
      the kept parameters), its tensor name and class; a transfer of a buffer traced to one is named by it.
  Returns:
    {'scheduled': the module says is_scheduled=true, 'copies': [one dict per transfer: tensor, class (None: not
    traced to an entry parameter or result), direction 'h2d' | 'd2h', bytes (per execution of the op, per device),
    op ('copy' | 'dynamic-slice' | 'dynamic-update-slice'), form ('async' | 'sync'), computation, start and done
    (positions in that computation; equal for a synchronous op), window_ops (instructions between them),
    window_compute_ops (of them, not bookkeeping), window_flops (None: not computed), times_per_step (None: a loop
    around it has no known trip count)], in computation and schedule order}.
  """
  mod = text if isinstance(text, Module) else parse_module(text)
  labels = _Labels(arg_names, arg_classes, result_names, result_classes)
  copies = []
  for comp in mod.computations.values():
    if comp.name in mod.nested:
      continue
    for ins in comp.instrs:
      rec = _copy_record(mod, comp, ins, labels)
      if rec is not None:
        copies.append(rec)
  return {"scheduled": mod.scheduled, "copies": copies}




def host_compute(text: "str | Module", arg_names: Sequence[str] | None = None, arg_classes: Sequence[str] | None = None
                 ) -> list[dict[str, Any]]:
  """Instructions that compute in host memory: an array result in a host memory space from an op that is not a
  move, a loop or plumbing (_HOST_OK), or any op marked `_xla_compute_type="host"` (jax.experimental.compute_on).

  Returns:
    [{'name', 'opcode', 'computation', 'bytes' (of the result), 'tensor', 'class' (of the entry parameter its
    operand 0 traces to, else its op_name and None), 'host_marked' (carries _xla_compute_type="host")}], in module
    order.
  """
  mod = text if isinstance(text, Module) else parse_module(text)
  labels = _Labels(arg_names, arg_classes)
  out = []
  for comp in mod.computations.values():
    if comp.name in mod.nested:
      continue
    for ins in comp.instrs:
      marked = '_xla_compute_type="host"' in ins.attrs
      array = not ins.shape.startswith("(")
      if not marked and not (array and _host(ins.shape) and ins.opcode not in _HOST_OK):
        continue
      if any(t in ins.attrs for t in _MOVE_TARGETS) or _is_move_fusion(mod, comp, ins):
        continue
      k = _source_param(mod, comp, ins.operands[0]) if ins.operands else None
      tensor, cls = labels.arg(mod, k) if k is not None else (ins.op_name, None)
      out.append({"name": ins.name, "opcode": ins.opcode, "computation": comp.name,
                  "bytes": shape_bytes(ins.shape), "tensor": tensor, "class": cls, "host_marked": marked})
  return out
