"""Padded/packed runs' inputs: TrainSpec's layout fields, the run folder's example arrays, the data card
in the request, and the loss-normalization perturbation. In-process, with the real contract code (prepare_run_dir)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from parity.data import batch_dtype
from parity.errors import SpecError
from parity.pipeline.claim import RUN_INPUTS, RunFolderError
from parity.pipeline.examples_input import EXAMPLE_ARRAYS, EXAMPLE_INPUTS, VAL_ARRAYS
from parity.pipeline.folder import parse_perturb, prepare_run_dir
from parity.pipeline.perturb import plan_perturbations
from parity.presets import preset
from parity.overrides import apply_overrides
from parity.spec import config_hash, to_dict


def _spec(**overrides):
  return apply_overrides(preset("sft-tiny"), {"train.steps": 2, "train.eval_every": 2, **overrides}).validate()


@pytest.mark.parametrize("overrides, needle", [
    ({"train.layout": "padded", "data": "stdlib"}, "train.layout='padded' needs example data"),
    ({"train.layout": "stream"}, "is example data"),
    ({"train.layout": "rows"}, "train.layout must be"),
    ({"train.loss_normalization": "mean"}, "train.loss_normalization must be"),
    ({"train.truncation": "drop"}, "train.truncation must be"),
    ({"train.examples_per_step": 0}, "train.examples_per_step must be"),
    ({"train.layout": "stream", "data": "stdlib", "train.examples_per_step": 4}, "padded and packed layouts only"),
])
def test_layout_settings_are_validated_naming_the_key(overrides, needle):
  with pytest.raises(SpecError, match=needle):
    apply_overrides(preset("sft-tiny"), overrides).validate()


def test_the_new_fields_at_their_defaults_keep_the_config_hash_of_earlier_runs():
  spec = preset("gpt2-tiny")
  assert to_dict(spec)["train"]["layout"] == "stream"
  # the hash main computed for gpt2-tiny before the fields existed (gate baselines and checkpoints carry it)
  assert config_hash(spec) == "0e0bcdb5fc278b56"
  assert config_hash(apply_overrides(spec, {"train.truncation": "split"})) != config_hash(spec)


def test_a_padded_run_folder_holds_the_arrays_the_request_names(tmp_path):
  spec = _spec()
  prep = prepare_run_dir(spec, tmp_path / "run")
  req = json.loads((tmp_path / "run" / "request.json").read_text())
  t = spec.train
  assert req["examples"]["layout"] == "padded" and req["examples"]["arrays"] == EXAMPLE_ARRAYS
  assert req["examples"]["val_arrays"] == VAL_ARRAYS and req["examples"]["examples_per_step"] >= 1
  tokens = np.load(tmp_path / "run" / "batches.npy")
  assert tokens.shape == (t.steps, t.grad_accum_steps, t.micro_batch_size, t.seq_len + 1)
  assert tokens.dtype == batch_dtype(spec.model.vocab_size)
  for name, dtype in (("loss_mask", bool), ("segment_ids", np.int32), ("positions", np.int32)):
    arr = np.load(tmp_path / "run" / EXAMPLE_ARRAYS[name])
    assert arr.shape == tokens.shape[:-1] + (t.seq_len,) and arr.dtype == dtype
    val = np.load(tmp_path / "run" / VAL_ARRAYS[name])
    assert val.shape == (t.eval_batches, t.micro_batch_size, t.seq_len) and val.dtype == dtype
  mask = np.load(tmp_path / "run" / "loss_mask.npy")
  card = prep["request"]["data"]["card"]
  assert card["layout"] == "padded" and card["loss_tokens_per_step"] == [int(x) for x in mask.sum(axis=(1, 2, 3))]
  assert set(EXAMPLE_INPUTS) <= set(RUN_INPUTS)  # a later run refuses a folder holding them
  with pytest.raises(RunFolderError):
    prepare_run_dir(spec, tmp_path / "run")


def test_a_jsonl_of_pretokenized_examples_is_packed(tmp_path):
  rng = np.random.default_rng(0)
  path = tmp_path / "ex.jsonl"
  rows = [{"input_ids": rng.integers(0, 200, int(n)).tolist(), "labels": None} for n in rng.integers(5, 40, 40)]
  for r in rows:
    r["labels"] = [-100] * 3 + r["input_ids"][3:]
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  spec = _spec(**{"train.layout": "packed", "data": str(path)})
  prep = prepare_run_dir(spec, tmp_path / "run")
  seg = np.load(tmp_path / "run" / "segment_ids.npy")
  assert seg.max() > 1  # several examples in a row
  card = prep["request"]["data"]["card"]
  assert card["source"] == str(path) and card["examples"] == 40 and card["layout"] == "packed"


def test_loss_normalization_is_perturbable_on_examples_and_refused_on_a_stream():
  plan = plan_perturbations(_spec(), parse_perturb(["torch:train.loss_normalization=micro_mean"], ["jax", "torch"],
                                                   _spec()))
  assert plan.perturb == {"torch": {"train.loss_normalization": "micro_mean"}}
  stream = preset("gpt2-tiny")
  with pytest.raises(SpecError, match="same number of loss tokens"):
    plan_perturbations(stream, parse_perturb(["torch:train.loss_normalization=micro_mean"], ["jax", "torch"], stream))


def test_derived_reruns_read_the_parents_arrays_and_the_noise_rerun_reverses_them(tmp_path):
  from harness.self_runs import NOISE_DIR, _reverse_example_arrays, reversed_batches
  from parity.protocol import derive_request
  from parity.protocol.side import SideIO
  run = tmp_path / "run"
  prepare_run_dir(_spec(), run)
  sub = derive_request(run, "repeat", stop_after_step=0).parent
  req = json.loads((sub / "request.json").read_text())
  assert req["examples"]["arrays"]["segment_ids"] == "../segment_ids.npy"
  io = SideIO(sub / "request.json", "torch")
  batches, val = io.training_batches()
  arrays, val_arrays = io.example_arrays(1.0, batches.shape, val.shape)
  assert np.array_equal(arrays.segment_ids, np.load(run / "segment_ids.npy"))
  noise = derive_request(run, NOISE_DIR, batches="batches.npy").parent
  np.save(noise / "batches.npy", reversed_batches(np.load(run / "batches.npy")))
  _reverse_example_arrays(run, noise)
  io = SideIO(noise / "request.json", "torch")
  batches, val = io.training_batches()
  arrays, _ = io.example_arrays(1.0, batches.shape, val.shape)
  assert np.array_equal(arrays.positions, reversed_batches(np.load(run / "positions.npy")))
  assert np.array_equal(np.asarray(batches), reversed_batches(np.load(run / "batches.npy")))


def test_layout_refusals_name_the_data_file_and_negative_ids_get_their_own_fix(tmp_path):
  """A refusal from the layout (too few examples to hold one out, a step without loss tokens) names the file it came
  from, and a negative id says what it likely is rather than suggesting a larger vocabulary."""
  from parity.data import DataError
  from parity.pipeline.examples_input import _lay_out, read_run_examples
  one = tmp_path / "single.jsonl"
  one.write_text(json.dumps({"input_ids": [1, 2, 3, 4]}) + "\n")
  spec = _spec(data=str(one))
  with pytest.raises(DataError, match=r"data '.*single.jsonl': 1 example\(s\) cannot be split"):
    _lay_out(read_run_examples(spec, None), spec, 1)
  neg = tmp_path / "neg.jsonl"
  neg.write_text(json.dumps({"input_ids": [1, -100, 3]}) + "\n" + json.dumps({"input_ids": [1, 2, 3]}) + "\n")
  with pytest.raises(DataError, match=r"token id -100 at position 1 is negative .*labels") as exc:
    read_run_examples(_spec(data=str(neg)), None)
  assert "model.vocab_size" not in str(exc.value)
