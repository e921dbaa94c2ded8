"""The CLI as a user meets it: help texts, --version, presets, one error path."""
from __future__ import annotations

import argparse
import json
from importlib.metadata import version

import pytest

from parity.cli import build_parser, main


def _subparsers(ap: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
  action = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
  return dict(action.choices)


COMMANDS = ("compare", "report", "check", "join", "diagnose", "estimate", "plan", "presets", "port", "convert-weights",
            "build-ops", "doctor")


def test_every_subcommand_is_there_with_a_description():
  subs = _subparsers(build_parser())
  assert set(subs) == set(COMMANDS)
  for name, p in subs.items():
    assert p.description and len(p.description) > 40, f"`parity {name} --help` has no description"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_has_help_that_says_its_default(command, capsys):
  """The rule: every option has a help text; an option that takes a value says what it defaults to (a flag is off
  unless given)."""
  p = _subparsers(build_parser())[command]
  for a in p._actions:
    if isinstance(a, argparse._HelpAction):
      continue
    name = "/".join(a.option_strings) or a.dest
    assert a.help and a.help.strip(), f"parity {command}: {name} has no help text"
    takes_value = a.option_strings and a.nargs != 0
    if takes_value or (not a.option_strings and a.nargs in ("*", "?")):
      assert "default" in a.help, f"parity {command}: {name}'s help does not say its default: {a.help!r}"
  with pytest.raises(SystemExit) as exc:
    main([command, "--help"])
  assert exc.value.code == 0
  assert p.description.split()[0] in capsys.readouterr().out


def test_version_comes_from_the_package_metadata(capsys):
  with pytest.raises(SystemExit) as exc:
    main(["--version"])
  assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"parity {version('parity')}"


def test_presets_lists_the_model_size_presets(capsys):
  from parity.hf import MODEL_PRESETS
  from parity.presets import PRESETS
  assert main(["presets"]) == 0
  out = capsys.readouterr().out
  for name in (*PRESETS, *MODEL_PRESETS):
    assert name in out, f"`parity presets` does not list {name}"
  assert "llama-7b" in out and "6.74 B params" in out  # the published count, not a Python path


@pytest.mark.parametrize("argv, names", [
    (["estimate", "--model", "nope"], "nope"),
    (["estimate", "--preset", "gpt2-tiny", "--plan", "nope"], "nope"),
    (["estimate", "--ranks", "0"], "--ranks"),
    (["estimate", "--preset", "gpt2-tiny", "--seq-len", "0"], "seq_len"),
    (["estimate", "--preset", "gpt2-tiny", "--set", "model.d_model=-3"], "d_model"),
    (["plan", "--model", "nope"], "nope"),
    (["plan", "--sides", "tpu"], "--sides"),
    (["plan", "--mfu", "1.5"], "--mfu"),
    (["plan", "--devices", "0"], "--devices"),
    (["plan", "--device-memory", "-1"], "--device-memory"),
    (["plan", "--preset", "gpt2-tiny", "--micro-batch", "0"], "micro_batch_size"),
])
def test_estimate_and_plan_bad_input_go_to_stderr_with_exit_2(argv, names, capsys):
  """Was: `estimate`/`plan` printed 'error: ...' on stdout. Now the one error path: stderr, `parity X: error:`."""
  assert main(argv) == 2
  cap = capsys.readouterr()
  assert cap.out == ""
  assert cap.err.startswith(f"parity {argv[0]}: error: ") and names in cap.err and "Traceback" not in cap.err


def test_estimate_model_preset_goes_through_the_one_resolver():
  """`estimate --model` and `resolve_run(model=...)` are one run: the model preset with model_preset_train's
  training, flags over it, conflicts refused."""
  from parity.hf import MODEL_PRESETS
  from parity.pipeline.resolve import resolve_run
  from parity.spec import SpecError
  r = resolve_run(model="llama-7b", micro_batch=2, plan="zero3-offload-all", overrides={"train.grad_accum_steps": 4})
  assert r.spec.model == MODEL_PRESETS["llama-7b"] and r.preset == "llama-7b"
  assert (r.spec.train.micro_batch_size, r.spec.train.seq_len, r.spec.train.precision) == (2, 2048, "bf16")
  assert r.spec.train.grad_accum_steps == 4 and r.plan["name"] == "zero3-offload-all"
  with pytest.raises(SpecError, match="both name the base run"):
    resolve_run("gpt2-tiny", model="llama-7b")
  with pytest.raises(SpecError, match="known model presets"):
    resolve_run(model="gpt-5")


def test_plan_nothing_fits_exits_1_and_says_so(tmp_path, capsys):
  out = tmp_path / "p.json"
  assert main(["plan", "--model", "llama-70b", "--hardware", "A100-40", "--host-memory", "1", "--json", str(out)]) == 1
  text = capsys.readouterr().out
  assert "no plan fits" in text and "exit 1" in text
  assert json.loads(out.read_text())["choice"] is None
  help_text = _subparsers(build_parser())["plan"].format_help()
  assert "exit status" in help_text and "no plan pair fits" in help_text


def _many_refusals(tmp_path):
  cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "foo": 1, "bar": 2, "amsgrad": True}},
         "zero_optimization": {"stage": 2, "zzz": 1, "yyy": 2}, "pipeline": {"stages": 2},
         "communication_data_type": "fp16", "gradient_allreduce_op": "sum",
         "data_types": {"grad_accum_dtype": "int8"}}
  p = tmp_path / "ds.json"
  p.write_text(json.dumps(cfg))
  return p


