"""The run folder's files and their readers (one half of the run protocol; `parity.protocol` has the map).

Files of one run (DESIGN.md):
  run_dir/request.json          RunRequest (schema 'parity.request/1'), written by the harness
  run_dir/init.safetensors      canonical initial weights (parity.weights)
  run_dir/batches.npy           uint16 (steps, grad_accum_steps, micro_batch_size, seq_len + 1); uint32 when
                                model.vocab_size > 65,536 (parity.data.batch_dtype)
  run_dir/val_batches.npy       same dtype (eval_batches, micro_batch_size, seq_len + 1)
  run_dir/<side>/steps.jsonl    one StepRecord per optimizer step, flushed as it is written
  run_dir/<side>/summary.json   Summary, written once at the end (also on failure when possible)
  run_dir/<side>/final.safetensors  canonical final fp32 (master) params
  run_dir/<side>/final_moments.safetensors  float32, per canonical param: 'grad_rms/<name>' = Adam's
                                bias-corrected sqrt(v_hat) at the end, 'sensitivity/<name>' = sum over updates of
                                lr_t / (sqrt(v_hat_t) + eps) (parity.numerics.adam.AdamSensitivity); read by the params
                                rule (parity.verdict.params.param_checks); optional
  run_dir/<rerun>/              a rerun of the run (RERUN_DIRS: noise/, repeat/, resume/, backend/; and
                                equivalence/<kind>/), each a request.json derived from this run's and a folder per side
  run_dir/report.json           the report (parity.report), written once every side and rerun is done
  run_dir/.parity.lock          LOCK_NAME, while a run holds the folder (parity.pipeline.claim)

A worker (`parity.protocol.workers`) writes them through `parity.protocol.side.SideIO`, so both frameworks write
identical records.

StepRecord keys (units in names): step (0-based), loss (mean token cross-entropy,
nats, averaged over the micro batches of the step), grad_norm (global L2 norm of
the gradient before clipping), lr (learning rate applied in this step),
loss_scale (fp16 loss scale, 1.0 otherwise), skipped (update skipped on
overflow), step_time_s (wall seconds of the step, host-synchronised), tokens
(tokens consumed by the step), val_loss (held-out loss after the step, only on
eval steps).

Run control keys of a request: `parity.protocol.control`.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from parity import weights

__all__ = ["REQUEST_SCHEMA", "SUMMARY_SCHEMA", "LAUNCH_ENV", "DEBUG_KEYS", "PLANT_KEYS", "DATA_PLANT_KEYS",
           "OPTIMIZER_PLANT_KEYS", "PLACEMENT_PLANT_KEYS", "FSDP_PLANT_KEYS", "OFFLOAD_PLANT_KEYS", "FAMILY_PLANT_KEYS",
           "SIDE_PLANT_KEYS", "STEP_LIST_KEYS", "ACCELERATOR_PLANT_KEYS",
           "FINAL_MOMENTS", "MOMENT_KINDS", "CHECKPOINT_DIR", "CHECKPOINT_META", "CHECKPOINT_SCHEMA",
           "parse_debug_value", "read_steps", "read_summary", "read_moments", "read_checkpoint_meta", "PLANTED_KILL",
           "FOLDER_GONE",
           "PLANTED_HANG", "tail_text", "count_lines", "warmup_steps_left_out", "warm_step_times",
           "step_time_median", "tokens_per_s", "loss_tokens_per_s", "REQUEST_FILE", "REPORT_FILE", "SUMMARY_FILE",
           "STEPS_FILE", "FINAL_PARAMS", "LOCK_NAME", "NOISE_DIR", "REPEAT_DIR", "RESUME_DIR", "BACKEND_DIR",
           "EQUIVALENCE_DIR", "RERUN_DIRS", "enclosing_run"]

# ------------------------------------------------------------------ the run folder's names
REQUEST_FILE, REPORT_FILE = "request.json", "report.json"
"""The run's request (written before any side starts) and its report (written once everything ran)."""
SUMMARY_FILE, STEPS_FILE, FINAL_PARAMS = "summary.json", "steps.jsonl", "final.safetensors"
"""A side's files in run_dir/<side>/ (a rerun's in run_dir/<rerun>/<side>/)."""
LOCK_NAME = ".parity.lock"
"""The lock file of a run folder being written (JSON: pid, host, proc_start, started_utc, command, run_id;
parity.pipeline.claim)."""
NOISE_DIR, REPEAT_DIR, RESUME_DIR, BACKEND_DIR = "noise", "repeat", "resume", "backend"
"""The rerun folders of a run (harness.self_runs runs them, parity.report.reverify reads them again): the
reduction-order reruns, the determinism/checkpointing repeat, the resumed run, the host-CPU reruns."""
RERUN_DIRS = (NOISE_DIR, REPEAT_DIR, RESUME_DIR, BACKEND_DIR)
"""The rerun folders whose sides' files report.json hashes (parity.report.build.artifact_paths)."""
EQUIVALENCE_DIR = "equivalence"
"""run_dir/equivalence/<kind>/: the --equivalence reruns (parity.pipeline.equivalence_inputs)."""
_PARITY_FILES = (REPORT_FILE, REQUEST_FILE, "diagnose.json")
"""Files whose schema says `parity.`: with LOCK_NAME, what makes a folder certainly a parity run (a generic
config.json does not: a user's project folder may hold one)."""


