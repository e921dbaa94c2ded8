"""parity.sizing.memory: DeepSpeed's own estimators reproduced exactly, and the per-category model."""
from __future__ import annotations

import contextlib
import io
import itertools
import json

import pytest

from parity.sizing import memory
from parity.hf import MODEL_PRESETS
from parity.presets import preset
from parity.spec import ModelSpec

LLAMA_TINY = ModelSpec(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64,
                       norm="rmsnorm", norm_eps=1e-6, mlp="swiglu", position="rope", bias=False,
                       tie_embeddings=False)
TOTALS = [1, 7, 124_439_808, 1_557_611_200, 6_738_415_616, 68_976_648_192]
LARGEST = [0, 3, 38_597_376, 131_072_000, 1_048_576_000]
GRID = dict(gpus=[1, 2, 8], nodes=[1, 3], buffer=[1.0, 1.5, 2.25])


def _deepspeed():
  pytest.importorskip("torch")
  ds2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
  ds3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
  return ds2, ds3


@pytest.mark.requires_deepspeed
def test_zero2_estimator_equals_deepspeed_exactly():
  ds2, _ = _deepspeed()
  for n, g, nodes, off, buf in itertools.product(TOTALS, GRID["gpus"], GRID["nodes"], (True, False), GRID["buffer"]):
    want = ds2.estimate_zero2_model_states_mem_needs(n, g, nodes, off, buf)
    got = memory.ds_zero2_model_states(n, g, nodes, off, buf)
    assert got == want and all(type(x) is int for x in got), (n, g, nodes, off, buf, got, want)


@pytest.mark.requires_deepspeed
def test_zero3_estimator_equals_deepspeed_exactly():
  _, ds3 = _deepspeed()
  for n, big, g, nodes, off, offp, zi, buf in itertools.product(TOTALS, LARGEST, GRID["gpus"], GRID["nodes"],
                                                                 (True, False), (True, False), (True, False),
                                                                 GRID["buffer"]):
    want = ds3.estimate_zero3_model_states_mem_needs(n, big, g, nodes, off, offp, zi, buf)
    got = memory.ds_zero3_model_states(n, big, g, nodes, off, offp, zi, buf)
    assert got == want, (n, big, g, nodes, off, offp, zi, buf, got, want)


def _printed(fn, *args, **kwargs) -> str:
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    fn(*args, **kwargs)
  return out.getvalue()


@pytest.mark.requires_deepspeed
@pytest.mark.parametrize("name", ["gpt2-124m", "llama-7b", "llama-70b"])
@pytest.mark.parametrize("gpus, nodes, buf", [(1, 1, 1.5), (8, 2, 1.0)])
def test_all_cold_tables_equal_deepspeed_text(name, gpus, nodes, buf):
  ds2, ds3 = _deepspeed()
  spec = MODEL_PRESETS[name]
  n, big = memory.param_count(spec), memory.largest_layer_params(spec)
  assert _printed(ds2.estimate_zero2_model_states_mem_needs_all_cold, n, gpus, nodes, buf) == \
      memory.ds_estimate_table(2, n, 0, gpus, nodes, buf)
  assert _printed(ds3.estimate_zero3_model_states_mem_needs_all_cold, n, big, gpus, nodes, buf) == \
      memory.ds_estimate_table(3, n, big, gpus, nodes, buf)


@pytest.mark.requires_deepspeed
@pytest.mark.parametrize("spec", [preset("gpt2-tiny").model, LLAMA_TINY], ids=["gpt2-tiny", "llama-tiny"])
def test_all_live_counts_and_text_equal_deepspeed_on_a_real_model(spec):
  """DeepSpeed's `model_to_params` on the torch GPT == our counts from the spec, and the printed tables agree."""
  ds2, ds3 = _deepspeed()
  from parity.weights import init_params
  from torch_impl.model import build_model
  model = build_model(spec, init_params(spec, 0))
  assert ds3.model_to_params(model) == (memory.param_count(spec), memory.largest_layer_params(spec))
  assert ds2.model_to_params(model) == memory.param_count(spec)
  n, big = memory.param_count(spec), memory.largest_layer_params(spec)
  assert _printed(ds2.estimate_zero2_model_states_mem_needs_all_live, model, 2, 1) == memory.ds_estimate_table(2, n, 0, 2)
  assert _printed(ds3.estimate_zero3_model_states_mem_needs_all_live, model, 2, 1) == \
      memory.ds_estimate_table(3, n, big, 2)


