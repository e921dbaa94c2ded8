"""placement.json from the compiled train step: where the executable keeps every tensor class, the copies it plans,
and where that differs from the JaxPlan (docs/plans.md "Placement from the compiled step").

    placement_record(trainer, plan) -> dict        the record (schema parity.protocol.placement.PLACEMENT_SCHEMA)

Read from the AOT-compiled step (`Trainer.compile`), never from the live arrays:
  classes         per tensor class and role (params, opt_state, batch and the fp16 overflow_factor as arguments;
                  params, opt_state and metrics as results) the buffers and bytes per device in host vs device
                  memory, from the compiled `entry_computation_layout` (host memory spaces S(5)/S(6):
                  jax_impl.hlo_transfers.HOST_SPACES); arguments jit pruned are counted under `pruned`
  activations     the remat policy's residuals: the step's jaxpr device_puts to host (CPU drops them from the HLO),
                  those the policy adds over the same step with remat='none', and on GPU the host-bound copies of
                  intermediate values in the HLO
  memory_analysis CompiledMemoryStats split into device and host fields
  transfers       the optimised HLO's host<->device copies (jax_impl.hlo_transfers.transfers); none on CPU
  mismatches      a class the plan puts in host memory that the step keeps in device memory, and the reverse (a
                  class the plan keeps on the device that the step takes from, or computes in, host memory)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jaxlib

from parity.protocol.memory_figures import compiled_memory
from parity.protocol.placement import PLACEMENT_SCHEMA, host_compute_mismatch, split_host_compute
from parity.sizing.memory_jax import opt_split
from parity.spec import JaxPlan, ModelSpec, RunSpec, to_dict

from jax_impl import hlo_transfers as hlo
from jax_impl import remat as remat_lib
from jax_impl.step import make_train_step

__all__ = ["placement_record", "leaf_labels", "class_rows", "activation_row", "memory_split", "plan_mismatches",
           "ARG_CLASSES", "RESULT_CLASSES"]

ARG_CLASSES = ("params", "opt_state", "batch", "overflow_factor")
RESULT_CLASSES = ("params", "opt_state", "metrics")
_FLAG = {"params": "offload_params", "opt_state": "offload_opt_state"}


def _label(path: Sequence[Any], result: bool) -> tuple[str, str]:
  """(tensor name, class) of one leaf of the step's arguments ((state, batch, [overflow_factor])) or results
  ((state, metrics)), from its pytree path."""
  keys = [str(getattr(k, "idx", getattr(k, "key", getattr(k, "name", k)))) for k in path]
  keys = keys if result else keys[1:]  # arguments: (positional args, kwargs) first
  top, rest = keys[0], keys[1:]
  if top == "0":  # the TrainState: its field is the class
    return "/".join(rest), rest[0]
  cls = "metrics" if result else ("batch" if top == "1" else "overflow_factor")
  return "/".join([cls] + rest), cls


def leaf_labels(trainer) -> tuple[list[str], list[str], list[str], list[str]]:
  """(argument names, argument classes, result names, result classes) of the compiled step, flat, in entry order
  before jit's pruning: e.g. 'params/h_0/attn/qkv/kernel' / 'params', 'opt_state/1/0/mu/wte/embedding' / 'opt_state',
  'batch' / 'batch', 'metrics/loss' / 'metrics'."""
  args = [_label(p, False) for p, _ in jax.tree_util.tree_flatten_with_path(trainer.step_fn.args_info)[0]]
  outs = [_label(p, True) for p, _ in jax.tree_util.tree_flatten_with_path(trainer.step_fn.out_info)[0]]
  return [a[0] for a in args], [a[1] for a in args], [o[0] for o in outs], [o[1] for o in outs]


def _expected(cls: str, plan: JaxPlan, model: ModelSpec | None = None) -> str:
  """Where the plan keeps a class: 'host', 'device', or for opt_state partly offloaded (jax.offload_opt_ratio < 1,
  parity.sizing.memory_jax.opt_split, given the model) 'mixed'."""
  if cls == "opt_state" and model is not None and opt_split(RunSpec(model=model, jax=plan)).partial:
    return "mixed"
  return "host" if cls in _FLAG and getattr(plan, _FLAG[cls]) else "device"


def _space(buffers: Sequence[tuple[int, int]]) -> str | None:
  host = sum(space in hlo.HOST_SPACES for _, space in buffers)
  return None if not buffers else "host" if host == len(buffers) else "device" if host == 0 else "mixed"


def class_rows(classes: Sequence[str], buffers: Sequence[tuple[int, int] | None], role: str, plan: JaxPlan,
               order: Sequence[str], model: ModelSpec | None = None) -> list[dict[str, Any]]:
  """One row per tensor class of one role ('argument' | 'result').

  Args:
    classes: the class of every flat argument/result (`leaf_labels`).
    buffers: per flat position its entry buffer (bytes per device, memory space), None where jit pruned it.
    order: the classes to give rows, in this order (a class with no leaf gets none).
    model: the run's model (which moments a partial optimizer offload puts on the host: `_expected`).
  Returns:
    [{class, role, buffers, host_buffers, bytes, host_bytes (per device), memory_space ('device' | 'host' | 'mixed',
    None with no buffer), expected ('device' | 'host' | 'mixed'), pruned (leaves jit dropped from the entry)}].
  """
  rows = []
  for cls in (c for c in order if c in classes):
    mine = [b for c, b in zip(classes, buffers) if c == cls]
    kept = [b for b in mine if b is not None]
    host = [b for b in kept if b[1] in hlo.HOST_SPACES]
    rows.append({"class": cls, "role": role, "buffers": len(kept), "host_buffers": len(host),
                 "bytes": sum(b for b, _ in kept), "host_bytes": sum(b for b, _ in host), "memory_space": _space(kept),
                 "expected": _expected(cls, plan, model), "pruned": len(mine) - len(kept),
                 "host_memory_spaces": sorted({s for _, s in host})})
  return rows


def _expand(kept: list[int] | None, args: list[tuple[int, int]], n: int) -> list[tuple[int, int] | None]:
  """Entry arguments placed at their flat positions (None where jit pruned one); all of them when `kept` is None."""
  if kept is None:
    return list(args) + [None] * (n - len(args))
  full: list[tuple[int, int] | None] = [None] * n
  for i, buf in zip(sorted(kept), args):
    if i < n:
      full[i] = buf
  return full


def _baseline_to_host(trainer) -> int:
  """device_puts to host in the jaxpr of the same step with remat='none' (what is not the remat policy's)."""
  run = trainer.run
  none = dataclasses.replace(run, jax=dataclasses.replace(run.jax, remat="none"))
  step = make_train_step(none, trainer.tx, trainer.schedule, trainer.placement, trainer.shardings)
  infos, _ = trainer.step_fn.args_info
  shardings, _ = trainer.step_fn.input_shardings
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), infos, shardings)
  return remat_lib.device_puts_in_jaxpr(str(jax.jit(step).trace(*abstract).jaxpr))["to_host"]