def enclosing_run(path: Path) -> Path | None:
  """The nearest folder above `path` (itself excluded) that is a parity run folder, or None.

  A run folder is one with LOCK_NAME or a report.json/request.json/diagnose.json whose schema starts `parity.`.
  A run written inside another's folder would mix with it (the outer run's --force moves both, its files look
  like the inner run's), so --out there is refused."""
  for folder in Path(path).absolute().parents:
    if (folder / LOCK_NAME).exists():
      return folder
    for name in _PARITY_FILES:
      try:
        with open(folder / name, "rb") as f:
          if b'"schema": "parity.' in f.read(4096):
            return folder
      except OSError:
        continue
  return None


REQUEST_SCHEMA = "parity.request/1"
SUMMARY_SCHEMA = "parity.summary/1"
LAUNCH_ENV = "PARITY_LAUNCH_TIME"
"""Environment variable holding time.time() when the harness spawned the worker."""
PLANTED_KILL = "[parity] planted kill"
"""What a worker writes to stderr just before the fault injection kill_at_step kills it, so the harness reports the
kill as planted, not as one from outside or the OOM killer."""
FOLDER_GONE = "the run folder {folder} was deleted or moved while the run was running"
"""What a side's error says when its run folder vanished under the run (harness.runner.folder_gone); the report's
verdict sentence looks for it (parity.report.headline)."""
PLANTED_HANG = "[parity] planted hang"
"""What a worker writes to stderr when the fault injection hang_at_step stops it, so a hang is named as planted."""
DATA_PLANT_KEYS = ("attention_mask_dropped", "positions_not_restarted", "labels_shifted_twice", "loss_on_prompt")
"""Planted data bugs of the padded/packed layouts (docs/data-examples.md "Planted bugs"), each
`true` or absent, applied by the side to its own inputs and model: attention_mask_dropped (the model gets no
segment ids: causal attention over the whole row, across documents), positions_not_restarted (no positions: 0..T-1
along the row), labels_shifted_twice (input t scored against token t + 2, with target t's weight), loss_on_prompt
(every target inside its example carries the loss, prompt tokens included)."""
OPTIMIZER_PLANT_KEYS = ("decay_biases",)
"""Planted optimizer bugs, `true` or absent, applied by the side to its own optimizer: decay_biases
(every '*.bias' parameter joins the weight-decayed set: torch_impl.semantics.decay_groups_of, jax_impl.optim.
decay_mask). Any layout; the semantics card names it at step 0."""
PLANT_KEYS = DATA_PLANT_KEYS + OPTIMIZER_PLANT_KEYS
"""Every planted bug a side applies to its own inputs, model and optimizer (data and optimizer)."""
PLACEMENT_PLANT_KEYS = ("placement_device",)
"""Planted placement faults, `true` or absent, JAX side only: placement_device compiles the step with every
state group the plan offloads in device memory while the plan still names the host (jax_impl.step.Trainer.build), so
the 'placement' check (parity.verdict.placement) FAILs naming the class. Nothing the side computes changes."""
FSDP_PLANT_KEYS = ("fsdp_reduce_dtype_low", "fsdp_shard_unsynced")
"""Planted FSDP2 bugs, `true` or absent, fsdp side only (torch_impl.fsdp): fsdp_reduce_dtype_low
lowers the gradient reduce dtype of MixedPrecisionPolicy to 16 bits (bfloat16; float16 in fp16 runs) where the
correct policy reduces in float32, so the gradients are rounded before the reduce-scatter (`torch_impl.fsdp.policies`;
the semantics card's dtypes.grads names it at step 0); fsdp_shard_unsynced leaves rank 1's shard of one param
(h.0.attn.qkv.weight) at its pre-step value after every optimizer step, its update never written back, so the ranks'
shards no longer make the single-rank model (`FsdpTrainer.step`; needs --nproc 2 or more)."""
OFFLOAD_PLANT_KEYS = ("offload_residual_stale",)
"""Planted activation-offload bugs, `true` or absent, JAX side only, on a plan whose remat policy offloads residuals
(jax.remat offload_names / offload_dots_no_batch): offload_residual_stale makes each block's MLP down projection
take its weight gradient from a wrong saved residual (`mlp_hidden` one token row off: jax_impl.residual_plant), as
a backward pass reading a stale offloaded buffer would. The forward values and the loss are unchanged; only the
gradients are wrong, so the gradient and params checks must catch it (docs/plans.md "The planted stale residual")."""
FAMILY_PLANT_KEYS = ("qk_norm_after_rope", "attn_softcap_skipped", "final_softcap_skipped", "norm_plus_one_rounded",
                     "final_norm_eps_tenth")
