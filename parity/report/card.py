"""card.json: the short verification card of a run, meant to be committed next to a migration PR: what was compared,
the versions, the command, the key figures and the verdict (schema 'parity.card/1', below)."""
from __future__ import annotations

import statistics
from typing import Any

from parity.report import content as C

__all__ = ["CARD_SCHEMA", "make_card"]

CARD_SCHEMA = "parity.card/1"
"""card.json fields:
  schema, created_utc, verdict {passed, sentence, message}
  compared   {preset, sides, precision, steps, plan, deepspeed_config (the file, or null), config_hash, data_sha256,
              model {n_layers, d_model, n_heads, seq_len}}
  command, git {rev, dirty} | null, versions {package: version}, backend {side: cpu|gpu|...}
  key_figures {max_abs_dloss {pair: nats}, first_failing_step {check: step}, tokens_per_s {side},
               step_time_s_median {side}, peak_host_rss_bytes {side}, peak_device_bytes {side},
               state_bytes_by_memory_kind {side: {kind: bytes}}, wall_s}
               final_loss {side: nats}, loss_at_steps {side: {step: nats}} (a few steps spread over the run, so a
               card baseline catches a changed lr or schedule), load {side: highest 1-minute load around it}}
  machine    {host, cpu_model, cpu_count, machine, platform}: where the run was written (the gate's step-time rule)
  files      the report files beside it (report.html, report.md, report.json)"""

LOSS_POINTS = 5
"""Steps of the loss curve a card keeps per side (first, last and evenly between): enough to see a changed learning
rate or schedule move the curve, small enough to read in a PR."""


def _loss_points(s: dict) -> tuple[float | None, dict[str, float]]:
  """(final loss, {step: loss} at LOSS_POINTS steps spread over the run) of a side's series; None/{} when empty."""
  ser = s.get("series") or {}
  pts = [(st, v) for st, v in zip(ser.get("step") or [], ser.get("loss") or [])
         if isinstance(v, (int, float)) and v == v]
  if not pts:
    return None, {}
  idx = sorted({round(i * (len(pts) - 1) / max(LOSS_POINTS - 1, 1)) for i in range(LOSS_POINTS)})
  return pts[-1][1], {str(pts[i][0]): pts[i][1] for i in idx}


def _peak_load(s: dict) -> float | None:
  vals = [x[0] for x in (s.get("load") or {}).values() if isinstance(x, list) and x and isinstance(x[0], (int, float))]
  return max(vals) if vals else None


def make_card(d: dict) -> dict[str, Any]:
  """The card of report.json data `d` (JSON-ready)."""
  t, m = d["run"]["train"], d["run"]["model"]
  kind, sentence, _ = C.verdict_parts(d)
  env = d.get("environment") or {}
  sides = d["sides"]
  loss = {C.pair_label(c["sides"]): c["value"] for c in d["checks"] if c["metric"] == "loss"}
  times = {}
  for n, s in sides.items():
    ts = C.step_times(s)
    times[n] = statistics.median(ts) if ts else None
  return {
      "schema": CARD_SCHEMA, "created_utc": d.get("created_utc"),
      "verdict": {"passed": d["verdict"]["passed"], "sentence": sentence, "message": d["verdict"]["message"]},
      "compared": {"preset": d.get("preset"), "sides": list(sides), "precision": t["precision"], "steps": t["steps"],
                   "plan": (d.get("plan") or {}).get("name"),
                   "deepspeed_config": (d.get("migration") or {}).get("source"),
                   "config_hash": d.get("config_hash"), "data_sha256": (d.get("data") or {}).get("sha256"),
                   "model": {"n_layers": m.get("n_layers"), "d_model": m.get("d_model"), "n_heads": m.get("n_heads"),
                             "seq_len": t.get("seq_len")}},
      "command": (d.get("run_folder") or {}).get("command"), "git": env.get("git"),
      "versions": env.get("versions") or {}, "backend": {n: C.backend(s) for n, s in sides.items()},
      "key_figures": {
          "max_abs_dloss": loss,
          "first_failing_step": {c["name"]: c["first_failing_step"] for c in d["checks"]
                                 if not c["passed"] and c.get("gating", True)},
          "tokens_per_s": {n: (s.get("summary") or {}).get("tokens_per_s") for n, s in sides.items()},
          "step_time_s_median": times,
          "peak_host_rss_bytes": {n: (s.get("summary") or {}).get("peak_host_rss_bytes")
                                  or s.get("harness_peak_rss_bytes") for n, s in sides.items()},
          "peak_device_bytes": {n: (s.get("summary") or {}).get("peak_device_bytes") for n, s in sides.items()},
          "state_bytes_by_memory_kind": {n: (s.get("summary") or {}).get("state_bytes_by_memory_kind")
                                         for n, s in sides.items()},
          "wall_s": (d.get("timing") or {}).get("wall_s"),
          "final_loss": {n: _loss_points(s)[0] for n, s in sides.items()},
          "loss_at_steps": {n: _loss_points(s)[1] for n, s in sides.items()},
          "load": {n: _peak_load(s) for n, s in sides.items()}},
      "machine": {k: env.get(src) for k, src in (("host", "hostname"), ("cpu_model", "cpu_model"),
                                                  ("cpu_count", "cpu_count"), ("machine", "machine"),
                                                  ("platform", "platform")) if env.get(src) not in (None, "")},
      "files": ["report.html", "report.md", "report.json"],
  }
