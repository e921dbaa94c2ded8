"""JAX/Flax side of parity: model.py, optim.py, offload.py, step.py, side.py (the Side), worker.py.

Nothing is imported here on purpose: `python -m jax_impl.worker` imports this package
first, and the worker must set XLA_PYTHON_CLIENT_PREALLOCATE before jax is imported.
Import the modules directly (`from jax_impl import step`).
"""