"""Planted model-family porting bugs, `true` or absent, any side: the side's model runs a convention of its family
wrong while its spec (and so the run's request) is unchanged, as a hand port of a checkpoint can: qk_norm_after_rope
(the per-head q/k RMSNorm applied after rotary instead of before: HF Qwen3 / Gemma 3 norm first), attn_softcap_skipped
and final_softcap_skipped (the attention-score or final-logit soft-cap of Gemma 2 not applied), norm_plus_one_rounded
(Gemma's (1 + w) RMSNorm with Llama's rounding order: the normalised value rounded to the compute dtype, then times
(1 + w) rounded to it, where HF Gemma2RMSNorm multiplies in float32 and rounds once; the same in fp32),
final_norm_eps_tenth (the final norm's eps a tenth of model.norm_eps, every other norm's right: a Llama-1 eps of 1e-6
left in a Llama-2 (1e-5) port; the semantics card's norm.eps_all names it). Applied by torch_impl.layers /
jax_impl.layers (`set_model_plants`); parity.pipeline.plants refuses one the model cannot show."""
ACCELERATOR_PLANT_KEYS = ("accelerator_update_scale", "accelerator_norm_eps", "accelerator_matmul_default")
"""Planted errors of the JAX side on an accelerator only (jax_impl.accelerator_plants; docs/tpu.md "Accelerator-only
plants"): accelerator_update_scale (a factor > 0, not 1: every update scaled), accelerator_norm_eps (a value > 0: the
final norm's eps), accelerator_matmul_default (`true`: the output projection at 'default' matmul precision). Its
host-CPU rerun runs clean, so only the cross-backend rule can catch them; on the CPU the side applies none and its
summary records each as not applied."""
SIDE_PLANT_KEYS = PLANT_KEYS + PLACEMENT_PLANT_KEYS + FSDP_PLANT_KEYS + OFFLOAD_PLANT_KEYS + FAMILY_PLANT_KEYS
"""Every planted bug a side can carry (each takes `true`): `parity.protocol.side.SideIO.plants`."""
DEBUG_KEYS = ("nan_at_step", "kill_at_step", "hang_at_step", "raise_at_step", "overflow_at_steps",
              "fault_rank") + SIDE_PLANT_KEYS + ACCELERATOR_PLANT_KEYS
"""Fault injections a request may carry per side (besides model./train. overrides), for testing failure paths.
Each takes a step number (0-based optimizer step); `overflow_at_steps` takes a list of them: at those steps
the side makes its (loss-scaled) gradient overflow, as an fp16 run with too large a loss scale would.
`fault_rank` (a rank number) limits kill/hang/raise_at_step to that rank of a multi-rank side (docs/multirank.md).
SIDE_PLANT_KEYS (PLANT_KEYS, PLACEMENT_PLANT_KEYS, FSDP_PLANT_KEYS, OFFLOAD_PLANT_KEYS, FAMILY_PLANT_KEYS) take
`true`; ACCELERATOR_PLANT_KEYS take their value (`parse_debug_value`)."""
STEP_LIST_KEYS = ("overflow_at_steps",)
"""DEBUG_KEYS whose value is a list of steps."""