def test_block_activations_reduce_to_korthikanti_without_dropout():
  """e = 2, MHA, GELU with f = 4h: 32·sbh + 2·as²b (Korthikanti et al. 2022: 34·sbh + 5·as²b with dropout)."""
  s, b, h, a = 128, 3, 256, 8
  spec = ModelSpec(vocab_size=512, d_model=h, n_layers=2, n_heads=a, max_seq_len=s)
  dev, host = memory.block_activation_bytes(spec, b, s, 2, "none")
  assert (dev, host) == (32 * s * b * h + 2 * a * s * s * b, 0)
  assert memory.block_activation_bytes(spec, b, s, 2, "full") == (2 * s * b * h, 0)
  dots_dev, dots_host = memory.block_activation_bytes(spec, b, s, 2, "offload_dots_no_batch")
  assert dots_dev == 2 * s * b * h and dots_host == memory.block_activation_bytes(spec, b, s, 2, "save_dots_no_batch")[0] - dots_dev
  assert memory.block_activation_bytes(spec, b, s, 2, "save_dots")[0] > memory.block_activation_bytes(
      spec, b, s, 2, "save_dots_no_batch")[0]
  with pytest.raises(ValueError, match="remat policy"):
    memory.block_activation_bytes(spec, b, s, 2, "everything")


def test_default_plan_categories_on_gpt2_tiny():
  """ZeRO-2 + CPU offload, fp32, one rank: what torch_impl.memory measured on the worker (tests/test_torch_stages)."""
  run = preset("gpt2-tiny")
  n = memory.param_count(run.model)
  tot = memory.totals(memory.estimate(run, sides=("deepspeed", "jax", "torch")), "deepspeed")
  assert tot["params"] == {"device": 4 * n, "host": 0}
  assert tot["master_params"] == {"device": 0, "host": 4 * n}
  assert tot["optimizer_moments"] == {"device": 0, "host": 8 * n}
  jax = memory.totals(memory.estimate(run, sides=("jax",)), "jax")
  assert jax["optimizer_moments"] == {"device": 0, "host": 8 * n} and jax["params"]["device"] == 4 * n


def test_estimate_cli_json(tmp_path, capsys):
  from parity.cli import main
  out = tmp_path / "e.json"
  assert main(["estimate", "--model", "llama-7b", "--plan", "zero3-offload-all", "--precision", "bf16",
               "--json", str(out)]) == 0
  data = json.loads(out.read_text())
  assert data["total_params"] == 6_738_415_616 and data["deepspeed_estimator"]["gpu_bytes"] == 4 * 131_072_000
  assert "peak device" in capsys.readouterr().out
  assert main(["estimate", "--model", "nope"]) == 2
  assert main(["estimate", "--preset", "gpt2-tiny", "--plan", "nope"]) == 2


def test_predicted_vs_measured_rows():
  run = preset("gpt2-tiny")
  from parity.spec import to_dict
  n = memory.param_count(run.model)
  report = {"run": to_dict(run), "sides": {
      "deepspeed": {"summary": {"state_bytes_by_category": {"params": {"device": 4 * n, "host": 0}},
                                "peak_host_rss_bytes": 7}},
      "jax": {"summary": {"state_bytes_by_memory_kind": {"device": 8 * n, "pinned_host": 8 * n}}}}}
  rows = memory.predicted_vs_measured(report)
  by = {(r["side"], r["category"], r["memory_kind"]): r for r in rows}
  assert by[("deepspeed", "params", "device")]["ratio"] == 1.0
  assert by[("jax", "state", "host")]["measured"] == 8 * n
  assert by[("deepspeed", "peak_rss", "host")] == {"side": "deepspeed", "category": "peak_rss", "memory_kind": "host",
                                                   "predicted": None, "measured": 7, "ratio": None}
