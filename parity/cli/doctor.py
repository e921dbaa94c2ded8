"""`parity doctor [--quick] [--json FILE] [--build]`: what this machine offers each side (DeepSpeed's ds_report role).

Prints the environment block (harness.doctor.environment_block): versions, the devices each framework sees, JAX's
chip (kind, count, device memory), the memory kinds JAX accepts here, whether DeepSpeed's CPU Adam op is built and
loads, the host <-> device link (the step round trip first, then the standalone copies), on a TPU the runtime's
host-buffer settings and numerics flags, whether this machine allows sockets (DeepSpeed's init, torch.distributed and
jax.distributed need them), CPU/NUMA and GPU topology; `--json FILE` also writes it (the same block every run records
as environment.json). Exit 0 when both frameworks were probed; 1 when a probe failed (the table says which). The
JAX rows and the sockets row are parity.cli.doctor_jax's.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from parity.cli._common import EXIT_FAIL, EXIT_OK, check_json_target, console, float_arg
from parity import installed
from parity.errors import SpecError
from harness import doctor
from parity.cli.doctor_jax import jax_rows, pool_text_tpu, sockets_row

__all__ = ["register", "run", "rows"]


def register(sub) -> None:
  """Adds `doctor` to the subparsers `sub`."""
  p = sub.add_parser("doctor", help="versions, devices, memory kinds, DeepSpeed ops, host link, sockets, topology",
                     description="Reports what this machine offers each side: package versions, the devices JAX "
                                 "and torch see (JAX's chip and its memory), the memory kinds JAX accepts, whether "
                                 "DeepSpeed's CPU Adam op is built and loads, the host <-> device link, a TPU's "
                                 "host-buffer and numerics settings, whether sockets are allowed (DeepSpeed and "
                                 "torch.distributed need them), CPU/NUMA and GPU topology. Each "
                                 "framework is probed in its own process (one not installed is said so, with the "
                                 "extra that installs it). Exit 0: every probe answered; 1: one "
                                 "failed (shown); 2: bad input.")
  p.add_argument("--json", metavar="FILE", help="also write the block as JSON to FILE ('-': stdout instead of the "
                                                "table; default: table only)")
  p.add_argument("--force", action="store_true", help="let --json FILE replace an existing file (default off: an "
                                                      "existing file is refused, exit 2)")
  p.add_argument("--quick", action="store_true", help="skip the bandwidth copies and the GPU topology (the probes "
                                                      "still run; default off)")
  p.add_argument("--build", action="store_true", help="build DeepSpeed's CPU Adam op when it is missing (minutes; "
                                                      "default off: report 'not built')")
  p.add_argument("--timeout", type=float_arg, default=None, help="seconds per probe process (default 180; with --build "
                                                             "1800 for the torch probe)")
  p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
  """Probes, prints, writes --json. Raises SpecError on a bad --timeout or an unwritable --json path (exit 2)."""
  if args.timeout is not None and not args.timeout > 0:
    raise SpecError(f"--timeout {args.timeout:g}: must be a positive number of seconds")
  check_json_target(args.json, getattr(args, "force", False), dash_is_stdout=True)
  out = None if args.json in (None, "-") else Path(args.json)
  frameworks = doctor.probe_frameworks(bandwidth=not args.quick, build=args.build,
                                       timeout_s=args.timeout or doctor.PROBE_TIMEOUT_S)
  block = doctor.environment_block(quick=args.quick, frameworks=frameworks)
  block["quick"] = args.quick
  text = json.dumps(block, indent=1, default=str) + "\n"
  if args.json == "-":
    sys.stdout.write(text)
  else:
    _print(block, console())
  if out is not None:
    try:
      out.write_text(text)
    except OSError as exc:
      raise SpecError(f"--json {args.json}: cannot write it ({exc.strerror}); pick a writable path") from None
    if args.json != "-":
      console().print(f"written to {out}")
  failed = [fw for fw, p in frameworks.items() if "error" in p]
  return EXIT_FAIL if failed else EXIT_OK


def _fmt_bw(bw: dict | None, keys: tuple[str, ...]) -> str:
  if not bw:
    return "not measured (--quick)"
  if "error" in bw:
    return str(bw["error"])
  return ", ".join(f"{k.replace('_', ' ')} {bw[k]}" + (" GB/s" if isinstance(bw[k], (int, float)) else "")
                   for k in keys if k in bw)


def _fmt_threads(choice: dict | None) -> str:
  """harness.env's choice for the workers: 'OMP_NUM_THREADS=2 (parity), ...: reason' ('not recorded': older)."""
  if not choice:
    return "not recorded"
  by = choice.get("set_by", {})
  vals = ", ".join(f"{k}={v} ({by.get(k, '?')})" for k, v in choice.get("values", {}).items()) or "none set"
  return f"{vals}: {choice.get('reason', '')}"


