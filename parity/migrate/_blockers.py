"""What `parity compare` cannot run of a ported config, and how to run it: `compare_blockers`, the checks
`to_run_spec` makes (it raises naming them) and what `parity port` writes as not_runnable_by_compare."""
from __future__ import annotations

from parity.migrate._model import NotRunnable, PortedConfig
from parity.numerics.schedule import COMPARE_SCHEDULERS

__all__ = ["compare_blockers", "MSG_FP16_STAGE0_WHY", "MSG_FP16_STAGE0_RUN"]

MSG_FP16_STAGE0_WHY = ("at ZeRO stage 0 DeepSpeed 0.19.8 does not run a loss-scaled fp16 step (FP16_Optimizer divides "
                       "the unscaled gradient by the loss scale; parity.migrate._port.MSG_FP16_STAGE0), and compare's "
                       "DeepSpeed side runs fp16 under ZeRO stages 1-3 only (torch_impl.engine refuses stage 0)")
MSG_FP16_STAGE0_RUN = ("Nearest run compare makes: jax.zero_stage 1 (zero_optimization.stage 1 in the DeepSpeed "
                       "config), the loss-scaled fp16 step this config asks for")


def compare_blockers(ported: PortedConfig) -> dict[str, NotRunnable]:
  """Every reason `parity compare` cannot run `ported`, by parity.migrate._model.NOT_RUNNABLE_KEYS name, each with
  its value, why and how to run it (NotRunnable.run): the port's own entries of not_runnable_by_compare (mixed
  offload pinning) and the checks `to_run_spec` makes (it raises SpecError naming them all):
  fp16 under ZeRO stage 0, Adam/Lamb without bias correction, a scheduler compare does not run. Empty exactly when
  to_run_spec maps the config; `parity port` writes this as not_runnable_by_compare."""
  out = dict(ported.not_runnable_by_compare)
  out.pop("cpu_checkpointing", None)  # a port written before compare ran CPU checkpointing names it; it runs now
  o, s, pr = ported.optimizer, ported.scheduler, ported.precision
  if s.type not in COMPARE_SCHEDULERS:
    out["scheduler"] = NotRunnable(value=s.type, why=f"parity compare runs the schedulers "
                                   f"{', '.join(COMPARE_SCHEDULERS)}", run="`parity port --verify` checks this "
                                   "schedule against DeepSpeed's own class")
  if o.type != "sgd" and not o.params["bias_correction"]:
    out["bias_correction"] = NotRunnable(
        value=False, why=f"compare's sides run {o.type} with bias correction only (optimizer.params.bias_correction "
        "is false)", run="`parity port --verify` checks this update against DeepSpeed's; compare runs it only with "
        "bias_correction true, a different update")
  if pr.compute_dtype == "fp16" and ported.jax.zero_stage == 0:
    out["fp16_zero_stage0"] = NotRunnable(value={"compute_dtype": "fp16", "zero_stage": 0}, why=MSG_FP16_STAGE0_WHY,
                                          run=MSG_FP16_STAGE0_RUN)
  for k, v in out.items():
    if not v.run:
      out[k] = NotRunnable(value=v.value, why=v.why, run=_RUN_OF.get(k, ""))
  return out


_RUN_OF = {"params_host_memory_kind": "Nearest run compare makes: the same pin_memory on offload_param and "
                                      "offload_optimizer"}
