"""card.json: the short verification card of a run, meant to be committed next to a migration PR: what was compared,
the versions, the command, the key figures and the verdict (schema 'parity.card/1', below)."""
from __future__ import annotations

from typing import Any

from parity.protocol.layout import step_time_median
from parity.report import cells, headline, side_table
from parity.report.read import peak_load
from parity.report.join_view import join_card
from parity.report.semantics_view import semantics_card_block
from parity.report.run_record import RunRecord, SideRecord
from parity.report.runconfig import final_digests, gate_config, proven_deterministic, thread_settings

__all__ = ["CARD_SCHEMA", "make_card", "card_inputs", "LOSS_POINTS"]

CARD_SCHEMA = "parity.card/1"
"""card.json fields:
  schema, created_utc, verdict {passed, sentence, message}
  compared   {title (parity.report.headline.run_title), preset (the training settings), checkpoint ({path,
              architecture} of an --hf-model run, or null), sides, precision, steps, plan, deepspeed_config (the
              file, as typed, or null), deepspeed_config_sha256 (of that file as read, or null),
              deepspeed_config_files {given, resolved: {file (in the run folder), sha256}}, tokens (which tokens ran),
              checkpoint_tokenizer_used (false with a checkpoint), perturbations [{side, key, value, applied}],
              config_hash, data_sha256, data_card (padded/packed runs only: parity.dataset.card.data_card of the
              examples, with the run's layout and loss normalization in report.json 'data'), model {name
              (parity.report.headline.model_label: the checkpoint, its family and parameter count), n_layers, d_model,
              n_heads, seq_len},
              config {dotted key: value}: what the regression gate's configuration gate compares
              (parity.report.runconfig.gate_config: the resolved spec, nproc, perturbations, input digests)}
  command, git {rev, dirty} | null, versions {package: version}, backend {side: cpu|gpu|...}
  key_figures {max_abs_dloss {pair: nats}, first_failing_step {check: step}, tokens_per_s {side},
               loss_tokens_per_s {side} (loss-carrying targets/s, parity.protocol.layout.loss_tokens_per_s; equal to
               tokens_per_s on a stream run, where every target carries the loss),
               step_time_s_median {side}, peak_host_rss_bytes {side}, peak_device_bytes {side},
               state_bytes_by_memory_kind {side: {kind: bytes}}, wall_s}
               final_loss {side: nats}, loss_at_steps {side: {step: nats}} (a few steps spread over the run, so a
               card baseline catches a changed lr or schedule), load {side: highest 1-minute load around it},
               final_params_digest {side: parity.report.runconfig.tensor_digest of final.safetensors}}
  semantics  {agree, differences [{item, values {side: value}}], items {side: {item: value}}} (the sides'
             semantics cards, parity.report.semantics_view; null when no side wrote one)
  determinism {side: steps}: the sides whose determinism rerun was bit-identical, and over how many steps (the gate
              holds a rerun on the same machine, versions and configuration bit for bit against such a side)
  machine    {host, cpu_model, cpu_count, machine, platform}: where the run was written (the gate's step-time rule)
  threads    {side: {torch_num_threads, OMP_NUM_THREADS, ...}}: each side's thread settings
             (parity.report.runconfig.thread_settings; they set torch's summation order, so the gate's bitwise band)
  join       a joined folder's (`parity join`) folders {label, path, run_id, request_sha256}, each side's {folder,
             host, device, backend} and the shared inputs' sha256 (parity.report.join_view.join_card); null otherwise
  files      the report files beside it (report.html, report.md, report.json)"""

LOSS_POINTS = 5
"""Steps of the loss curve a card keeps per side (first, last and evenly between): enough to see a changed learning
rate or schedule move the curve, small enough to read in a PR."""


def _loss_points(s: SideRecord) -> tuple[float | None, dict[str, float]]:
  """(final loss, {step: loss} at LOSS_POINTS steps spread over the run) of a side's series; None/{} when empty."""
  pts = [(st, v) for st, v in zip(s.values("step"), s.values("loss")) if isinstance(v, (int, float)) and v == v]
  if not pts:
    return None, {}
  idx = sorted({round(i * (len(pts) - 1) / max(LOSS_POINTS - 1, 1)) for i in range(LOSS_POINTS)})
  return pts[-1][1], {str(pts[i][0]): pts[i][1] for i in idx}