def rows(block: dict) -> list[tuple[str, str]]:
  """The block as (item, value) rows, in the order the table shows them (pure; also what a report can print)."""
  h, pk, fw = block["host"], block["packages"], block["frameworks"]
  jx, tc = fw.get("jax", {}), fw.get("torch", {})
  git = block.get("git") or {}
  out = [("python", f"{h['python']} ({h['python_executable']})"), ("os", h["os"]),
         ("cpu", f"{h['cpu_model']}: {h['cpu_cores_usable']}/{h['cpu_cores_logical']} cores usable, load "
                 f"{h['load_average']}, {(h['mem_total_bytes'] or 0) / 2**30:.1f} GiB"),
         ("worker threads", _fmt_threads(block.get("worker_threads"))),
         ("numa nodes", "; ".join(f"node {n['node']}: cpus {n['cpus']}" for n in h["numa_nodes"] or []) or "not shown"),
         ("git", f"{git.get('commit', '?')[:12]} on {git.get('branch')}" + (" (dirty)" if git.get("dirty") else "")
          if git else "not a checkout"),
         ("packages", ", ".join(f"{k} {v}" for k, v in pk.items() if v)),
         ("cuda driver", block.get("cuda_driver") or "none visible")]
  if jx.get("installed") is False:  # parity.installed.framework_record: not installed, not probed
    out.append(("jax", _not_installed(jx)))
  elif "error" in jx:
    out.append(("jax", f"PROBE FAILED: {jx['error']}"))
  else:
    out += jax_rows(jx)  # chip, memory kinds, host link (the step round trip first), a TPU's settings
  if tc.get("installed") is False:
    out.append(("torch", _not_installed(tc)))
  elif "error" in tc:
    out.append(("torch", f"PROBE FAILED: {tc['error']}"))
  else:
    devs = ", ".join(f"cuda:{d['index']} {d['name']} ({d['memory_bytes'] / 2**30:.0f} GiB, sm {d['capability']})"
                     for d in tc.get("devices", [])) or "none"
    ca = tc.get("cpu_adam") or {}
    out += [("torch", f"{tc.get('torch')} (CUDA build: {tc.get('built_for_cuda') or 'none, CPU-only'}); CUDA "
                      f"available: {tc.get('cuda_available')}; devices: {devs}; CPU {tc.get('cpu_capability')}, "
                      f"{tc.get('threads')} threads"),
            ("deepspeed", f"{tc.get('deepspeed')}, accelerator {tc.get('deepspeed_accelerator')}"
             if "deepspeed" not in tc or tc["deepspeed"] else
             f"not installed: the deepspeed side cannot run here; {installed.install_line('deepspeed')}"),
            ("DeepSpeed CPU Adam op", f"{ca.get('state', 'not checked')}: {ca.get('detail', '')}"),
            ("torch copy bandwidth", _fmt_bw(tc.get("bandwidth"), ("host_to_device_pinned", "device_to_host_pinned",
                                                                   "host_to_device_pageable",
                                                                   "device_to_host_pageable")))]
  out += host_rows(block)
  out.append(sockets_row(block))  # the loopback check (parity.sockets): DeepSpeed, torch.distributed, jax.distributed
  gpus = block.get("gpus")
  out.append(("gpus (nvidia-smi)", "; ".join(gpus["gpus"]) if gpus else "nvidia-smi not installed"))
  if gpus and gpus.get("topology"):
    out.append(("gpu topology", gpus["topology"]))
  return out


