"""Writing report.json, report.md, metrics.jsonl and loss.png."""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

from parity.report.build import Report

__all__ = ["write_all", "write_markdown", "write_plot", "fmt_bytes"]


def fmt_bytes(n) -> str:
  if n is None:
    return "n/a"
  n = float(n)
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n:.1f} TiB"


def _f(v, spec: str = ".3g") -> str:
  if v is None:
    return "n/a"
  if isinstance(v, str):
    return v
  return format(v, spec)


def side_rows(report: Report) -> list[dict]:
  """One row per side with the headline figures (used by the Markdown and the terminal table)."""
  rows = []
  for name, s in report.data["sides"].items():
    summ = s["summary"]
    loss = s["series"]["loss"]
    kinds = summ.get("state_memory_kinds") or {}
    rows.append({
        "side": name, "status": s["status"], "steps": summ.get("steps_completed", len(loss)),
        "first_loss": loss[0] if loss else None, "last_loss": loss[-1] if loss else None,
        "val_loss": (s["series"]["val_loss"] or [None])[-1],
        "tokens_per_s": summ.get("tokens_per_s"), "init_s": summ.get("init_s"), "compile_s": summ.get("compile_s"),
        "peak_rss": summ.get("peak_host_rss_bytes") or s.get("harness_peak_rss_bytes"),
        "peak_device": summ.get("peak_device_bytes"),
        "state_by_kind": summ.get("state_bytes_by_memory_kind") or {},
        "kinds": kinds,
    })
  return rows