def test_port_prints_every_refusal_reason(tmp_path, capsys):
  """Was: the first reason and '(+N more in the report)' with no report written."""
  from parity.migrate import port_config, read_deepspeed_config
  from parity.migrate._ctx import Flags
  src = _many_refusals(tmp_path)
  errors = port_config(read_deepspeed_config(src), Flags(), source=str(src)).report.errors
  assert len(errors) >= 8
  assert main(["port", str(src), "--quiet"]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"parity port: error: refused, {len(errors)} reasons:")
  for e in errors:
    assert e in err
  assert "more in the report" not in err


def test_port_never_shows_a_refused_key_as_mapped(tmp_path, capsys):
  """The rule (Report.set): once a key is refused (unsupported), a later step that maps it leaves it refused; the
  table, the JSON and the Markdown report all read the one entry."""
  from parity.migrate._report import Report
  r = Report("x")
  r.set("optimizer.type", "unsupported", None, "refused: no such optimizer", value="Foo")
  r.set("optimizer.type", "mapped", "train.optimizer", "type Foo", value="Foo")
  assert r.entries["optimizer.type"].fate == "unsupported" and not r.ported
  src = _many_refusals(tmp_path)
  rj = tmp_path / "r.json"
  assert main(["port", str(src), "--report-json", str(rj)]) == 2
  entries = {e["key"]: e for e in json.loads(rj.read_text())["entries"]}
  for e in json.loads(rj.read_text())["errors"]:
    key = e.split(":")[0].split(" ")[0]
    if key in entries:
      assert entries[key]["fate"] == "unsupported", (key, entries[key])


def test_port_output_write_failure_is_one_line_exit_1(tmp_path, capsys, monkeypatch):
  """A write that fails for the machine's state (a full disk), not the path the user gave: exit 1, one line. (A
  missing folder is made: tests/test_migrate.py::test_port_makes_the_folders_of_its_outputs.)"""
  import errno
  from parity.migrate import outputs

  def full(p, data):
    raise OSError(errno.ENOSPC, "No space left on device", str(p))

  monkeypatch.setattr(outputs, "_replace", full)
  src = tmp_path / "ds.json"
  src.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW",
                                                                                "params": {"lr": 1e-3}}}))
  assert main(["port", str(src), "--quiet", "-o", str(tmp_path / "no" / "such" / "o.yaml")]) == 1
  err = capsys.readouterr().err
  assert err.startswith("parity port: error: cannot write") and "Traceback" not in err


def test_cli_wiring_and_printing_left_the_domain_modules():
  """Outside parity/cli/ and the report's own presentation (parity/report/), modules keep pure functions: no
  argparse, no rich, no print; the commands live in parity/cli/. The one exception is the worker
  entry point (parity/protocol/side.py), whose argparse is the worker process's own command line."""
  import ast
  from pathlib import Path
  root = Path(__file__).resolve().parents[1] / "parity"
  allowed = {"protocol/side.py"}
  for path in sorted(root.rglob("*.py")):
    rel = path.relative_to(root).as_posix()
    if rel.startswith(("cli/", "report/")) or rel in allowed:
      continue
    tree = ast.parse(path.read_text())
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in mods if m and m.split(".")[0] in ("argparse", "rich")}, rel
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "print"]
    assert not calls, f"{rel} prints"
  assert not (root / "cli.py").exists() and not (root / "migrate" / "cli.py").exists()