def activation_row(trainer, plan: JaxPlan, copies: Sequence[dict[str, Any]], known: bool) -> dict[str, Any]:
  """The activations entry: the plan's policy and what it expects ('host' for the offload policies, 'recomputed'
  for full, else 'device'), the step's jaxpr device_puts (jaxpr_to_host / jaxpr_to_device), jaxpr_to_host_by_policy
  (those to host beyond the same step's with remat='none'; the per-layer state moves of scan_layers are not the
  policy's), and compiled_to_host_copies (host-bound HLO copies of values not traced to a state buffer; None where
  the HLO carries no copies: CPU)."""
  puts = remat_lib.device_puts_in_jaxpr(trainer.jaxpr_text)
  policy = trainer.run.jax.remat
  by_policy = puts["to_host"] - (_baseline_to_host(trainer) if policy != "none" else puts["to_host"])
  expected = ("host" if plan.remat in remat_lib.OFFLOAD_POLICIES else "recomputed" if plan.remat == "full"
              else "device")
  to_host = sum(1 for c in copies if c["direction"] == "d2h" and c["class"] is None)
  return {"policy": plan.remat, "compiled_policy": policy, "expected": expected, "jaxpr_to_host": puts["to_host"],
          "jaxpr_to_device": puts["to_device"], "jaxpr_to_host_by_policy": by_policy,
          "compiled_to_host_copies": to_host if known else None}