FINAL_MOMENTS = "final_moments.safetensors"
"""In run_dir/<side>/: per canonical param (float32, the param's shape) 'grad_rms/<name>' (Adam's bias-corrected
sqrt(v_hat) at the end of the run) and 'sensitivity/<name>' (sum_t lr_t / (sqrt(v_hat_t) + eps), units
param / gradient), written by every side whose optimizer keeps a second moment."""
MOMENT_KINDS = ("grad_rms", "sensitivity")

CHECKPOINT_DIR = "checkpoint"
"""Folder, inside run_dir/<side>/, of the checkpoint `save_checkpoint_at_step` writes."""
CHECKPOINT_META = "meta.json"
"""The checkpoint's description, written after its framework files: a folder without it is incomplete."""
CHECKPOINT_SCHEMA = "parity.checkpoint/1"


def warmup_steps_left_out(n_steps: int) -> int:
  """How many leading steps throughput leaves out as warmup, of a side that timed `n_steps` steps: 2 when more than 3
  ran (the first step compiles, the second can still re-trace or warm caches), 1 when 2 or 3 ran, 0 for one step."""
  return 2 if n_steps > 3 else 1 if n_steps > 1 else 0


def warm_step_times(times: Sequence[Any]) -> list[float]:
  """THE throughput rule (summary.json, report, card, comparison page and gate all use it): a side's per-step wall
  seconds (StepRecord step_time_s, in step order; non-numbers dropped) after `warmup_steps_left_out` steps."""
  ts = [float(t) for t in times if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)]
  return ts[warmup_steps_left_out(len(ts)):]


def step_time_median(times: Sequence[Any]) -> float | None:
  """Median seconds per step of `warm_step_times(times)`; None when no step was timed."""
  warm = warm_step_times(times)
  return statistics.median(warm) if warm else None


def tokens_per_s(times: Sequence[Any], tokens_per_step: int | float | None) -> float | None:
  """tokens_per_step / step_time_median(times) (tokens/s); None when either is missing or the median is 0."""
  med = step_time_median(times)
  return tokens_per_step / med if med and tokens_per_step else None


def loss_tokens_per_s(times: Sequence[Any], loss_tokens: Sequence[Any] | None) -> float | None:
  """Loss tokens/s: the mean loss-carrying targets of the warm steps / step_time_median(times) (tokens/s).

  The same rule as `tokens_per_s`, counting only the targets that carry the loss (padding, prompt tokens and
  cut-off targets left out): the steps are the ones `warm_step_times` keeps, and since a padded or packed step's
  loss tokens vary, their mean over those steps is divided by the median step time. On a stream run every target
  carries the loss, so loss_tokens is tokens_per_step at every step and the two figures are equal.
  Args:
    times: per-step wall seconds, in step order (StepRecord step_time_s; non-numbers dropped with their step).
    loss_tokens: the loss tokens of the same steps, one per entry of `times` (all micro batches and ranks:
      parity.dataset.layouts ExampleBatches.loss_tokens_per_step, the data card's list).
  Returns:
    Loss tokens/s; None when no step was timed, the counts are missing or shorter than `times`, or the median is 0.
  """
  if loss_tokens is None or len(loss_tokens) < len(times):
    return None
  num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
  pairs = [(float(t), n) for t, n in zip(times, loss_tokens) if num(t)]
  warm = pairs[warmup_steps_left_out(len(pairs)):]
  if not warm or not all(num(n) for _, n in warm):
    return None
  med = statistics.median(t for t, _ in warm)
  return statistics.fmean(float(n) for _, n in warm) / med if med else None


def parse_debug_value(key: str, value: Any) -> int | bool | tuple[int, ...]:
  """Checks one debug value: a step (int >= 0), for STEP_LIST_KEYS a list of steps (or one step), for PLANT_KEYS
  `true` (a plant is on or absent).

  Raises:
    ValueError: naming the key and what it takes.
  """
  if key in ACCELERATOR_PLANT_KEYS:
    return _accelerator_plant_value(key, value)
  if key in SIDE_PLANT_KEYS:
    if value is not True:
      raise ValueError(f"{key} is a planted bug: it takes true (leave it out for a correct side); got {value!r}")
    return True
  if key in STEP_LIST_KEYS:
    items = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in items):
      raise ValueError(f"{key} takes a list of step numbers (integers >= 0); got {value!r}")
    return tuple(sorted(set(items)))
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(f"{key} takes a {'rank' if key == 'fault_rank' else 'step'} number (an integer >= 0); "
                     f"got {value!r}")
  return value