def _run(argv) -> tuple[int, str]:
  import contextlib
  import io
  err = io.StringIO()
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    rc = main(argv)
  return rc, err.getvalue()



# ----------------------------------------------------------------------------------------- input or bug
def _saved_traceback(err: str) -> str:
  """The text of the file an internal error's one line names (removed once read)."""
  import os
  path = err.split("(traceback saved to ", 1)[1].split("; please report it)", 1)[0]
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  finally:
    os.remove(path)


@pytest.mark.parametrize("exc", [ValueError("planted: a list index is not a key"),
                                 UnicodeDecodeError("utf-8", b"\xff", 0, 1, "planted")])
def test_a_plain_value_error_inside_the_product_is_an_internal_error(exc, monkeypatch, tmp_path):
  """A ValueError that is not one of the project's input errors (parity.errors.ParityInputError) is a bug, however
  it reads: one line naming it as an internal error and the saved traceback, exit 1; never "bad input", never a
  traceback on the terminal, nothing run or written. (It was exit 2 'error: planted ...', as if the user's.)"""
  from parity.pipeline import resolve

  def planted(**flags):
    raise exc
  monkeypatch.setattr(resolve, "_flag_values", planted)  # deep inside resolve_run, reached by every compare
  rc, err = _run(["compare", "--preset", "gpt2-tiny", "--steps", "2", "--out", str(tmp_path / "r")])
  assert rc == 1 and err.count("\n") == 1, err
  assert err.startswith(f"parity compare: internal error: {type(exc).__name__}: ") and "planted" in err, err
  assert "Traceback" not in err and "bad input" not in err and "error: planted" not in err
  saved = _saved_traceback(err)
  assert saved.startswith("parity ") and "Traceback" in saved and "in planted" in saved and "_flag_values" in saved
  assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("config, argv, said", [
    ("train:\n  lr_schedule: Bogus\n", [], "train.lr_schedule 'Bogus'"),  # was a plain ValueError of the schedule
    ("train:\n  lr_schedule: WarmupLR\n  lr_schedule_params: {warmup_num_step: 3}\n", [],
     "train.lr_schedule_params: ['warmup_num_step'] are not WarmupLR params"),
    ("train:\n  optimizer: adamx\n", [], "train.optimizer 'adamx'"),
    ("model:\n  nope: 1\n", [], "model.nope"),
    ("", ["--set", "train.lr=-1"], "train.lr"),
])
def test_bad_config_values_are_still_bad_input_naming_the_key(config, argv, said, tmp_path):
  (tmp_path / "run.yaml").write_text(config or "train:\n  steps: 2\n")
  rc, err = _run(["compare", "--preset", "gpt2-tiny", "--config", str(tmp_path / "run.yaml"), *argv,
                  "--out", str(tmp_path / "r")])
  assert rc == 2 and err.startswith("parity compare: error: ") and said in err, err
  assert err.count("\n") == 1 and "internal error" not in err and not (tmp_path / "r").exists()


def test_bad_files_and_flag_values_are_still_bad_input(tmp_path):
  """A missing config file, a weights file of another model, and the flags doctor and build-ops check themselves
  (they raised plain ValueErrors): exit 2, naming the file or flag."""
  from parity import weights
  from parity.presets import PRESETS
  small = PRESETS["gpt2-tiny"].model
  weights.save(weights.init_params(small, seed=0), tmp_path / "w.safetensors")
  bigger = json.dumps({**__import__("parity.spec", fromlist=["to_dict"]).to_dict(small),
                       "n_layers": small.n_layers + 1})
  (tmp_path / "spec.json").write_text(bigger)
  for argv, said in [
      (["compare", "--preset", "gpt2-tiny", "--config", str(tmp_path / "missing.yaml")], "missing.yaml"),
      (["convert-weights", str(tmp_path / "w.safetensors"), str(tmp_path / "o.safetensors"), "--spec",
        str(tmp_path / "spec.json")], "weights do not match the model spec"),
      (["doctor", "--timeout", "-1"], "--timeout -1: must be a positive number of seconds"),
      (["build-ops", "--timeout", "0"], "--timeout 0: must be a positive number of seconds")]:
    rc, err = _run(argv)
    assert rc == 2 and said in err and err.count("\n") == 1 and "internal error" not in err, (argv, err)


