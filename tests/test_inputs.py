"""Every input that reaches a parser is refused by name with exit 2 (no traceback, no
hang, no allocation), and user paths resolve as users expect (relative to the cwd, or to the config file)."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from parity import cli, data, hf, inputs, weights
from parity.sizing import resources
import parity.cli.sizing  # noqa: F401  (cli.sizing: the presets command the tests patch)
from parity.inputs import InputError
from parity.migrate import read_deepspeed_config
from parity.migrate._read import PortError
from parity.pipeline.resolve import resolve
from parity.presets import PRESETS
from parity.spec import SpecError

from conftest import requires_torch

DEEP = 5000


def _main(argv, capsys):
  code = cli.main(argv)
  err = capsys.readouterr().err
  assert "Traceback" not in err
  return code, err


# ----------------------------------------------------------------------------- item 9: config files


@pytest.mark.parametrize("name,blob,match", [
    ("bin.yaml", b"\x89PNG\r\n\x1a\n\x00\x00IHDR", "is binary"),
    ("latin1.yaml", "train:\n  lr: 0.001  # caf\xe9\n".encode("latin-1"), "not UTF-8 text .byte 0xe9"),
    ("utf16.json", '{"train": {"lr": 0.001}}'.encode("utf-16"), "binary|not UTF-8"),
])
def test_binary_and_non_utf8_config_files_are_refused_naming_the_file(tmp_path, capsys, name, blob, match):
  f = tmp_path / name
  f.write_bytes(blob)
  with pytest.raises(SpecError, match=match):
    resolve("gpt2-tiny", config=f)
  with pytest.raises(PortError, match=match):  # `parity port` and --deepspeed-config read through the same rule
    read_deepspeed_config(f)
  code, err = _main(["port", str(f)], capsys)
  assert code == 2 and str(f) in err and err.count("\n") == 1


@pytest.mark.parametrize("suffix,text", [
    (".json", "{\"a\": " * DEEP + "1" + "}" * DEEP),
    (".hjson", "{\"a\": " * DEEP + "1" + "}" * DEEP),
    (".yaml", "a: " + "[" * DEEP + "]" * DEEP + "\n"),
])
def test_deep_nesting_is_refused_not_a_recursion_error(tmp_path, suffix, text):
  f = tmp_path / f"deep{suffix}"
  f.write_text(text)
  with pytest.raises(SpecError, match="nested too deeply"):
    resolve("gpt2-tiny", config=f)
  with pytest.raises(InputError, match="nesting deeper than 100"):  # under the parser's limit, over ours
    inputs.check_tree(json.loads("[" * 150 + "]" * 150), "x")


def test_oversized_config_file_is_refused_before_reading(tmp_path):
  f = tmp_path / "huge.yaml"
  f.write_bytes(b"#" * (inputs.MAX_TEXT_BYTES + 1))
  with pytest.raises(SpecError, match="over the 16,777,216-byte limit"):
    resolve("gpt2-tiny", config=f)


@pytest.mark.parametrize("name,text,match", [
    ("inf.json", '{"train": {"lr": 1e400}}', "too large for a float"),
    ("inf.yaml", "train:\n  lr: 1e400\n", "train.lr = 1e400: must be a finite number"),
    ("dotinf.yaml", "train:\n  lr: .inf\n", "train.lr is inf"),
    ("nan.yaml", "train:\n  eps: .nan\n", "train.eps is nan"),
    ("steps.yaml", "train:\n  steps: 100000000000000000000000\n", "steps.yaml: train.steps = 10{23} is out of range"),
    ("seed.json", '{"train": {"seed": 100000000000000000000000}}', "seed.json: train.seed = 10{23} is out of range"),
    ("mb.yaml", "train:\n  micro_batch_size: 1e12\n", "train.micro_batch_size = 1000000000000 is out of range"),
    ("sched.json", '{"train": {"lr_schedule_params": {"warmup_max_lr": 1e400}}}', "too large for a float"),
])
def test_numbers_that_overflow_are_refused_naming_file_and_key(tmp_path, name, text, match):
  f = tmp_path / name
  f.write_text(text)
  with pytest.raises(SpecError, match=match):
    resolve("gpt2-tiny", config=f)


@pytest.mark.parametrize("override,match", [
    ("train.lr=1e400", "override 'train.lr': value is inf .* every number must be finite"),
    ("train.eps=NaN", "override 'train.eps': value is nan"),
    ("timeout_s=1e400", "override 'timeout_s': value is inf"),
    ("model.norm_eps=-Infinity", "override 'model.norm_eps': value is -inf"),
    ('train.lr="1e400"', "train.lr = 1e400: must be a finite number"),  # a string: caught where it is coerced
    ("train.steps=1e23", "train.steps = .* is out of range"),
    ("train.data_seed=" + "9" * 30, "train.data_seed = 9{30} is out of range"),
    ("train.lr=1" + "0" * 400, "train.lr: expected a finite number"),
    ("train.lr_schedule_params={\"x\": [1e999]}", r"train.lr_schedule_params': x\[0\] is inf"),
])
def test_every_numeric_field_must_be_finite_and_in_range(override, match):
  with pytest.raises(SpecError, match=match):
    resolve("gpt2-tiny", overrides=[override])


def test_numeric_rule_holds_for_specs_built_in_python():
  import dataclasses
  base = PRESETS["gpt2-tiny"]
  with pytest.raises(SpecError, match="train.lr = inf"):
    dataclasses.replace(base, train=dataclasses.replace(base.train, lr=float("inf"))).validate()
  with pytest.raises(SpecError, match="model.rope_theta = nan"):
    dataclasses.replace(base, model=dataclasses.replace(base.model, rope_theta=float("nan"))).validate()


def test_exponent_notation_integers_are_accepted_when_integral():
  assert resolve("gpt2-tiny", overrides=['train.steps="1e1"']).train.steps == 10
  with pytest.raises(SpecError, match="expected an integer"):
    resolve("gpt2-tiny", overrides=['train.steps="1.5"'])


# ----------------------------------------------------------------------------- item 9: sizes


@pytest.mark.parametrize("argv,match", [
    (["--steps", "2e9"], r"batches.npy 0.528 TB \(train.steps=2000000000"),
    (["--set", "train.micro_batch_size=100000000"], "micro_batch_size=100000000"),
    (["--set", "model.n_layers=1e7"], "499,840,020,608 params"),
    (["--set", "model.vocab_size=4000000", "--set", "model.d_model=65536", "--set", "model.n_heads=1"],
     "vocab_size=4000000"),
])
def test_sizes_that_cannot_fit_are_refused_before_allocating(tmp_path, capsys, monkeypatch, argv, match):
  monkeypatch.setattr(resources, "available_memory_bytes", lambda: 64 * 2**30)  # the same answer on every machine
  out = tmp_path / "run"
  code, err = _main(["compare", "--preset", "gpt2-tiny", "--sides", "jax,torch", "--out", str(out), *argv], capsys)
  assert code == 2, err
  assert "the run needs ~" in err and "--allow-large" in err
  assert __import__("re").search(match, err), err
  assert not out.exists()  # refused before the run folder (or any array) exists


def test_resource_estimate_is_exact_for_batches_and_params():
  spec = PRESETS["gpt2-tiny"]
  r = resources.estimate_resources(spec)
  t = spec.train
  assert r.params == weights.n_params(spec.model)
  train, val = data.make_batches(data.load_corpus("stdlib"), steps=t.steps, grad_accum_steps=t.grad_accum_steps,
                                 micro_batch_size=t.micro_batch_size, seq_len=t.seq_len, seed=t.data_seed,
                                 eval_batches=t.eval_batches)
  assert abs(r.batches_bytes - (train.nbytes + val.nbytes)) <= 128  # + the two .npy headers
  assert r.memory_bytes < resources.available_memory_bytes()  # the tiny preset itself is never refused


def test_allow_large_lets_a_run_past_the_check(monkeypatch):
  import dataclasses
  base = PRESETS["gpt2-tiny"]
  big = dataclasses.replace(base, train=dataclasses.replace(base.train, steps=2 * 10**9))
  monkeypatch.setattr(resources, "available_memory_bytes", lambda: 2**30)
  with pytest.raises(InputError, match="the run needs"):
    resources.check_resources(big, "/tmp")
  monkeypatch.setenv(resources.ALLOW_LARGE_ENV, "1")
  assert resources.check_resources(big, "/tmp").batches_bytes == 528_000_000_000 + 656


def test_make_batches_is_unchanged_by_chunking(monkeypatch):
  corpus = data.load_corpus("stdlib", max_bytes=200_000)
  kw = dict(steps=7, grad_accum_steps=3, micro_batch_size=5, seq_len=16, seed=3, eval_batches=2)
  whole, _ = data.make_batches(corpus, **kw)
  rng = np.random.default_rng(3)  # the original one-shot gather
  starts = rng.integers(0, corpus.train.size - 17, size=(7, 3, 5))
  assert np.array_equal(whole, corpus.train[starts[..., None] + np.arange(17)].astype(np.uint16))
  monkeypatch.setattr(data, "_CHUNK_TOKENS", 40)  # 2 windows per chunk
  assert np.array_equal(data.make_batches(corpus, **kw)[0], whole)


# ----------------------------------------------------------------------------- item 9: safetensors, HF index


def _st(path, header: dict | bytes, data: bytes = b"", length: int | None = None):
  blob = header if isinstance(header, bytes) else json.dumps(header).encode()
  path.write_bytes(struct.pack("<Q", len(blob) if length is None else length) + blob + data)
  return path


@pytest.mark.parametrize("kind,match", [
    ("short", "shorter than its 8-byte header length"),
    ("oversized", "header length 1,099,511,627,776 bytes exceeds the file"),
    ("truncated", "header length .* exceeds the file"),
    ("not_json", "header is not valid JSON"),
    ("not_object", "header must be a JSON object"),
    ("no_dtype", r"tensor 'w' has no \['dtype'\]"),
    ("bad_offsets", r"bytes \[0, 400\) do not hold shape \(10, 10\)"),
    ("past_end", "do not hold shape"),
    ("bad_dtype", "has dtype 'Q7'"),
    ("neg_shape", "has shape"),
])
def test_bad_safetensors_are_refused_by_every_reader(tmp_path, kind, match):
  f = tmp_path / "w.safetensors"
  good = {"w": {"dtype": "F32", "shape": [10, 10], "data_offsets": [0, 400]}}
  if kind == "short":
    f.write_bytes(b"\x01\x02")
  elif kind == "oversized":
    _st(f, good, b"\0" * 400, length=2**40)
  elif kind == "truncated":
    raw = json.dumps(good).encode()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw[:10])
  elif kind == "not_json":
    _st(f, b"\xff\xfe{not json", b"")
  elif kind == "not_object":
    _st(f, b"[1, 2]")
  elif kind == "no_dtype":
    _st(f, {"w": {"shape": [10, 10], "data_offsets": [0, 400]}}, b"\0" * 400)
  elif kind == "bad_offsets":
    _st(f, good, b"\0" * 100)
  elif kind == "past_end":
    _st(f, {"w": {"dtype": "F32", "shape": [10, 10], "data_offsets": [400, 800]}}, b"\0" * 400)
  elif kind == "bad_dtype":
    _st(f, {"w": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)
  else:
    _st(f, {"w": {"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 16]}}, b"\0" * 16)
  for reader in (weights.load, hf.read_safetensors, lambda p: hf.load_canonical(p, PRESETS["gpt2-tiny"].model)):
    with pytest.raises(ValueError, match=match):  # InputError / HFFormatError: both ValueErrors -> exit 2
      reader(f)


def _hf_folder(tmp_path):
  from parity.hf import save_hf_checkpoint
  spec = hf.spec_from_hf_config({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 64,
                                 "n_positions": 32, "n_embd": 32, "n_layer": 1, "n_head": 2})
  folder = save_hf_checkpoint(tmp_path / "hf", spec, weights.init_params(spec, 0))
  return folder


@pytest.mark.parametrize("weight_map,match", [
    ([1, 2], "'weight_map' must be a non-empty mapping"),
    ("model.safetensors", "'weight_map' must be a non-empty mapping"),
    ({}, "'weight_map' must be a non-empty mapping"),
    ({"transformer.wte.weight": "../../etc/passwd"}, "is not a shard file name"),
    ({"transformer.wte.weight": 7}, "is not a shard file name"),
    ({"transformer.wte.weight": "model-00001-of-00002.safetensors"}, "names missing shard"),
])
def test_hf_index_with_bad_weight_map_is_refused(tmp_path, capsys, weight_map, match):
  folder = _hf_folder(tmp_path)
  (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
  (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
  with pytest.raises((ValueError, FileNotFoundError), match=match):
    hf.load_hf_checkpoint(folder)
  code, err = _main(["convert-weights", str(folder), str(tmp_path / "o.safetensors")], capsys)
  assert code == 2 and "index" in err


def test_hf_config_json_binary_or_deep_is_refused(tmp_path):
  folder = _hf_folder(tmp_path)
  (folder / "config.json").write_bytes(b"\x00\x01\x02")
  with pytest.raises(ValueError, match="HF config .*config.json is binary"):
    hf.load_hf_checkpoint(folder)
  (folder / "config.json").write_text("[" * DEEP + "]" * DEEP)
  with pytest.raises(ValueError, match="nested too deeply"):
    hf.load_hf_checkpoint(folder)


# ----------------------------------------------------------------------------- item 9: report.json, CLI errors


def _report(tmp_path, **drop):
  d = {"schema": "parity.report/3", "verdict": {"passed": True, "message": "PASS"}, "checks": [],
       "sides": {"jax": {"status": "ok", "summary": {}, "series": {"loss": [1.0], "val_loss": []}}}}
  for k in drop:
    d.pop(k)
  (tmp_path / "report.json").write_text(json.dumps(d))
  return tmp_path


@pytest.mark.parametrize("section", ["verdict", "sides", "checks"])
def test_report_missing_a_section_is_refused_by_name(tmp_path, capsys, section):
  code, err = _main(["report", str(_report(tmp_path, **{section: True}))], capsys)
  assert code == 2 and f"'{section}'" in err and err.startswith("parity report: error:")


def test_report_with_all_sections_but_no_records_is_unverified(tmp_path, capsys):
  """The four sections load_report needs and nothing else (a forged minimal report saying PASS): readable, so not
  exit 2, but UNVERIFIED (exit 1), never PASS (real folders in test_report_verify.py)."""
  code, err = _main(["report", str(_report(tmp_path))], capsys)
  assert code == 1 and "UNVERIFIED" in err and "records no 'artifacts'" in err


def test_report_binary_or_absent(tmp_path, capsys):
  (tmp_path / "report.json").write_bytes(b"\x00\xff")
  code, err = _main(["report", str(tmp_path)], capsys)
  assert code == 2 and "binary" in err
  code, err = _main(["report", str(tmp_path / "nope")], capsys)
  assert code == 2 and "is not a folder" in err


def test_unexpected_exception_is_one_line_and_exit_1_with_the_traceback_saved(monkeypatch, capsys):
  def boom(args):
    raise RuntimeError("a bug")
  monkeypatch.setattr(cli.sizing, "run_presets", boom)
  code, err = _main(["presets"], capsys)
  assert code == 1 and err.count("\n") == 1 and "internal error: RuntimeError: a bug" in err
  saved = err.split("traceback saved to ")[1].split(";")[0]
  assert "Traceback" in open(saved).read()
  __import__("os").remove(saved)


def test_an_input_error_of_any_module_is_exit_2(monkeypatch, capsys):
  """The project's input errors (parity.errors.ParityInputError) are bad input; a plain ValueError no longer is
  (tests/test_cli.py: it is an internal error, exit 1)."""
  from parity.errors import ParityInputError
  def bad(args):
    raise ParityInputError("bad value for key x")
  monkeypatch.setattr(cli.sizing, "run_presets", bad)
  code, err = _main(["presets"], capsys)
  assert code == 2 and err == "parity presets: error: bad value for key x\n"


# ----------------------------------------------------------------------------- item 10: relative paths


def test_data_in_a_config_file_resolves_relative_to_the_config(tmp_path, monkeypatch):
  (tmp_path / "cfg").mkdir()
  (tmp_path / "cfg" / "corpus.txt").write_text("hello world " * 100)
  (tmp_path / "cfg" / "run.yaml").write_text("data: corpus.txt\n")
  monkeypatch.chdir(tmp_path)  # elsewhere than the config's folder
  spec = resolve("gpt2-tiny", config="cfg/run.yaml")
  assert spec.data == str(tmp_path / "cfg" / "corpus.txt")
  (tmp_path / "cfg" / "bad.yaml").write_text("data: nothere.txt\n")
  with pytest.raises(data.DataError, match=f"relative to the config file's folder {tmp_path / 'cfg'}"):
    resolve("gpt2-tiny", config="cfg/bad.yaml")


def test_data_flag_resolves_relative_to_the_current_directory(tmp_path, monkeypatch):
  (tmp_path / "c.txt").write_text("x" * 1000)
  monkeypatch.chdir(tmp_path)
  assert resolve("gpt2-tiny", data="c.txt").data == str(tmp_path / "c.txt")
  assert resolve("gpt2-tiny", overrides=["data=c.txt"]).data == str(tmp_path / "c.txt")
  assert resolve("gpt2-tiny").data == "stdlib"


@pytest.mark.process
@requires_torch
def test_relative_hf_folder_with_pytorch_model_bin_is_read(tmp_path, monkeypatch):
  import torch
  from parity.hf import convert
  folder = _hf_folder(tmp_path)
  tensors, _ = hf.read_safetensors(folder / "model.safetensors")
  torch.save({k: torch.from_numpy(v.copy()) for k, v in tensors.items()}, folder / "pytorch_model.bin")
  (folder / "model.safetensors").unlink()
  monkeypatch.chdir(tmp_path)  # the worker runs from the repository root; the path must reach it absolute
  spec, init = hf.run_spec_from_hf("hf", PRESETS["gpt2-tiny"], bin_reader=convert.read_bin)
  assert spec.model.n_layers == 1
  for k, v in hf.hf_to_canonical(tensors, spec.model, "gpt2").items():
    np.testing.assert_array_equal(init[k], v)


@pytest.mark.parametrize("argv,match", [
    (["compare", "--timeout", "1e400"], "--timeout 1e400: must be a finite number"),
    (["compare", "--timeout", "nan"], "--timeout nan: must be a finite number"),
    (["compare", "--steps", "99999999999"], "--steps 99999999999: out of range"),
    (["plan", "--host-memory", "1e999"], "--host-memory 1e999: must be a finite number"),
])
def test_every_numeric_flag_of_every_command_is_finite_and_in_range(capsys, argv, match):
  with pytest.raises(SystemExit) as exc:
    cli.main(argv)
  assert exc.value.code == 2 and match in capsys.readouterr().err


def test_pipes_and_devices_are_refused_not_read(tmp_path):
  import os
  fifo = tmp_path / "cfg.yaml"
  os.mkfifo(fifo)  # reading it would block forever
  with pytest.raises(SpecError, match="not a regular file"):
    resolve("gpt2-tiny", config=fifo)
  with pytest.raises(data.DataError, match="not a regular file or folder"):
    data.load_corpus("/dev/zero")  # reading it would never end


def test_diagnose_reuse_reads_request_json_through_the_safe_reader(tmp_path):
  from parity.diagnose import diagnose
  (tmp_path / "request.json").write_text('{"run": {"train": {"lr": 1e400}}}')
  with pytest.raises(SpecError, match="too large for a float"):
    diagnose(run_dir=tmp_path, reuse=True)
  (tmp_path / "request.json").write_text('{"schema": "x"}')
  with pytest.raises(SpecError, match="has no 'run' section"):
    diagnose(run_dir=tmp_path, reuse=True)


def test_hf_config_claiming_far_more_layers_than_the_weights_is_refused_before_listing_them(tmp_path):
  folder = _hf_folder(tmp_path)
  cfg = json.loads((folder / "config.json").read_text())
  # 10^4 layers: small enough to pass the memory bound (10^7 is refused by it first: tests/test_hf_config.py)
  (folder / "config.json").write_text(json.dumps({**cfg, "n_layer": 10**4}))
  with pytest.raises(ValueError, match="describes a model of 120,004 tensors .n_layers=10000., but the weight "
                                       "files hold 16"):
    hf.load_hf_checkpoint(folder)
  assert resources.tensor_count(PRESETS["gpt2-tiny"].model) == len(weights.param_shapes(PRESETS["gpt2-tiny"].model))


def test_set_and_perturb_values_go_through_the_same_parser_rules():
  from parity.pipeline.folder import parse_perturb
  deep = "[" * DEEP + "]" * DEEP
  with pytest.raises(SpecError, match="override 'train.lr_schedule_params': nested too deeply"):
    resolve("gpt2-tiny", overrides=[f"train.lr_schedule_params={deep}"])
  with pytest.raises(SpecError, match="--perturb .*nested too deeply"):
    parse_perturb([f"jax:train.lr_schedule_params={deep}"], ["jax", "torch"])
  with pytest.raises(SpecError, match="value is nan"):
    parse_perturb(["jax:train.lr=NaN"], ["jax", "torch"])
  assert parse_perturb(["jax:train.lr_schedule=Constant"],
                       ["jax", "torch"]) == {"jax": {"train.lr_schedule": "Constant"}}


# ----------------------------------------------------------------------------- YAML aliases, empty and non-finite


def _alias_bomb(path, levels: int):
  lines, prev = ["w: &w [1, 2, 3, 4, 5, 6, 7, 8, 9]"], "w"
  for i in range(levels):
    lines.append(f"l{i}: &l{i} [" + ", ".join([f"*{prev}"] * 9) + "]")
    prev = f"l{i}"
  path.write_text("\n".join(lines) + "\n")
  return path


def test_yaml_alias_bomb_is_refused_at_once(tmp_path, capsys):
  """9 levels of 9 aliases (9^9 values from ~400 characters) -> bad input naming the file, within seconds (the
  values walked are capped by the text's length), from the parser and from `parity compare --config`."""
  import time
  bomb = _alias_bomb(tmp_path / "bomb.yaml", 9)
  t0 = time.time()
  with pytest.raises(InputError, match="alias"):
    inputs.parse_text(bomb.read_text(), str(bomb), "yaml")
  assert time.time() - t0 < 2.0
  code, err = _main(["compare", "--config", str(bomb), "--out", str(tmp_path / "run"), "--steps", "4"], capsys)
  assert code == 2 and str(bomb) in err and "alias" in err, err
  assert not (tmp_path / "run").exists()


def test_aliases_that_do_not_expand_past_the_text_still_load():
  """The rule refuses expansion, not aliases: a small anchor reused twice loads as before."""
  text = "base: &b {lr: 0.001, steps: 4}\na: *b\nb: *b\n"
  assert inputs.parse_text(text, "ok.yaml", "yaml")["b"] == {"lr": 0.001, "steps": 4}


@pytest.mark.parametrize("text,fmt,match", [
    ("", "yaml", "the file is empty"), ("  \n\n", "hjson", "the file is empty"),
    ("# only a comment\n", "yaml", "holds no config"),
    ('{\n"lr": NaN}\n', "hjson", "2: key 'lr' is NaN: NaN and Infinity are not allowed"),
    ('{"optimizer": {"params": {"lr": -Infinity}}}', "hjson", "key 'lr' is -Infinity"),
    ('{"a": [1, Infinity]}', "hjson", "a value is Infinity"),
])
def test_empty_and_nonfinite_configs_are_named(text, fmt, match):
  with pytest.raises(InputError, match=match):
    inputs.parse_text(text, "cfg", fmt)


def test_quoted_nan_text_is_not_a_number():
  """A string that happens to read NaN or mention inf is a string, not a refused number."""
  assert inputs.parse_text('{"name": "NaN", "desc": "the inf value", "x": "Infinity"}', "c", "hjson")["name"] == "NaN"


@pytest.mark.parametrize("argv,said", [
    (["plan", "--host-memory", "1e400"], "parity plan: error: --host-memory 1e400: must be a finite number"),
    (["plan", "--peak-tflops=-1e999"], "parity plan: error: --peak-tflops -1e999: must be a finite number"),
    (["plan", "--host-memory", "-1"], "parity plan: error: --host-memory -1: must be a number > 0"),
    (["plan", "--devices", "0"], "parity plan: error: devices (--devices) 0: must be >= 1"),
    (["estimate", "--model", "nope"], "parity estimate: error: unknown model preset 'nope'"),
])
def test_sizing_flags_are_named_as_typed(capsys, argv, said):
  """Each message starts with the command and names the flag as the user typed it (in-process: cli.main exits 2
  through argparse or returns 2)."""
  try:
    code = cli.main(argv)
  except SystemExit as exc:
    code = exc.code
  err = capsys.readouterr().err
  assert code == 2 and err.startswith(said), err


@pytest.mark.parametrize("argv", [["compare", "--sides", ""], ["compare", "--preset="], ["compare", "--data", " "],
                                  ["compare", "--equivalence", ""], ["diagnose", "--sides", ""],
                                  ["estimate", "--preset", ""], ["report", "-o", "", "x"]])
def test_an_empty_option_value_is_refused_not_read_as_the_default(argv, capsys):
  """`--sides ""` ran all three sides and `--preset ""` the default preset: an empty value is
  a slip (an unset shell variable), refused naming the option; a flag that takes no value is not misread."""
  assert cli.main(argv) == 2
  flag = next(a.split("=")[0] for a in argv if a.startswith("-"))
  assert f"{flag} is given an empty value" in capsys.readouterr().err
  assert cli._empty_flag(["report", "--force", ""], {"--force"}) is None


def test_a_tokenizer_that_would_be_ignored_is_refused(tmp_path):
  """`--tokenizer` with a token stream or the byte-level demo ran a whole compare and never opened it:
  refused, naming why and what to do."""
  from parity.pipeline.resolve import resolve_run
  with pytest.raises(SpecError, match="only padded/packed example files are tokenized"):
    resolve_run("gpt2-tiny", tokenizer=tmp_path)
  with pytest.raises(SpecError, match="the built-in sft-demo is byte-level"):
    resolve_run("sft-tiny", tokenizer=tmp_path)


def test_a_folder_with_no_space_at_all_is_named_without_the_size_fixes(tmp_path, monkeypatch):
  """0 bytes free (/proc, a full disk): no size or --allow-large advice, the folder named."""
  from parity.sizing import resources as R
  monkeypatch.setattr(R, "_free_disk_bytes", lambda folder: 0)
  monkeypatch.delenv(R.ALLOW_LARGE_ENV, raising=False)
  with pytest.raises(InputError, match="no space can be written under .*choose another --out") as e:
    R.check_resources(PRESETS["gpt2-tiny"], tmp_path / "run")
  assert "allow-large" not in str(e.value)


def test_a_report_of_an_older_schema_is_refused_naming_the_version(tmp_path):
  """A report.json of schema parity.report/1 (before the reruns, example arrays and rendered parts were hashed) is
  not re-verified as 'files changed since the run', which would be false: it is refused naming the version."""
  from parity.report.build import REPORT_SCHEMA
  from parity.report.read import load_report
  (tmp_path / "report.json").write_text(json.dumps({"schema": "parity.report/1", "verdict": {}}))
  with pytest.raises(InputError, match=r"written by another parity version \(report schema 'parity.report/1'; "
                                       rf"this version reads '{REPORT_SCHEMA}'"):
    load_report(tmp_path)


def test_a_yaml_config_with_a_key_given_twice_is_refused_naming_key_and_lines(tmp_path, capsys):
  """PyYAML keeps the last of two equal keys silently, while the JSON and hjson readers refuse them.
  A '<<' merge's keys may still be overridden, as YAML means them to be."""
  from parity.cli import main
  from parity.inputs import parse_text
  bad = tmp_path / "dup.yaml"
  bad.write_text("train:\n  lr: 0.001\n  lr: 0.002\n")
  assert main(["estimate", "--config", str(bad)]) == 2
  assert "duplicate key 'lr' in one mapping (lines 2 and 3)" in capsys.readouterr().err
  assert parse_text("a: &x {b: 1}\nc:\n  <<: *x\n  b: 2\n", "m", "yaml") == {"a": {"b": 1}, "c": {"b": 2}}
  for text, key in (("train:\n  1: a\n  x: b\n", "key 1 (line 2) is not a string (int)"),
                    ("null: a\n", "key None (line 1) is not a string (NoneType)")):
    bad.write_text(text)  # was an internal error (sorting int and str keys), exit 1
    assert main(["estimate", "--config", str(bad)]) == 2
    assert key in capsys.readouterr().err
