"""One run's report: report.json (schema below), report.md, report.html, the PNG plots, card.json; read back (one
typed reader, parity.report.run_record: RunRecord, `read_run`) and re-verified. Holding runs against each other (the
comparison page, the regression gate) is parity.history, which stands on this package; nothing here imports it.

report.json, schema 'parity.report/3' (units in key names):
  schema, created_utc, run_dir, preset, config_hash
  checkpoint     {path, architecture} of the Hugging Face checkpoint (`--hf-model`) the model and initial weights
                 came from | null (seeded weights); parity.report.headline.model_label names the run by it
  run            the resolved RunSpec (parity.spec.to_dict)
  data           {source, sha256, train_tokens, val_tokens, files}
  environment    {python, platform, machine, cpu_count, cpu_model, load_avg_1_5_15, hostname, versions: {package:
                 version}, git: {rev, dirty} | null} of the harness (environment.json beside it, when written, has more)
  migration      {source: the DeepSpeed config file, status, file: 'migration.md', entries, loss_normalization:
                 what the config implies (text; parity.migrate._loss_norm) | null} | null
  verdict        {passed, message, first_failure: {check, metric, sides, step, value, tolerance} | null}
  tolerances     {precision: {metric: {atol, rtol, reason}}} (the table in force)
  checks         [{name, metric, sides, value, tolerance, passed, first_failing_step, worst, detail, reason,
                   gating}] (gating false: reported, does not decide the verdict)
  params_table   [{tensor, sides, max_abs_diff, max_abs_moved, ratio, passed}]
  sides          {side: {status, error, returncode, wall_s, harness_peak_rss_bytes, summary: <the side's
                  summary.json>, series: {step, loss, grad_norm, lr, loss_scale, skipped, step_time_s, tokens,
                  val_step, val_loss}, load: {start, end} (os.getloadavg() triples) | null}}
  sides_not_run  {side: {reason, named}}: sides this machine could not start (parity.sockets: it refuses sockets);
                 named true: the user named it, so it is also in `sides` (status not_run) and the run fails;
                 false: left out of the run ({} when every side could start)
  timing         {wall_s, prepare_s, sides_s: {side: init_s + compile_s + train_s}, self_runs_s (the same for
                  the noise/determinism/resume reruns), overhead_ratio = wall_s / (sum(sides_s) + self_runs_s)}
  plan           {name, chosen_by, why} when --plan was given, else null
  semantics      {cards: {side: <the side's semantics.json> | null}, rows: [{item, values: {side: value}, agree}]}:
                 the semantics cards behind the 'semantics' checks (parity.report.build.semantics_section)
  placement      {sides: {side: {kind ('jax' | 'deepspeed' | 'torch'), from (the file read), status ('ok' |
                  'missing' | 'unreadable' | 'invalid'), error, and placement (<the JAX side's placement.json>) |
                  transfers (<the DeepSpeed summary.json transfers>) | bytes_per_step ({h2d, d2h}: the torch
                  baseline's 0, derived from its summary)}}}: where each side's state lives and what crosses between
                 host and device per step (parity.report.placement_view.placement_section)
  memory         {predicted_vs_measured: [{side, category, memory_kind, predicted, measured, ratio}], note}: every
                 side in the same categories (parity.sizing.memory.CATEGORIES); measured None where a side cannot
                 measure a category (activations; the JAX gradients, which live inside the jitted step)
  noise_envelope {method, rule: parity.verdict.tolerances.EnvelopeRule fields, runs: {side: {status, wall_s, error}},
                  sides: {side: {steps, abs_loss_diff, grad_norm_rel_diff, params_ratio_max}}} | null: each side's
                 reduction-order rerun behind the *_envelope checks (bf16/fp16 by default)
  determinism    {side: {deterministic, steps_checked, detail, status}}: a rerun of each side's first steps
  resume         {side: {resumed_at_step, bit_identical, detail}} when a resume check was asked for
  inputs         {data, tokens ('bytes' | 'ids'), format ('bytes' | 'nanogpt-bin' | 'llmc-bin' | 'npy'), file_dtype,
                  max_id, vocab_size, batches_dtype ('uint16' | 'uint32'), tokenizer (a sentence), checkpoint
                  (--hf-model folder) | null, checkpoint_tokenizer_used (false with a checkpoint),
                  checkpoint_tokenizer_files} | null (parity.pipeline.folder.inputs_record)
  deepspeed_files {given: {file: 'deepspeed_config.given.json', source, sha256, bytes} | null, resolved: {file:
                  'deepspeed_config.resolved.json', sha256, bytes}} with --deepspeed-config, else null
  perturbations  [{side, key, value, applies, deepspeed_config: [{path, was, now, for}] | null, note, ran: {side:
                  {value, from}}, peak_lr, expected_peak_lr (lr keys), applied: true | false | null}]
                 (parity.report.build.perturbations_ran; fault injections last, applies null)
  artifacts      {relative path: {sha256, bytes}} of every file the checks read (parity.report.build.artifact_paths);
                 parity.report.read.verify_report re-hashes them and recomputes every check from them
"""
from parity.report.build import Report, build_report
from parity.report.write import write_markdown, write_plot, write_all

__all__ = ["Report", "build_report", "write_markdown", "write_plot", "write_all"]