def test_an_os_error_on_a_user_path_is_bad_input_naming_the_argument(monkeypatch, tmp_path):
  """An OSError raised anywhere for a path inside the user's --out (here: writing the run's inputs) is exit 2
  naming --out; the same error for a path the user never gave is an internal error."""
  import errno
  import os
  from parity.pipeline import folder

  def denied(path):
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
  monkeypatch.setattr(folder, "prepare_run_dir", lambda spec, path, *a, **k: denied(path / "batches.npy"))
  rc, err = _run(["compare", "--preset", "gpt2-tiny", "--steps", "2", "--out", str(tmp_path / "r")])
  assert rc == 2 and err.startswith(f"parity compare: error: --out {tmp_path / 'r'}") and "ermission denied" in err, err
  monkeypatch.setattr(folder, "prepare_run_dir", lambda spec, path, *a, **k: denied("/elsewhere/parity-internal"))
  rc, err = _run(["compare", "--preset", "gpt2-tiny", "--steps", "2", "--out", str(tmp_path / "r2")])
  assert rc == 1 and "internal error: PermissionError" in err, err
  _saved_traceback(err)


def test_the_command_modules_keep_functions_short():
  """The house rule (< ~60 lines a function) for parity/cli/: compare's register was 61."""
  import ast
  from pathlib import Path
  for path in sorted((Path(__file__).resolve().parents[1] / "parity" / "cli").glob("*.py")):
    for n in ast.walk(ast.parse(path.read_text())):
      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
        assert n.end_lineno - n.lineno + 1 <= 60, f"{path.name}:{n.name} is {n.end_lineno - n.lineno + 1} lines"


# ----------------------------------------------------------------------------------------- the options once
def test_every_run_option_is_built_from_its_compare_flag(monkeypatch):
  """parity.cli.compare.run_options sets every RunOptions field from its flag (a field without one fails here),
  and the rest of the flags are what resolve_run takes."""
  import dataclasses
  from parity.cli import compare as cli_compare
  from parity.pipeline.compare import OPTION_FIELDS, RunOptions
  argv = ["compare", "--out", "o", "--force", "--perturb", "jax:model.norm_eps=1e-3", "--timeout", "9",
          "--no-noise-envelope", "--determinism-steps", "3", "--resume-at", "1", "--no-progress", "--allow-cpu",
          "--baseline", "b", "--tracker", "tensorboard:t", "--nproc", "2", "--nnodes", "2", "--node-rank", "1",
          "--coordinator", "h:1", "--hostfile", "hf", "--equivalence", "ga,packing", "--train-anyway-on-card-diff"]
  monkeypatch.setattr("sys.argv", ["parity", *argv])
  options = cli_compare.run_options(build_parser().parse_args(argv), started_s=5.0)
  default = RunOptions()
  same = [f for f in OPTION_FIELDS if getattr(options, f) == getattr(default, f)]
  assert same == [], f"RunOptions fields no flag of `parity compare` set: {same}"
  assert options.timeout_s == 9.0 and options.progress is False and options.trackers == ("tensorboard:t",)
  assert options.perturb == ("jax:model.norm_eps=1e-3",) and options.command == "parity " + " ".join(argv)
  assert options.noise_envelope is False and options.started_s == 5.0
  # a field added without a flag is caught by run_options itself
  extra = dataclasses.make_dataclass("WithExtra", [("new_option", int, dataclasses.field(default=0))],
                                     bases=(RunOptions,), frozen=True)
  monkeypatch.setattr(cli_compare, "OPTION_FIELDS", tuple(f.name for f in dataclasses.fields(extra)))
  with pytest.raises(AttributeError, match="new_option"):
    cli_compare.run_options(build_parser().parse_args(argv))
# ----------------------------------------------------------------------------- Ctrl-C before any side started


def test_interrupt_before_any_side_started_says_so(monkeypatch, capsys):
  """Ctrl-C while resolving (no worker ever started): the message does not claim a killed side or a report."""
  def interrupted(args):
    raise KeyboardInterrupt

  def with_handler(ap):
    ap.set_defaults(handler=interrupted)
    for action in ap._actions:
      if isinstance(getattr(action, "choices", None), dict):
        for sub in action.choices.values():
          sub.set_defaults(handler=interrupted)
    return ap
  import parity.cli as cli
  monkeypatch.setattr("harness.lifetime._started", 0)
  monkeypatch.setattr(cli, "build_parser", lambda: with_handler(build_parser()))
  assert main(["compare", "--preset", "gpt2-tiny"]) == 130
  err = capsys.readouterr().err
  assert "before any side started" in err and "report marks" not in err, err


