"""`parity diagnose` on each newer model family's tiny preset: both sides tap the new blocks under the same
names and agree with nothing planted, and a held-out plant in the family's own block is localised to its tensor:
the rotary scaling (llama3-tiny), a q/k/v bias (qwen2-tiny), a q norm weight (qwen3-tiny), the attention soft-cap
(gemma2-tiny), a post-MLP norm weight of a global layer (gemma3-tiny), the window (mistral-tiny)."""
from __future__ import annotations

import pytest

from conftest import requires_jax, requires_torch
from parity import diagnose as dg
from parity.presets import preset

CASES = {
    # preset: (change, the first tensor that must differ)
    "llama3-tiny": ({"perturb": ['torch:model.rope_scaling={"rope_type": "linear", "factor": 2.0}']}, "h.0.attn.q"),
    "qwen2-tiny": ({"plants": ["jax:offset=h.0.attn.qkv.bias"]}, "h.0.attn.q"),
    "qwen3-tiny": ({"plants": ["torch:offset=h.0.attn.ln_q.weight"]}, "h.0.attn.ln_q"),
    "gemma2-tiny": ({"perturb": ["jax:model.attn_softcap=1.0"]}, "h.0.attn.scores_capped"),
    "gemma3-tiny": ({"plants": ["torch:offset=h.2.ln_2_post.weight"]}, "h.2.ln_2_post"),
    "mistral-tiny": ({"perturb": ["torch:model.sliding_window=4"]}, "h.0.attn.probs"),
}


@pytest.mark.process
@pytest.mark.slow
@requires_jax
@requires_torch
@pytest.mark.parametrize("name", sorted(CASES))
def test_family_taps_agree_and_a_plant_is_localised(name, tmp_path):
  matched = dg.diagnose(name, out=tmp_path / "d")
  assert matched.side_status == {"jax": "ok", "torch": "ok"}, matched.message
  assert matched.passed and matched.first is None, matched.message
  assert [t.name for t in matched.tensors] == dg.tap_order(preset(name).model)
  change, expected = CASES[name]
  r = dg.diagnose(run_dir=matched.run_dir, reuse=True, **change)
  assert r.first is not None and r.first.name == expected, r.message
  assert r.exit_code == 1 and r.first.worst_abs_err > r.first.tolerance
  assert all(t.passed for t in r.tensors[:[t.name for t in r.tensors].index(expected)])
