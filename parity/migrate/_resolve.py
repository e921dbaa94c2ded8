"""Resolving "auto" values from explicit flags, the way the HF Trainer fills them (never silently)."""
from __future__ import annotations

import copy
import json
from typing import Any, Callable

from parity.migrate._ctx import UNRESOLVED, Flags
from parity.migrate._report import Report, leaf_paths

__all__ = ["resolve_autos", "AUTO_RULES", "FILLS"]

FILLS = ("hf-trainer", "accelerate")
"""The stacks that fill "auto" values from their arguments (HF's fill_match; Accelerate's deepspeed_config_process)."""

# path -> (flag attribute, flag as typed, value from flags, how HF fills it)
_Rule = tuple[str | None, str, Callable[[Flags], Any], str]


def _sq(f: Flags) -> int:
  return f.hidden_size * f.hidden_size


AUTO_RULES: dict[str, _Rule] = {
    "train_micro_batch_size_per_gpu": ("micro_batch", "--micro-batch", lambda f: f.micro_batch,
                                       "HF fills per_device_train_batch_size"),
    "gradient_accumulation_steps": ("grad_accum", "--grad-accum", lambda f: f.grad_accum,
                                    "HF fills gradient_accumulation_steps"),
    "gradient_clipping": ("max_grad_norm", "--max-grad-norm", lambda f: f.max_grad_norm, "HF fills max_grad_norm"),
    "optimizer.params.lr": ("lr", "--lr", lambda f: f.lr, "HF fills learning_rate"),
    "optimizer.params.betas": ("betas", "--betas", lambda f: list(f.betas), "HF fills [adam_beta1, adam_beta2]"),
    "optimizer.params.eps": ("eps", "--eps", lambda f: f.eps, "HF fills adam_epsilon"),
    "optimizer.params.weight_decay": ("weight_decay", "--weight-decay", lambda f: f.weight_decay,
                                      "HF fills weight_decay"),
    "scheduler.params.warmup_min_lr": (None, "", lambda f: 0, "HF fills 0 (not a trainer argument)"),
    "scheduler.params.warmup_max_lr": ("lr", "--lr", lambda f: f.lr, "HF fills learning_rate"),
    "scheduler.params.warmup_num_steps": ("warmup_steps", "--warmup-steps", lambda f: f.warmup_steps,
                                          "HF fills the warmup steps"),
    "scheduler.params.total_num_steps": ("total_steps", "--total-steps", lambda f: f.total_steps,
                                         "HF fills the number of training steps"),
    "fp16.enabled": ("precision", "--fp16, --bf16 or --fp32", lambda f: f.precision == "fp16", "HF fills args.fp16"),
    "bf16.enabled": ("precision", "--fp16, --bf16 or --fp32", lambda f: f.precision == "bf16", "HF fills args.bf16"),
    "bfloat16.enabled": ("precision", "--fp16, --bf16 or --fp32", lambda f: f.precision == "bf16",
                         "HF fills args.bf16"),
    "zero_optimization.reduce_bucket_size": ("hidden_size", "--hidden-size", _sq, "HF fills hidden_size**2"),
    "zero_optimization.stage3_prefetch_bucket_size": (
        "hidden_size", "--hidden-size", lambda f: int(0.9 * f.hidden_size * f.hidden_size),
        "HF fills int(0.9 * hidden_size**2), truncating the fraction (an int field in DeepSpeed)"),
    "zero_optimization.stage3_param_persistence_threshold": ("hidden_size", "--hidden-size",
                                                             lambda f: 10 * f.hidden_size, "HF fills 10 * hidden_size"),
}
_MATCHED = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
            "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay",
            "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps", "scheduler.params.total_num_steps",
            "fp16.enabled", "bf16.enabled", "bfloat16.enabled")
"""Keys the HF Trainer checks against its arguments when they are explicit (`fill_match`)."""


def _set(cfg: dict[str, Any], path: str, value: Any) -> None:
  parts = path.split(".")
  node = cfg
  for p in parts[:-1]:
    node = node[p]
  node[parts[-1]] = value


def _same(a: Any, b: Any) -> bool:
  if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
  if isinstance(a, bool) or isinstance(b, bool):
    return a is b
  if isinstance(a, (int, float)) and isinstance(b, (int, float)):
    return float(a) == float(b)
  return a == b