def write_markdown(report: Report, path: Path) -> None:
  d = report.data
  v = d["verdict"]
  head = v["message"].split(":", 1)[0] if v["message"].startswith(("ONE SIDE", "INTERRUPTED")) else \
      ("PASS" if v["passed"] else "FAIL")
  out = [f"# parity report: {head}", "", f"**{v['message']}**", "",
         f"- preset `{d['preset']}`, config hash `{d['config_hash']}`, precision `{d['run']['train']['precision']}`",
         f"- data: `{d['data']['source']}` ({d['data']['train_tokens']:,} train / {d['data']['val_tokens']:,} "
         f"held-out tokens, sha256 `{d['data']['sha256'][:16]}`)",
         f"- model: {d['run']['model']['n_layers']} layers, d_model {d['run']['model']['d_model']}, "
         f"{d['run']['model']['n_heads']} heads, seq {d['run']['train']['seq_len']}; "
         f"{d['run']['train']['steps']} steps of {d['run']['train']['micro_batch_size']}×"
         f"{d['run']['train']['grad_accum_steps']} sequences",
         f"- environment: Python {d['environment']['python']}, {d['environment']['platform']}, "
         f"{d['environment']['cpu_count']} CPUs; " + ", ".join(f"{k} {x}" for k, x in d['environment']['versions'].items()),
         f"- wall time {d['timing']['wall_s']:.1f} s; harness overhead ratio {_f(d['timing']['overhead_ratio'], '.3f')}",
         f"- memory plan: {_plan_line(d)}",
         "", "## Sides", "",
         "| side | status | steps | loss first → last | val loss | tokens/s | init s | compile s | peak RSS | peak device | state bytes by memory kind |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in side_rows(report):
    kinds = ", ".join(f"{k}: {fmt_bytes(b)}" for k, b in r["state_by_kind"].items()) or "n/a"
    out.append(f"| {r['side']} | {r['status']} | {r['steps']} | {_f(r['first_loss'], '.4f')} → {_f(r['last_loss'], '.4f')} "
               f"| {_f(r['val_loss'], '.4f')} | {_f(r['tokens_per_s'], ',.0f')} | {_f(r['init_s'], '.1f')} "
               f"| {_f(r['compile_s'], '.2f')} | {fmt_bytes(r['peak_rss'])} | {fmt_bytes(r['peak_device'])} | {kinds} |")
  for name, s in d["sides"].items():
    kinds = s["summary"].get("state_memory_kinds")
    if kinds:
      out.append(f"\n{name}: state memory kinds (read from the live arrays): "
                 + ", ".join(f"`{k}` → `{x}`" for k, x in kinds.items()))
    if s["error"]:
      err = s["error"].strip().splitlines()
      out += ["", f"**{name} {s['status']}**:", "```", *err[-15:], "```"]
  mem = (d.get("memory") or {}).get("predicted_vs_measured") or []
  rows = [r for r in mem if r["predicted"] or r["measured"]]
  if rows:
    out += ["", "## Memory: predicted vs measured", "", d["memory"]["note"] + ".", "",
            "| side | category | memory kind | predicted | measured | measured / predicted |", "|---|---|---|---|---|---|"]
    for r in rows:
      out.append(f"| {r['side']} | {r['category']} | {r['memory_kind']} | {fmt_bytes(r['predicted'])} "
                 f"| {fmt_bytes(r['measured'])} | {_f(r['ratio'], '.3f')} |")
  out += _self_sections(d)
  out += ["", "## Checks", "", "| check | value | tolerance | passed | first failing step | detail |", "|---|---|---|---|---|---|"]
  for c in d["checks"]:
    ok = ("yes" if c["passed"] else "**no**") if c.get("gating", True) else \
        ("yes (reported only)" if c["passed"] else "no (reported only)")
    out.append(f"| {c['name']} | {_f(c['value'])} | {_f(c['tolerance'])} | {ok} "
               f"| {_f(c['first_failing_step'], 'd')} | {c['detail']} |")
  out += ["", "## Tolerances", "", "| precision | metric | atol | rtol | reason |", "|---|---|---|---|---|"]
  for p, tab in d["tolerances"].items():
    for m, t in tab.items():
      out.append(f"| {p} | {m} | {t['atol']:g} | {t['rtol']:g} | {t['reason']} |")
  out += ["", "![loss curves](loss.png)", ""]
  path.write_text("\n".join(out))


def _plan_line(d: dict) -> str:
  """The plan pair (when --plan chose one) and each side's plan settings, one line."""
  plan = d.get("plan") or {}
  j, ds = d["run"]["jax"], d["run"]["deepspeed"]
  extra = f", then {', '.join(plan['overrides'])}" if plan.get("overrides") else ""
  head = f"`{plan['name']}` ({plan.get('chosen_by', 'user')}{extra}); " if plan.get("name") else ""
  jax_kinds = ", ".join(k for k in ("offload_opt_state", "offload_params") if j.get(k)) or "no offload"
  if j.get("scan_layers"):
    offloaded = j.get("offload_opt_state") or j.get("offload_params")
    jax_kinds += ", scan_layers" + (" (update streamed one layer at a time)" if offloaded else "")
  return (f"{head}DeepSpeed ZeRO-{ds['zero_stage']}, offload_optimizer {ds.get('offload_optimizer')}, offload_param "
          f"{ds.get('offload_param')}; JAX {jax_kinds}, remat {j.get('remat')}, zero_stage {j.get('zero_stage')}, "
          f"data_parallel {j.get('data_parallel', 1)}")


def _self_sections(d: dict) -> list[str]:
  """Markdown for the noise envelope, determinism and resume fields of report.json."""
  out = []
  env = d.get("noise_envelope")
  if env:
    r = env["rule"]
    out += ["", "## Noise envelope", "", f"{env['method'][0].upper()}{env['method'][1:]}. Each pair passes when, in "
            f"every window of {r['window']} steps, rms |Δloss| ≤ {r['factor']:g} × rms(envelope of the noisier side) "
            f"+ {r['floor']:g} nats; grad norms the same on relative differences (+ {r['grad_norm_floor']:g}); final "
            f"params per tensor, max |Δ| / distance moved ≤ {r['factor']:g} × the rerun's + {r['params_floor']:g}. "
            f"{r['reason']}", "",
            "| side | rerun status | max |Δloss| | median |Δloss| | max rel. Δgrad norm | params: max |Δ| / moved | steps |",
            "|---|---|---|---|---|---|---|"]
    for side, run in env["runs"].items():
      e = env["sides"].get(side, {})
      diffs = sorted(e.get("abs_loss_diff", []))
      gn = [x for x in e.get("grad_norm_rel_diff", []) if x is not None]
      out.append(f"| {side} | {run['status']} | {_f(diffs[-1] if diffs else None)} "
                 f"| {_f(diffs[len(diffs) // 2] if diffs else None)} | {_f(max(gn) if gn else None)} "
                 f"| {_f(e.get('params_ratio_max'))} | {len(diffs)} |")
  det = d.get("determinism") or {}
  if det:
    out += ["", "## Determinism", "", "| side | deterministic | detail |", "|---|---|---|"]
    for side, x in det.items():
      out.append(f"| {side} | {'yes' if x['deterministic'] else '**no**'} | {x['detail']} "
                 f"(rerun of the first {x['steps_checked']} steps in a new process) |")
  res = d.get("resume") or {}
  if res:
    out += ["", "## Checkpoint / resume", "", "| side | resumed at step | bit-identical to the uninterrupted run | detail |",
            "|---|---|---|---|"]
    for side, x in res.items():
      out.append(f"| {side} | {x['resumed_at_step']} | {'yes' if x['bit_identical'] else '**no**'} | {x['detail']} |")
  return out


def write_plot(report: Report, path: Path) -> bool:
  """Loss curves per side, and |Δloss| of each pair (log scale). Returns False without matplotlib."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  sides = report.data["sides"]
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  for name, s in sides.items():
    ser = s["series"]
    ys = [y if isinstance(y, (int, float)) else float("nan") for y in ser["loss"]]
    ax1.plot(ser["step"], ys, label=f"{name} ({s['status']})", lw=1.2)
    if ser["val_step"]:
      ax1.plot(ser["val_step"], ser["val_loss"], "o", ms=4, label=f"{name} val")
  ax1.set_xlabel("step"); ax1.set_ylabel("loss (nats/token)"); ax1.set_title("training loss"); ax1.legend()
  names = list(sides)
  tol = report.data["tolerances"].get(report.data["run"]["train"]["precision"], {}).get("loss", {}).get("atol")
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      la = dict(zip(sides[a]["series"]["step"], sides[a]["series"]["loss"]))
      lb = dict(zip(sides[b]["series"]["step"], sides[b]["series"]["loss"]))
      st = [k for k in la if k in lb and isinstance(la[k], (int, float)) and isinstance(lb[k], (int, float))]
      ax2.semilogy(st, [max(abs(la[k] - lb[k]), 1e-12) for k in st], lw=1, label=f"{a} vs {b}")
  if tol:
    ax2.axhline(tol, color="k", ls="--", lw=1, label=f"tolerance {tol:g}")
  env = report.data.get("noise_envelope")
  for side, e in ((env or {}).get("sides") or {}).items():
    ax2.semilogy(e["steps"], [max(x, 1e-12) for x in e["abs_loss_diff"]], ls=":", lw=0.8,
                 label=f"noise envelope of {side} (reversed batch order)")
  ax2.set_xlabel("step"); ax2.set_ylabel("|Δ loss|"); ax2.set_title("loss difference per pair"); ax2.legend()
  fig.suptitle(report.message[:120], fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def _write_file(path: Path, write) -> None:
  """Writes `path` through a temporary file and a rename: a failed write (disk full) never leaves a partial file
  under the real name, and the temporary file is removed."""
  tmp = path.with_name(f".{path.name}.tmp")
  try:
    write(tmp)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      tmp.unlink()
    raise


def _metrics(report: Report, path: Path) -> None:
  with open(path, "w") as f:
    for name, s in report.data["sides"].items():
      ser = s["series"]
      for i, step in enumerate(ser["step"]):
        f.write(json.dumps({"side": name, "step": step, **{k: ser[k][i] for k in
                            ("loss", "grad_norm", "lr", "loss_scale", "skipped", "step_time_s", "tokens")}}) + "\n")


def _fallback_dir(report: Report) -> Path:
  rid = ((report.data.get("run_folder") or {}).get("run_id") or "")[:8] or time.strftime("%Y%m%d-%H%M%S")
  return Path(tempfile.gettempdir()) / f"parity-report-{Path(report.run_dir).name}-{rid}"


def write_all(report: Report) -> dict[str, Path]:
  """Writes report.json, report.md, metrics.jsonl (one object per step per side) and loss.png into the run folder.

  Never raises for the file system: each file is written on its own (through a temporary file, so none is left
  half-written); a file that cannot be written (disk full, read-only folder, folder removed) is named in
  `report.data['write_errors']` ([{file, error}]), which makes the exit code 1. When report.json or report.md
  cannot be written in the run folder they are written to a fallback folder under the system's temp dir,
  recorded in `report.data['report_written_to']`; if that fails too, the errors say so.
  Returns:
    name ('json', 'md', 'metrics', 'plot') -> path of each file written.
  """
  rd = Path(report.run_dir)
  errors: list[dict[str, str]] = []
  written: dict[str, Path] = {}

  def attempt(key: str, path: Path, write) -> bool:
    try:
      _write_file(path, write)
    except OSError as exc:
      errors.append({"file": str(path), "error": exc.strerror or str(exc)})
      return False
    written[key] = path
    return True

  attempt("metrics", rd / "metrics.jsonl", lambda p: _metrics(report, p))
  try:
    plotted = write_plot(report, rd / ".loss.png.tmp.png")
    if plotted:
      os.replace(rd / ".loss.png.tmp.png", rd / "loss.png")
      written["plot"] = rd / "loss.png"
  except (OSError, RuntimeError) as exc:  # matplotlib wraps some I/O errors
    with contextlib.suppress(OSError):
      (rd / ".loss.png.tmp.png").unlink()
    errors.append({"file": str(rd / "loss.png"), "error": getattr(exc, "strerror", None) or str(exc)})
  for _ in range(2):  # report.json records the errors of every file written before it, itself included on retry
    report.data["write_errors"] = list(errors)
    json_ok = attempt("json", rd / "report.json", lambda p: p.write_text(json.dumps(report.data, indent=2)))
    md_ok = attempt("md", rd / "report.md", lambda p: write_markdown(report, p))
    if json_ok and md_ok:
      break
    rd = _fallback_dir(report)
    try:
      rd.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
      errors.append({"file": str(rd), "error": exc.strerror or str(exc)})
      break
    report.data["report_written_to"] = str(rd)
  report.data["write_errors"] = errors
  return written
