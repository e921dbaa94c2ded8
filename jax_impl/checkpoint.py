"""Orbax checkpoints: the Flax params with their ModelSpec, and the whole training state.

Weights (`save` / `load`), one orbax Composite checkpoint:

  <dir>/params/      the Flax params pytree (`to_flax` layout), float32, StandardSave
  <dir>/model_spec/  the ModelSpec as JSON (JsonSave), so the folder describes itself

Restoring uses the abstract tree of `GPT(spec).init`, so a checkpoint whose structure or
shapes differ from its own spec is refused by orbax, naming the path.

Training state (`save_train_state` / `restore_train_state`), for checkpoint/resume in the run
protocol (`parity.protocol`: save_checkpoint_at_step, resume_from):

  <dir>/state/       the whole `TrainState` pytree (StandardSave): params, and the optimizer state
                     with everything in it: the clip transform's last norm, Adam's count, mu and nu,
                     the schedule's count, and any loss-scale state a precision mode adds to the tree

It is restored into the live state's own tree (structure, shapes, dtypes) with the trainer's
shardings, so every leaf comes back in its plan's memory kind (`pinned_host` for offloaded
groups) and sharding; `restore_train_state` checks that, leaf by leaf. The restored state is
bit-identical to the saved one, so a resumed run continues exactly as the uninterrupted run.
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

__all__ = ["save", "load", "load_spec", "abstract_params", "is_checkpoint", "save_train_state",
           "restore_train_state", "STATE_DIR"]

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


STATE_DIR = "state"
"""Subfolder of a training-state checkpoint holding the orbax TrainState."""


def save_train_state(folder: str | Path, state: Any) -> dict[str, Any]:
  """Writes the whole training state (a pytree of jax Arrays) to `<folder>/state/`, synchronously.

  Host transfers happen here (device and pinned_host arrays are read to host memory), so the
  caller runs it outside `jax.transfer_guard("disallow")`.

  Args:
    folder: an existing (empty) checkpoint folder; made absolute (orbax requires it).
    state: the live TrainState (params and optimizer state), any shardings and memory kinds.
  Returns:
    Fields for the checkpoint's meta.json: format, state folder, leaf count, bytes by memory kind.
  """
  path = Path(folder).absolute() / STATE_DIR
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, state)
    ckptr.wait_until_finished()
  kinds: dict[str, int] = {}
  for x in jax.tree.leaves(state):
    kind = getattr(x.sharding, "memory_kind", None) or "device"
    kinds[kind] = kinds.get(kind, 0) + int(x.nbytes)
  return {"format": "orbax.StandardCheckpointer(TrainState)", "orbax": ocp.__version__, "state_dir": STATE_DIR,
          "leaves": len(jax.tree.leaves(state)), "state_bytes_by_memory_kind": kinds}


def _placement_problems(state: Any, shardings: Any) -> list[str]:
  """'path: got X, want Y' for every leaf whose sharding or memory kind differs from `shardings`."""
  problems = []
  got = jax.tree_util.tree_flatten_with_path(state)[0]
  want = jax.tree.leaves(shardings)
  for (path, x), s in zip(got, want):
    name = jax.tree_util.keystr(path)
    kind, want_kind = getattr(x.sharding, "memory_kind", None), getattr(s, "memory_kind", None)
    if kind != want_kind:
      problems.append(f"{name}: memory kind {kind!r}, want {want_kind!r}")
    elif not x.sharding.is_equivalent_to(s, x.ndim):
      problems.append(f"{name}: sharding {x.sharding}, want {s}")
  return problems


def restore_train_state(folder: str | Path, like: Any, shardings: Any) -> Any:
  """Reads `<folder>/state/` into a TrainState with the structure of `like` and the given shardings.

  Args:
    folder: a checkpoint folder written by `save_train_state`.
    like: the live TrainState of a freshly built trainer for the same run (structure, shapes and
      dtypes of the target; its values are not read).
    shardings: the trainer's TrainState of shardings (`Trainer.shardings`), memory kinds included.
  Returns:
    The restored TrainState: every leaf with its sharding and memory kind from `shardings`.
  Raises:
    FileNotFoundError: `<folder>/state/` is missing.
    ValueError: the saved tree differs from `like` (another model, optimizer or precision mode;
      orbax's message names the paths).
    RuntimeError: a restored leaf is not in its planned memory kind or sharding.
  """
  path = Path(folder).absolute() / STATE_DIR
  if not path.is_dir():
    raise FileNotFoundError(f"{path}: no orbax training state (save_train_state writes it)")
  target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), like, shardings)
  try:
    with ocp.StandardCheckpointer() as ckptr:
      state = ckptr.restore(path, target)
  except (ValueError, KeyError, TypeError) as exc:
    raise ValueError(f"{path}: the saved training state does not fit this run's state tree "
                     f"(another model, optimizer or precision mode?): {exc}") from exc
  if jax.tree.structure(state) != jax.tree.structure(like):
    raise ValueError(f"{path}: orbax restored a tree of another structure than this run's state:\n"
                     f" got: {jax.tree.structure(state)}\nwant: {jax.tree.structure(like)}")
  misplaced = _placement_problems(state, shardings)
  if misplaced:  # orbax placed a leaf elsewhere: move it where the plan wants it, then check again
    state = jax.device_put(state, shardings)
    misplaced = _placement_problems(state, shardings)
  if misplaced:
    raise RuntimeError(f"{path}: restored state is not where the plan puts it: " + "; ".join(misplaced[:8]))
  return state