def resolve_autos(raw: dict[str, Any], flags: Flags, report: Report,
                  stack: str = "hf-trainer") -> tuple[dict[str, Any], dict[str, str]]:
  """Replaces every "auto" with its value from `flags`.

  Under the stacks that fill "auto" (hf-trainer, accelerate; parity.migrate._stack) a flag that contradicts an
  explicit value is refused, as HF's fill_match does; under the others (deepspeed, megatron) nothing fills an
  "auto", so one is refused naming the stack.
  Returns:
    (resolved config, {path: reason}) for the keys that were "auto". An "auto" that nothing resolves
    becomes UNRESOLVED and is reported as an error naming the key and the flag.
  """
  cfg = copy.deepcopy(raw)
  notes: dict[str, str] = {}
  fills = stack in FILLS
  for path, value in leaf_paths(raw):
    rule = AUTO_RULES.get(path)
    if value == "auto" and not fills:
      report.refuse(f"{path} is \"auto\", and under --stack {stack} nothing fills it (only the HF Trainer and "
                    "Accelerate do); DeepSpeed would read the string and fail. Replace it with a value, or pass "
                    "--stack hf-trainer.")
      _set(cfg, path, UNRESOLVED)
      continue
    if value != "auto":
      # Megatron passes its own optimizer and lr scheduler: DeepSpeed reads neither section
      unread = stack == "megatron" and path.startswith(("optimizer.", "scheduler."))
      if rule and path in _MATCHED and rule[0] and getattr(flags, rule[0]) is not None and not unread:
        want = rule[2](flags)
        if not _same(value, want):
          why = ("the HF Trainer rejects this mismatch. Set {path} to \"auto\" or drop the flag"
                 if stack == "hf-trainer" else
                 "under --stack accelerate Accelerate fills only \"auto\" values (DeepSpeedPlugin."
                 "deepspeed_config_process(must_match=False)): the config's value wins and the flag would be ignored. "
                 "Drop the flag, change the value in the config, or set it to \"auto\"" if stack == "accelerate" else
                 f"under --stack {stack} nothing fills the config from the flag, so it would be ignored. Drop the "
                 "flag or change the value in the config")
          report.refuse(f"{path} is {value!r} in the config but {rule[1]} gives {want!r}; {why.format(path=path)}.")
      continue
    if path == "train_batch_size":
      notes[path] = "\"auto\" -> micro * grad_accum * world (HF fills world_size * per_device_batch * grad_accum)"
      continue
    if rule is None:
      report.refuse(f"{path} is \"auto\", which nothing resolves: the HF Trainer does not fill it and DeepSpeed "
                    "does not resolve \"auto\" itself. Replace \"auto\" with a value.")
      _set(cfg, path, UNRESOLVED)
      continue
    attr, flag, fn, how = rule
    if attr is not None and getattr(flags, attr) is None:
      report.refuse(f"{path} is \"auto\"; pass {flag} to resolve it ({how}).")
      _set(cfg, path, UNRESOLVED)
      continue
    _set(cfg, path, fn(flags))
    notes[path] = f"\"auto\" -> {fn(flags)!r} ({how}{', from ' + flag if flag else ''})"
  _mixed_precision(cfg, flags, report, stack)
  _unread_schedule_flags(raw, flags, report, stack)
  return cfg, notes


_SCHEDULE_FLAGS = (("warmup_steps", "--warmup-steps", "scheduler.params.warmup_num_steps"),
                   ("total_steps", "--total-steps", "scheduler.params.total_num_steps"))
"""The flags only a scheduler "auto" reads (AUTO_RULES): given where no such "auto" is, they change nothing."""


def _unread_schedule_flags(raw: dict[str, Any], flags: Flags, report: Report, stack: str) -> None:
  """Warns for each of _SCHEDULE_FLAGS given where the config has no "auto" for it to fill (no scheduler section,
  or an explicit value), so that a port never looks as if it carried a warmup it does not."""
  values = dict(leaf_paths(raw))
  for attr, flag, path in _SCHEDULE_FLAGS:
    given = getattr(flags, attr, None)
    if given is None or (values.get(path) == "auto" and stack in FILLS):
      continue
    where = (f"{path} is {values[path]!r} in the config" if path in values else
             "the config has no scheduler section" if "scheduler" not in raw else f"the config has no {path}")
    report.warnings.append(f"{flag} {given} is not read: {where}, and the flag only fills an \"auto\" there; "
                           "the ported schedule is the config's (write the scheduler section to port a warmup).")


_ADDED = {"bf16": {"enabled": True}, "fp16": {"enabled": True, "auto_cast": True}}
"""The section Accelerate adds for a mixed precision the config has no section for (accelerate 1.16.0 utils/
dataclasses.py DeepSpeedPlugin.set_mixed_precision: `if "bf16" not in ds_config: ds_config["bf16"] = {"enabled":
True}`, fp16 likewise with auto_cast; the Trainer's TrainingArguments.bf16/fp16 and `accelerate launch
--mixed_precision` reach it through AcceleratorState)."""


def _mixed_precision(cfg: dict[str, Any], flags: Flags, report: Report, stack: str) -> None:
  """--bf16/--fp16 on a config without that section: under hf-trainer and accelerate the section Accelerate adds
  (_ADDED), so the job runs that precision; under the other stacks nothing reads the flag (a warning says so)."""
  sec = flags.precision if flags.precision in _ADDED else None
  if sec is None or sec in cfg:
    return
  if stack not in FILLS:
    report.warnings.append(f"--{sec}: the config has no {sec} section and under --stack {stack} nothing reads it "
                           f"(only Accelerate adds the section); DeepSpeed runs the precision the config says. Add "
                           f"\"{sec}\": {{\"enabled\": true}} to train in {sec}, or drop the flag.")
    return
  cfg[sec] = dict(_ADDED[sec])
  report.implied.append({"key": f"{sec}.enabled", "value": True, "reason": (
      f"the config has no {sec} section and --{sec} asks for {sec}: under {stack} Accelerate's DeepSpeedPlugin."
      f"set_mixed_precision adds {json.dumps(_ADDED[sec])} (accelerate 1.16.0), so the job trains in {sec}")})
