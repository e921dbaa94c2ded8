"""Orbax save/load of the Flax params pytree, with the ModelSpec stored beside it.

Layout of a checkpoint folder (one orbax Composite checkpoint):

  <dir>/params/      the Flax params pytree (`to_flax` layout), float32, StandardSave
  <dir>/model_spec/  the ModelSpec as JSON (JsonSave), so the folder describes itself

Restoring uses the abstract tree of `GPT(spec).init`, so a checkpoint whose structure or
shapes differ from its own spec is refused by orbax, naming the path.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from parity.spec import ModelSpec, from_dict, to_dict
from jax_impl.model import GPT

__all__ = ["save", "load", "load_spec", "abstract_params", "is_checkpoint"]

Params = dict[str, Any]


def abstract_params(spec: ModelSpec) -> Params:
  """jax.ShapeDtypeStruct tree of `GPT(spec)`'s params (float32), for restoring."""
  shapes = jax.eval_shape(lambda: GPT(spec).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), shapes)


def is_checkpoint(path: str | Path) -> bool:
  """True when `path` looks like a checkpoint written by `save` (has params/ and model_spec/)."""
  p = Path(path)
  return (p / "params").is_dir() and (p / "model_spec").is_dir()


def save(path: str | Path, params: Params, spec: ModelSpec, *, force: bool = False) -> Path:
  """Writes the params pytree and the spec as one orbax checkpoint (synchronously).

  Args:
    path: checkpoint folder; made absolute (orbax requires it).
    params: Flax params pytree, float32 leaves (numpy or jax), matching `GPT(spec)`.
    spec: the model spec.
    force: replace an existing folder.
  Raises:
    ValueError: the tree does not match `GPT(spec)` (paths listed).
    FileExistsError: the folder exists and force is False.
  """
  path = Path(path).absolute()
  want = jax.tree.map(lambda a: tuple(a.shape), abstract_params(spec))
  got = jax.tree.map(lambda a: tuple(np.shape(a)), params)
  if want != got:
    raise ValueError(f"orbax save: params tree does not match GPT(spec).\n got: {got}\nwant: {want}")
  if path.exists() and not force:
    raise FileExistsError(f"{path} exists; pass force=True (CLI: --force) to replace it")
  tree = jax.tree.map(lambda a: np.asarray(a, dtype=np.float32), params)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(path, ocp.args.Composite(params=ocp.args.StandardSave(tree),
                                        model_spec=ocp.args.JsonSave(to_dict(spec))), force=force)
  return path


def load_spec(path: str | Path) -> ModelSpec:
  """The ModelSpec stored in a checkpoint folder.

  Raises:
    FileNotFoundError: not a checkpoint written by `save`.
  """
  path = Path(path).absolute()
  if not is_checkpoint(path):
    raise FileNotFoundError(f"{path}: not a parity orbax checkpoint (expected params/ and model_spec/ inside)")
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    got = ckptr.restore(path, ocp.args.Composite(model_spec=ocp.args.JsonRestore()))
  return from_dict(ModelSpec, got["model_spec"], path="model").validate()


def load(path: str | Path) -> tuple[Params, ModelSpec]:
  """Reads a checkpoint written by `save`.

  Returns:
    (params pytree with float32 numpy leaves, spec).
  Raises:
    FileNotFoundError: not a checkpoint written by `save`.
  """
  path = Path(path).absolute()
  spec = load_spec(path)
  target = abstract_params(spec)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    got = ckptr.restore(path, ocp.args.Composite(params=ocp.args.StandardRestore(target)))
  params = jax.tree.map(lambda a: np.asarray(jax.device_get(a), dtype=np.float32), got["params"])
  return params, spec