def memory_split(stats: dict[str, int], args: Sequence[tuple[int, int]], backend: str) -> dict[str, Any]:
  """`Trainer.memory_analysis` (CompiledMemoryStats fields, bytes) as {'device': {...}, 'host': {...}, 'note'}; the
  device's 'peak_bytes' is XLA's peak less the step's host buffers (never host memory), 'xla_peak_bytes' XLA's own.

  The note says what the backend counts, from the numbers: on CPU whether argument_bytes equals the bytes of every
  entry argument, host-resident ones included (`args`: the entry buffers, (bytes, memory space)).
  """
  g = lambda k: int(stats.get(k, 0))
  device = {"argument_bytes": g("argument_size_in_bytes"), "output_bytes": g("output_size_in_bytes"),
            "temp_bytes": g("temp_size_in_bytes"), "alias_bytes": g("alias_size_in_bytes"),
            "generated_code_bytes": g("generated_code_size_in_bytes"),
            # XLA's peak counts the step's host-resident buffers: the device's is that peak less them
            # (parity.protocol.memory_figures.compiled_memory); XLA's own beside it
            "peak_bytes": compiled_memory(stats)["device"] or 0, "xla_peak_bytes": g("peak_memory_in_bytes")}
  host = {"argument_bytes": g("host_argument_size_in_bytes"), "output_bytes": g("host_output_size_in_bytes"),
          "temp_bytes": g("host_temp_size_in_bytes"), "alias_bytes": g("host_alias_size_in_bytes"),
          "generated_code_bytes": g("host_generated_code_size_in_bytes")}
  total = sum(b for b, _ in args)
  on_host = sum(b for b, s in args if s in hlo.HOST_SPACES)
  if not stats:
    note = "the executable gave no memory_analysis()"
  elif backend == "cpu":
    same = "equal to" if device["argument_bytes"] == total else f"not equal to ({device['argument_bytes']} vs)"
    note = (f"XLA:CPU: device argument_bytes is {same} the {total} bytes of all entry arguments, the {on_host} "
            f"bytes in host memory spaces included; every host_* field is {'0' if not any(host.values()) else 'set'}"
            " (one memory: host and device are the same RAM)")
  else:
    note = (f"{backend}: the fields as XLA reports them; {on_host} of the {total} entry-argument bytes are in host "
            "memory spaces (whether device argument_bytes leaves them out is not checked here)")
  return {"device": device, "host": host, "note": note}


def _cpu_why_not(mod: hlo.Module, entry_host: int) -> str:
  """Why a CPU executable shows no transfers, with what its module holds (counted per module)."""
  host_instrs = sum(hlo.memory_space(e) in hlo.HOST_SPACES for c in mod.computations.values() for i in c.instrs
                    for e in hlo.tuple_elements(i.shape))
  return (f"CPU backend: XLA:CPU keeps host memory spaces on the entry layout only ({entry_host} entry buffers in "
          f"S(5)/S(6); {host_instrs} instruction results of the compiled HLO carry one) and lowers every in-jit "
          "memory move to nothing, so no host<->device copy can be sized, named or placed in the schedule; "
          "bytes_per_step counts the entry layout's host buffers instead")


def _per_step(copies: Sequence[dict[str, Any]], direction: str) -> int | None:
  """Bytes one step moves in `direction` by the HLO's copies (each times its loops' trip counts); None when a loop
  around one has no known trip count."""
  moved = [(c["bytes"], c["times_per_step"]) for c in copies if c["direction"] == direction]
  return None if any(t is None for _, t in moved) else sum(b * t for b, t in moved)


def _bytes_per_step(copies, known: bool, args, results) -> dict[str, Any]:
  """h2d / d2h bytes per step per device: the HLO's copies where it carries them (GPU), else the entry layout's host
  arguments (read in) and results (written back), with both figures and the source of the first."""
  entry_h2d = sum(b for b, s in args if s in hlo.HOST_SPACES)
  entry_d2h = sum(b for b, s in results if s in hlo.HOST_SPACES)
  if known:
    return {"h2d": _per_step(copies, "h2d"), "d2h": _per_step(copies, "d2h"), "source": "compiled HLO copies",
            "entry_h2d": entry_h2d, "entry_d2h": entry_d2h}
  return {"h2d": entry_h2d, "d2h": entry_d2h, "source": "entry layout host buffers", "entry_h2d": entry_h2d,
          "entry_d2h": entry_d2h}


def _row_mismatch(row: dict[str, Any], plan: JaxPlan) -> dict[str, Any] | None:
  """The mismatch of one class row, or None: the plan's memory space (host/device) is not where the step keeps it."""
  space, want = row["memory_space"], row["expected"]
  if space is None or space == want:
    return None
  n, host = row["buffers"], row["host_buffers"]
  verb = "takes" if row["role"] == "argument" else "returns"
  if want == "mixed":
    return {"class": row["class"], "role": row["role"], "expected": want, "compiled": space,
            "buffers": {"mismatched": n, "of": n},
            "detail": f"plan jax.offload_opt_ratio={plan.offload_opt_ratio:g} puts part of {row['class']} in "
                      f"{plan.host_memory_kind} and the rest on the device; the compiled step {verb} all {n} buffers "
                      f"in {space} memory"}
  wrong = n - host if want == "host" else host
  if want == "host":
    why = f"plan jax.{_FLAG[row['class']]} puts {row['class']} in {plan.host_memory_kind}"
  elif row["class"] in _FLAG:
    why = f"plan jax.{_FLAG[row['class']]}=false keeps {row['class']} in device memory"
  else:
    why = f"the step keeps its {row['class']} in device memory (jax_impl.offload.Placement)"
  where = "device" if want == "host" else "host"
  return {"class": row["class"], "role": row["role"], "expected": want, "compiled": space,
          "buffers": {"mismatched": wrong, "of": n},
          "detail": f"{why}; the compiled step {verb} {wrong} of {n} buffers in {where} memory"}