def test_estimate_and_plan_keep_an_existing_json_file_unless_forced(tmp_path, capsys):
  """`plan --json FILE` and `estimate --json FILE` replaced a user's file without asking."""
  mine = tmp_path / "mine.json"
  for cmd in (["estimate", "--preset", "gpt2-tiny"], ["plan", "--preset", "gpt2-tiny"]):
    mine.write_text("precious")
    assert main(cmd + ["--json", str(mine)]) == 2
    assert "already exists and would be overwritten; pass --force" in capsys.readouterr().err
    assert mine.read_text() == "precious"
    assert main(cmd + ["--json", str(mine), "--force"]) in (0, 1) and json.loads(mine.read_text())
  assert main(["plan", "--preset", "gpt2-tiny", "--sides", "fsdp,fsdp"]) == 2
  assert "lists a side twice" in capsys.readouterr().err
  assert main(["plan", "--preset", "gpt2-tiny", "--sides", "fsdp,,"]) == 2
  assert "an empty entry" in capsys.readouterr().err
  assert main(["plan", "--preset", "gpt2-tiny", "--json", "-"]) == 2  # doctor's '-' is stdout; here, a file named '-'
  assert "--json -: this command prints its table to stdout" in capsys.readouterr().err


# ----------------------------------------------------------------------------- notes before the sides start
@pytest.mark.parametrize("flags", [["--no-progress"], []])
def test_filled_in_values_and_data_notes_show_with_and_without_progress(tmp_path, monkeypatch, capsys, flags):
  """docs/migration.md: every value compare fills in is printed as `parity compare: filled in KEY = VALUE
  (reason)`; --no-progress hid those lines and the data notes (truncation) with the bar. The sides are not run: the
  stub stands in for them once the notes are out."""
  def no_sides(*_, **__):
    raise SystemExit(99)
  monkeypatch.setattr("parity.pipeline.compare.runner.run_each_side", no_sides)
  ds = tmp_path / "ds.json"
  ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                            "zero_optimization": {"stage": 0}}))
  data = tmp_path / "long.jsonl"
  data.write_text("".join(json.dumps({"input_ids": list(range(1, 200))}) + "\n" for _ in range(8)))
  with pytest.raises(SystemExit, match="99"):
    main(["compare", "--preset", "gpt2-tiny", "--deepspeed-config", str(ds), "--data", str(data), "--set",
          'train.layout="padded"', "--set", 'train.truncation="truncate"', "--sides", "jax,torch", "--out",
          str(tmp_path / "r"), *flags])
  err = capsys.readouterr().err
  assert 'parity compare: filled in "auto" train_micro_batch_size_per_gpu = 4 (from the run spec)' in err, err
  assert "parity compare: filled in gradient_clipping = 1.0" in err
  assert "parity compare: data: 7 of 8 examples are longer than a row and were cut" in err


def test_the_rerun_line_says_what_the_determinism_rerun_guards_against_and_how_to_skip_it():
  from parity.presets import preset
  from parity.report.progress import rerun_line
  spec = preset("gpt2-tiny")
  line = rerun_line(spec, None, 4, None)
  assert "determinism (first 4 steps per side in a new process" in line
  assert "makes any verdict on it chance" in line and "--determinism-steps 0 skips it" in line
  assert rerun_line(spec, False, 0, None) is None


def test_plan_names_the_device_as_given_and_gives_each_side_its_choice(capsys):
  """--device-memory 80GB is named as typed (not as 74.5 GiB of an H100), and DeepSpeed's own best pair is said
  beside the pair's choice (the pair's step is its slowest side's, so the JAX-led choice is not DeepSpeed's)."""
  import re
  rc = main(["plan", "--model", "llama-3.1-8b", "--device-memory", "80GB"])
  out = re.sub(r"\s+", " ", capsys.readouterr().out)
  assert rc == 0
  assert "H100 with 80GB of device memory" in out
  m = re.search(r"each side alone, by its own estimated step time: deepspeed: (\S+) \(([\d,.]+) ms/step\); "
                r"jax: (\S+) \(([\d,.]+) ms/step\)", out)
  assert m, out[-1500:]
  assert m.group(1) == "zero2-offload" and m.group(3) == "scan-offload-remat"  # at jax.offload_opt_ratio 0.75
  assert float(m.group(2).replace(",", "")) < float(m.group(4).replace(",", ""))