def _not_installed(rec: dict) -> str:
  """The row of a framework that is not installed here (parity.installed.framework_record)."""
  sides = rec.get("sides") or []
  own = [f"the {s} side: {installed.install_line(s)}" for s in sides if installed.install_line(s) != rec.get("install")]
  also = f" ({'; '.join(own)})" if own else ""  # a side whose extra is its own (deepspeed)
  return (f"not installed ({rec.get('missing')} missing): the {', '.join(sides)} side(s) cannot run here; "
          f"{rec.get('install')}{also}")


def _gib(n) -> str:
  return "unknown" if n is None else f"{n / 2**30:,.1f} GiB"


def host_rows(block: dict) -> list[tuple[str, str]]:
  """The host-limit rows (harness.doctor.host_limits_block, numerics_flags): XLA's pinned-host pool (default or the
  variable's value; on a jax that runs on the CPU, that it applies to GPU backends), the cgroup memory limit,
  MemAvailable, and the numerics flags set. [] for a block written before they were kept."""
  hl = block.get("host_limits")
  if not isinstance(hl, dict):
    return []
  pool, jx = hl.get("xla_pool") or {}, (block.get("frameworks") or {}).get("jax") or {}
  var = pool.get("variable", "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB")
  if pool.get("source") == "invalid":
    text = f"INVALID: {pool.get('error')}"  # the error names the variable and its value
  else:
    text = (f"{pool.get('gib')} GiB per GPU (" + (f"{var}={pool.get('value')}" if pool.get("source") == "env" else
                                                 f"XLA's default; {var} not set") + ")")
  backend = jx.get("backend")
  if backend == "tpu":  # the variable is XLA's GPU client's; a TPU's pinned_host arrays are plain host memory
    text = (text + "; " if pool.get("source") == "invalid" else "") + pool_text_tpu(var, jx)
  else:
    on_gpu = backend in ("gpu", "cuda")
    text += ("; jax is not installed here: the pool applies to JAX's GPU backends only" if backend is None
             else f"; jax here runs on {backend}: the pool applies to GPU backends only" if not on_gpu
             else "; applies to this jax's GPU devices, one pool each")
  cg = hl.get("cgroup") or None
  cg_text = ("no cgroup memory controller readable" if cg is None else
             f"cgroup v{cg.get('version')} {cg.get('path')}: " + ("no limit" if cg.get("limit_bytes") is None else
             f"limit {_gib(cg.get('limit_bytes'))}, working set {_gib(cg.get('usage_bytes'))} less inactive file "
             f"{_gib(cg.get('inactive_file_bytes'))}, headroom {_gib(hl.get('cgroup_headroom_bytes'))}"))
  mem = (f"MemAvailable {_gib(hl.get('mem_available_bytes'))}; {cg_text}; a run may use "
         f"{_gib(hl.get('available_bytes'))}")
  out = [("jax pinned-host pool", text), ("host memory", mem)]
  nf = (block.get("numerics_flags") or {}).get("values") or {}
  set_ = [f"{k}={v}" for k, v in nf.items() if v is not None]
  out.append(("numerics flags", (", ".join(set_) or f"none set ({', '.join(nf)}: the frameworks' defaults)")
              + ("; the TPU's own: the 'tpu numerics flags' row" if backend == "tpu" else "")))
  return out


def _print(block: dict, con) -> None:
  from rich.markup import escape  # rich: loaded when something is printed
  from rich.table import Table  # rich: loaded when a table is printed
  t = Table(title="parity doctor", show_lines=False)
  t.add_column("item", style="bold")
  t.add_column("value", overflow="fold")
  for k, v in rows(block):
    t.add_row(escape(k), escape(v), style="red" if v.startswith("PROBE FAILED") else None)
  con.print(t)
