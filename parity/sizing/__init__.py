"""Memory model and planner: bytes per category and memory kind for each side's plan, and the plan pair that fits.

  memory.py      the per-side memory model (parity estimate), DeepSpeed's own estimators beside it
  memory_jax.py  the JAX side's memory-kind placement sizes
  plans.py       plan pairs (DeepSpeed ZeRO/offload <-> JAX sharding/memory kinds/remat) and the planner (parity plan)
"""