def card_inputs(rec: RunRecord) -> dict[str, Any]:
  """The card's record of the run's own inputs: the DeepSpeed config copies in the run folder with their sha256
  (report.json deepspeed_files), the tokens and checkpoint (inputs), the perturbations and whether each took."""
  files, inp = rec.deepspeed_files, rec.inputs
  return {"deepspeed_config_sha256": (files.get("given") or {}).get("sha256"),
          "deepspeed_config_files": {k: {"file": v["file"], "sha256": v["sha256"]} for k, v in files.items() if v},
          "tokens": inp.get("tokenizer"),
          "checkpoint_tokenizer_used": inp.get("checkpoint_tokenizer_used"),
          "perturbations": [{"side": p["side"], "key": p["key"], "value": p["value"], "applied": p.get("applied")}
                            for p in rec.perturbations]}


def _key_figures(rec: RunRecord, run_dir) -> dict[str, Any]:
  """card.json key_figures (CARD_SCHEMA) of the run."""
  sides = rec.sides
  loss = {cells.pair_label(c.sides): c.value for c in rec.checks if c.metric == "loss"}
  return {
      "max_abs_dloss": loss,
      "first_failing_step": {c.name: c.first_failing_step for c in rec.checks if not c.passed and c.gating},
      "tokens_per_s": {n: side_table.side_tokens_per_s(rec, s) for n, s in sides.items()},
      "loss_tokens_per_s": {n: side_table.side_loss_tokens_per_s(rec, s) if side_table.step_loss_tokens(rec)
                            else side_table.side_tokens_per_s(rec, s) for n, s in sides.items()},
      "step_time_s_median": {n: step_time_median(s.values("step_time_s")) for n, s in sides.items()},  # the one rule
      "peak_host_rss_bytes": {n: s.peak_rss_bytes for n, s in sides.items()},
      "peak_device_bytes": {n: s.summary.get("peak_device_bytes") for n, s in sides.items()},
      "state_bytes_by_memory_kind": {n: s.summary.get("state_bytes_by_memory_kind") for n, s in sides.items()},
      "wall_s": rec.timing.get("wall_s"),
      "final_loss": {n: _loss_points(s)[0] for n, s in sides.items()},
      "loss_at_steps": {n: _loss_points(s)[1] for n, s in sides.items()},
      "load": {n: peak_load(s.load) for n, s in sides.items()},
      "final_params_digest": final_digests(rec, run_dir)}


def make_card(rec: RunRecord, run_dir=None) -> dict[str, Any]:
  """The card of a run (JSON-ready); run_dir: the run folder (launch.json, request.json: nproc and perturbations for
  compared.config), default report.json's run_dir (where it was written)."""
  t, m = rec.run.train, rec.run.model
  run_dir = run_dir if run_dir is not None else rec.run_dir
  kind, sentence, _ = headline.verdict_parts(rec)
  env = rec.environment
  return {
      "schema": CARD_SCHEMA, "created_utc": rec.created_utc,
      "verdict": {"passed": rec.verdict.passed, "sentence": sentence, "message": rec.verdict.message},
      "compared": {"title": headline.run_title(rec), "preset": rec.preset, "checkpoint": rec.checkpoint,
                   "sides": list(rec.sides), "precision": t["precision"], "steps": t["steps"],
                   "plan": rec.plan.name if rec.plan else None,
                   "deepspeed_config": rec.migration.source if rec.migration else None,
                   **card_inputs(rec),
                   "config_hash": rec.config_hash, "data_sha256": rec.data.sha256,
                   **({"data_card": rec.data.card} if rec.data.card else {}),
                   "model": {"name": headline.model_label(rec), "n_layers": m.get("n_layers"),
                             "d_model": m.get("d_model"), "n_heads": m.get("n_heads"), "seq_len": t.get("seq_len")},
                   "config": gate_config(rec, run_dir)},
      "command": rec.run_folder.command, "git": env.git,
      "versions": dict(env.versions), "backend": {n: side_table.backend(s) for n, s in rec.sides.items()},
      "key_figures": _key_figures(rec, run_dir),
      "semantics": semantics_card_block(rec),
      "determinism": proven_deterministic(rec), "threads": thread_settings(rec),
      "machine": {k: v for k, v in (("host", env.hostname), ("cpu_model", env.cpu_model),
                                    ("cpu_count", env.cpu_count), ("machine", env.machine),
                                    ("platform", env.platform)) if v not in (None, "")},
      "join": join_card(rec),
      "files": ["report.html", "report.md", "report.json"],
  }