def plan_mismatches(rows, activations, host_ops, plan: JaxPlan, backend: str) -> list[dict[str, Any]]:
  """Every place the compiled step contradicts the plan: class rows (`_row_mismatch`), activations (an offload
  policy whose residuals never go to host memory, by the jaxpr and, where the HLO carries copies, by it; or residual
  moves to host under a policy that keeps them on the device) and host compute (an op computing in host memory,
  where the plan moves offloaded state to the device to compute)."""
  out = [m for m in (_row_mismatch(r, plan) for r in rows) if m is not None]
  a = activations
  if a["expected"] == "host" and (a["jaxpr_to_host_by_policy"] <= 0 or a["compiled_to_host_copies"] == 0):
    seen = (f"{a['jaxpr_to_host_by_policy']} device_puts to host beyond the remat='none' step's"
            + (f", {a['compiled_to_host_copies']} host-bound copies in the HLO" if backend != "cpu" else ""))
    out.append({"class": "activations", "role": "residuals", "expected": "host", "compiled": "device",
                "detail": f"plan jax.remat={plan.remat} puts the saved residuals in {plan.host_memory_kind}; the "
                          f"compiled step moves none there ({seen})"})
  elif a["expected"] != "host" and a["jaxpr_to_host_by_policy"] > 0:
    out.append({"class": "activations", "role": "residuals", "expected": a["expected"], "compiled": "host",
                "detail": f"plan jax.remat={plan.remat} keeps residuals off the host; the step's jaxpr moves "
                          f"{a['jaxpr_to_host_by_policy']} to host beyond the remat='none' step's"})
  bulk, _, _ = split_host_compute(host_ops)
  out.extend(host_compute_mismatch(op) for op in bulk)
  return out


def placement_record(trainer, plan: JaxPlan | None = None, *, side: str = "jax", run_id: str | None = None
                     ) -> dict[str, Any]:
  """The placement.json record of a compiled Trainer (after `Trainer.compile`).

  Args:
    trainer: jax_impl.step.Trainer, compiled.
    plan: the plan the step is checked against (the request's JaxPlan; default trainer.run.jax). The planted
      mismatch (jax_impl.step.PLACEMENT_PLANT) compiles another plan than this one.
    side, run_id: recorded as given (collect trusts only this run's file).
  Returns:
    The record of docs/plans.md "Placement from the compiled step" (JSON-ready).
  """
  plan = plan or trainer.run.jax
  backend = jax.default_backend()
  text = trainer.compiled_text
  mod = hlo.parse_module(text)
  arg_names, arg_cls, res_names, res_cls = leaf_labels(trainer)
  args, results = hlo.layout_buffers(text)
  kept = trainer.kept_args()
  full_args = _expand(kept, args, len(arg_cls))
  model = trainer.run.model
  rows = (class_rows(arg_cls, full_args, "argument", plan, ARG_CLASSES, model)
          + class_rows(res_cls, list(results) + [None] * (len(res_cls) - len(results)), "result", plan,
                       RESULT_CLASSES, model))
  kept_idx = sorted(kept) if kept is not None else list(range(len(arg_cls)))
  labels = dict(arg_names=[arg_names[i] for i in kept_idx], arg_classes=[arg_cls[i] for i in kept_idx],
                result_names=res_names, result_classes=res_cls)
  found = hlo.transfers(mod, **labels)
  host_ops = hlo.host_compute(mod, labels["arg_names"], labels["arg_classes"])
  known = backend != "cpu" or bool(found["copies"])
  acts = activation_row(trainer, plan, found["copies"], known)
  return {
      "schema": PLACEMENT_SCHEMA, "side": side, "run_id": run_id, "backend": backend,
      "source": "compiled train step", "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__},
      "jax_remat3": getattr(jax.config, "jax_remat3", None), "plan": to_dict(plan), "classes": rows,
      "activations": acts, "memory_analysis": memory_split(trainer.memory_analysis, args, backend),
      "bytes_per_step": _bytes_per_step(found["copies"], known, args, results),
      "transfers": {"known": known, "why_not": None if known else _cpu_why_not(mod, sum(
          s in hlo.HOST_SPACES for _, s in args + results)), "scheduled": found["scheduled"],
          "copies": found["copies"], "host_compute": host_ops},
      "mismatches": plan_mismatches(rows, acts, host_ops, plan, backend)}
