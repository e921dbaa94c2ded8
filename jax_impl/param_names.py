"""The Flax params tree's names that the model (jax_impl.model, jax_impl.layers) and the layout (jax_impl.layout)
share. They live here, below both, because the layout imports the model (to_flax checks its tree against
`GPT.init`): were they in the layout, the model importing them would close an import circle."""
from __future__ import annotations

from typing import Any

__all__ = ["Params", "LAYERS", "NORM_MODULES"]

Params = dict[str, Any]

LAYERS = "h"
"""Module name of the layer-stacked blocks when scan_layers (params leaves carry a leading layer axis)."""

NORM_MODULES = ("ln_1", "ln_2", "ln_f", "ln_q", "ln_k", "ln_1_post", "ln_2_post")
"""Flax module names of the norms (their `weight` is `scale`): the pre-norms, the final norm, the per-head q/k norms
inside `attn` (qk_norm) and the branch-output norms (post_norms)."""
