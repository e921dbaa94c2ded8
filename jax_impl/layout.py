"""The canonical (torch) parameter layout <-> the Flax params tree of `jax_impl.model.GPT`.

Canonical names are `parity.weights` names (`h.{i}.attn.qkv.weight`, torch [out, in] layout). In Flax,
block i is module `h_{i}` (or, with scan_layers, one module `LAYERS` whose leaves carry a leading layer
axis), `weight` is `embedding`, `scale` or a transposed `kernel` [in, out]. `to_flax` / `from_flax` are the
only place the two layouts meet; `stack_layers` / `unstack_layers` the only place the unrolled and scanned
layouts meet.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from parity.spec import ModelSpec
from parity.weights import check_names_and_shapes, param_shapes

from jax_impl.param_names import LAYERS, NORM_MODULES, Params  # kept here too; they live below the model

__all__ = ["TRANSPOSED", "LAYERS", "NORM_MODULES", "Params", "flax_path", "tree_from_canonical", "stack_layers",
           "unstack_layers",
           "to_flax", "from_flax"]

TRANSPOSED = ("attn.qkv.weight", "attn.proj.weight", "mlp.fc.weight", "mlp.gate.weight",
              "mlp.up.weight", "mlp.proj.weight", "lm_head.weight")
"""Canonical names (suffixes) of linear weights: [out, in] canonically, Flax `kernel` [in, out]."""

_EMBEDDINGS = ("wte", "wpe")


def flax_path(name: str) -> tuple[tuple[str, ...], bool]:
  """Canonical name -> (path in the Flax params tree, transposed?).

  `h.{i}.X` becomes module `h_{i}`; `weight` becomes `embedding` (wte, wpe), `scale` (norms)
  or `kernel` (linear layers, which are exactly the TRANSPOSED names); `bias` stays `bias`.

  Raises:
    ValueError: the name is not a canonical parameter name.
  """
  parts = name.split(".")
  if parts[0] == "h":
    parts = [f"h_{parts[1]}"] + parts[2:]
  *modules, leaf = parts
  owner = modules[-1] if modules else ""
  if leaf not in ("weight", "bias") or not modules:
    raise ValueError(f"{name!r} is not a canonical parameter name (see parity/weights.py)")
  transposed = name.endswith(TRANSPOSED)
  if leaf == "bias":
    return (*modules, "bias"), False
  if owner in _EMBEDDINGS:
    return (*modules, "embedding"), False
  if owner in NORM_MODULES:
    return (*modules, "scale"), False
  if not transposed:
    raise ValueError(f"{name!r}: unknown weight kind; add it to TRANSPOSED if it is a linear layer")
  return (*modules, "kernel"), True


def tree_from_canonical(values: Mapping[str, Any], *, n_layers: int | None = None) -> Params:
  """Canonical name -> value mapping to the nested Flax dict, values untouched (e.g. masks).

  Args:
    values: canonical name -> any value.
    n_layers: when given, the scan_layers layout: the per-layer values (which must agree across
      layers, e.g. decay-mask bools) appear once under `LAYERS`.
  """
  tree: Params = {}
  for name, value in values.items():
    path, _ = flax_path(name)
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return tree if n_layers is None else stack_layers(tree, n_layers, stack=_same_value)


def _same_value(values: tuple[Any, ...]) -> Any:
  if any(v != values[0] for v in values[1:]):
    raise ValueError(f"per-layer values differ across layers ({values}); they cannot be stacked as one value")
  return values[0]


def stack_layers(tree: Params, n_layers: int, stack: Any = np.stack) -> Params:
  """Unrolled layout (modules h_0 .. h_{L-1}) -> scan layout (one module `LAYERS`, layer axis 0 first).

  The single place where the two layouts meet; `unstack_layers` is its inverse.

  Args:
    tree: Flax params (or any pytree with the params' structure) in the unrolled layout.
    n_layers: L.
    stack: combines the L per-layer leaves (np.stack for arrays: shape (L, *leaf shape)).
  """
  out = {k: v for k, v in tree.items() if not (k.startswith("h_") and k[2:].isdigit())}
  layers = [tree[f"h_{i}"] for i in range(n_layers)]
  out[LAYERS] = jax.tree.map(lambda *xs: stack(xs), *layers)
  return out


def unstack_layers(tree: Params, n_layers: int) -> Params:
  """Scan layout -> unrolled layout (leaf i of layer l = stacked leaf [l]); numpy or jax leaves."""
  out = {k: v for k, v in tree.items() if k != LAYERS}
  for i in range(n_layers):
    out[f"h_{i}"] = jax.tree.map(lambda x, i=i: x[i], tree[LAYERS])
  return out


def _get(tree: Params, path: tuple[str, ...]) -> Any:
  for key in path:
    tree = tree[key]
  return tree


def to_flax(canonical: Mapping[str, np.ndarray], spec: ModelSpec, *, scan_layers: bool = False) -> Params:
  """Canonical float32 weights (torch layout) -> Flax params pytree (numpy leaves, float32).

  Linear weights in TRANSPOSED are transposed [out, in] -> [in, out]; all else is copied. With
  `scan_layers`, the blocks are stacked on a leading layer axis under `LAYERS` (`stack_layers`).
  The result is checked against the structure and shapes of `GPT(spec, scan_layers=...).init`.

  Raises:
    ValueError: a name is missing, unexpected or has the wrong shape, or the tree does not
      match the model's parameters.
  """
  check_names_and_shapes(dict(canonical), spec, source="to_flax")
  arrays = {}
  for name in param_shapes(spec):
    arr = np.asarray(canonical[name], dtype=np.float32)
    arrays[name] = np.ascontiguousarray(arr.T if flax_path(name)[1] else arr)
  tree = tree_from_canonical(arrays)
  if scan_layers:
    tree = stack_layers(tree, spec.n_layers)
  from jax_impl.model import GPT  # the model imports this module
  model = GPT(spec, scan_layers=scan_layers)
  expected = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
  got_shapes = jax.tree.map(lambda a: tuple(a.shape), tree)
  want_shapes = jax.tree.map(lambda a: tuple(a.shape), expected)
  if got_shapes != want_shapes:
    raise ValueError(f"to_flax: mapped tree does not match GPT params.\n got: {got_shapes}\nwant: {want_shapes}")
  return tree


def from_flax(params: Params, spec: ModelSpec, *, scan_layers: bool = False) -> dict[str, np.ndarray]:
  """Flax params pytree (any placement; stacked when scan_layers) -> canonical float32 numpy weights.

  Raises:
    ValueError: a mapped tensor has the wrong shape.
  """
  params = jax.device_get(params)
  if scan_layers:
    params = unstack_layers(params, spec.n_layers)
  out = {}
  for name, shape in param_shapes(spec).items():
    path, transposed = flax_path(name)
    arr = np.asarray(_get(params, path), dtype=np.float32)
    arr = np.ascontiguousarray(arr.T if transposed else arr)
    if arr.shape != shape:
      raise ValueError(f"from_flax: {name} ({'/'.join(path)}) has shape {arr.shape}, expected {shape}")
    out[name] = arr
  return out