def _accelerator_plant_value(key: str, value: Any) -> float | bool:
  """accelerator_matmul_default: true; accelerator_update_scale: a finite number > 0 other than 1;
  accelerator_norm_eps: a finite number > 0. Raises ValueError naming the key and what it takes."""
  if key == "accelerator_matmul_default":
    if value is not True:
      raise ValueError(f"{key} is a planted bug: it takes true (leave it out for a correct side); got {value!r}")
    return True
  try:
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value)) \
        and value > 0
  except OverflowError:  # an integer past float's range
    number = False
  if not number or (key == "accelerator_update_scale" and value == 1):
    what = "a factor > 0 other than 1 (1.001: every update 0.1% too large)" if key == "accelerator_update_scale" \
        else "an eps > 0 (1e-6 where the model has 1e-5)"
    raise ValueError(f"{key} takes {what}; got {value!r}")
  return float(value)


def read_steps(path: str | Path) -> list[dict[str, Any]]:
  """Reads a steps.jsonl; a truncated last line (a killed writer) is dropped."""
  out = []
  p = Path(path)
  if not p.exists():
    return out
  for line in p.read_text().splitlines():
    try:
      out.append(json.loads(line))
    except json.JSONDecodeError:
      break
  return out


def read_summary(path: str | Path) -> dict[str, Any] | None:
  p = Path(path)
  if not p.exists():
    return None
  try:
    return json.loads(p.read_text())
  except json.JSONDecodeError:
    return None



def read_moments(path: str | Path) -> dict[str, dict[str, np.ndarray]] | None:
  """Reads a FINAL_MOMENTS file: {'grad_rms': name -> array, 'sensitivity': name -> array} (float32, >= 0).

  Returns None when the file does not exist, cannot be read, or holds negative or non-finite values: the side
  then counts as one that could not provide moments, and the params rule falls back to its per-tensor form for
  its pairs and says so in the check's detail. Never raises for the file's content.
  """
  path = Path(path)
  try:
    out = weights.load(path)
  except Exception:  # missing, truncated or foreign: the fallback covers it
    return None
  if not all(np.all(np.isfinite(a)) and not np.any(a < 0) for a in out.values()):
    return None
  split: dict[str, dict[str, np.ndarray]] = {k: {} for k in MOMENT_KINDS}
  for key, arr in out.items():
    kind, _, name = key.partition("/")
    if kind not in split or not name:
      return None
    split[kind][name] = arr
  return split if split["grad_rms"] and set(split["grad_rms"]) == set(split["sensitivity"]) else None



def read_checkpoint_meta(folder: str | Path) -> dict[str, Any]:
  """Reads `<folder>/meta.json` of a checkpoint written by `SideIO.save_checkpoint`.

  Raises:
    FileNotFoundError: no folder, or no meta.json in it (an interrupted save writes none).
    ValueError: meta.json is not JSON or has another schema.
  """
  folder = Path(folder)
  if not folder.is_dir():
    raise FileNotFoundError(f"no checkpoint folder at {folder}")
  path = folder / CHECKPOINT_META
  if not path.is_file():
    raise FileNotFoundError(f"{folder} holds no {CHECKPOINT_META}: not a parity checkpoint, or its save was "
                            "interrupted (meta.json is written last)")
  try:
    meta = json.loads(path.read_text())
  except json.JSONDecodeError as exc:
    raise ValueError(f"{path}: not valid JSON ({exc})") from None
  if not isinstance(meta, dict) or meta.get("schema") != CHECKPOINT_SCHEMA:
    got = meta.get("schema") if isinstance(meta, dict) else type(meta).__name__
    raise ValueError(f"{path}: schema {got!r}, expected {CHECKPOINT_SCHEMA!r}")
  return meta


def tail_text(path: Path, n: int) -> str:
  """The last `n` bytes of a worker's log as text (undecodable bytes replaced); "" when the file cannot be read."""
  try:
    return Path(path).read_bytes()[-n:].decode("utf-8", "replace")
  except OSError:
    return ""


def count_lines(path: Path) -> int:
  """Lines in a file (records a worker has appended to steps.jsonl so far); 0 when it cannot be read."""
  try:
    with open(path, "rb") as f:
      return sum(1 for _ in f)
  except OSError:
    return 0

