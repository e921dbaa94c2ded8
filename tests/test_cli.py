"""The CLI as a user meets it (issue #12 items 5 and 8): help texts, --version, presets, one error path."""
from __future__ import annotations

import argparse
import json
from importlib.metadata import version

import pytest

from parity.cli import build_parser, main


def _subparsers(ap: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
  action = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
  return dict(action.choices)


COMMANDS = ("compare", "report", "check", "diagnose", "estimate", "plan", "presets", "port", "convert-weights", "build-ops",
            "doctor")


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


def test_port_output_write_failure_is_one_line_exit_1(tmp_path, capsys):
  src = tmp_path / "ds.json"
  src.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW",
                                                                                "params": {"lr": 1e-3}}}))
  assert main(["port", str(src), "--quiet", "-o", str(tmp_path / "no" / "such" / "o.yaml")]) == 1
  err = capsys.readouterr().err
  assert err.startswith("parity port: error: cannot write") and "Traceback" not in err


def test_cli_wiring_and_printing_left_the_domain_modules():
  """Outside parity/cli/ and the report's own presentation (parity/report/), modules keep pure functions: no
  argparse, no rich, no print; the commands live in parity/cli/ (issue #12 item 5). The one exception is the worker
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
