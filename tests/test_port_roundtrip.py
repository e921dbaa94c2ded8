"""`parity port --to-deepspeed` writes what its report says it writes.

Every real config is ported, then written back (to_deepspeed): each report row that names a target holds a key of the
file written, and a source without an optimizer / scheduler section (a client optimizer, e.g. the HF Trainer's) gets
none back (an optimizer section would decay every tensor under the HF Trainer: one param group).
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from parity.migrate import port_config, read_deepspeed_config
from parity.migrate._reverse import to_deepspeed
from parity.overrides import has_dotted
from tests.test_migrate import REAL, REAL_FILES, flags_for

LLAVA = REAL / "haotian-liu__LLaVA__scripts__zero2.json"


def _round_trip(path):
  raw = read_deepspeed_config(path)
  res = port_config(raw, flags_for(raw), source=str(path))
  if res.ported is None:
    pytest.skip(f"{path.name}: refused by the port")
  return raw, res, *to_deepspeed(res.ported.to_dict(), source="ported.yaml")


@pytest.mark.parametrize("path", REAL_FILES, ids=lambda p: p.name)
def test_every_mapped_row_is_a_key_of_the_file_written(path):
  _, _, out, report = _round_trip(path)
  assert report.ported, report.errors
  for e in report.to_dict()["entries"]:
    if e["fate"] == "mapped":
      assert e["target"] and has_dotted(out, e["target"]), (e, sorted(out))
    else:
      assert "written to the DeepSpeed config" not in e["reason"], e


@pytest.mark.parametrize("path", REAL_FILES, ids=lambda p: p.name)
def test_no_optimizer_or_scheduler_section_is_added(path):
  raw, res, out, _ = _round_trip(path)
  assert ("optimizer" in out) == ("optimizer" in raw)
  assert ("scheduler" in out) == ("scheduler" in raw and raw["scheduler"].get("type") not in (None, "Constant"))
  # the stack is not a key of the file: the port of the file written is asked for the source's (parity.migrate._stack)
  flags = dataclasses.replace(flags_for(raw), stack=res.stack.stack)
  again = port_config(json.loads(json.dumps(out)), flags, source="back.json")
  assert again.ported is not None and again.ported.optimizer == res.ported.optimizer
  assert again.ported.scheduler == res.ported.scheduler


def test_llava_client_optimizer_stays_client():
  _, _, out, report = _round_trip(LLAVA)
  assert "optimizer" not in out and "scheduler" not in out
  rows = {e["key"]: e for e in report.to_dict()["entries"]}
  assert rows["optimizer.params.weight_decay"]["fate"] == "not_needed"
  assert "no optimizer section" in rows["optimizer.params.weight_decay"]["reason"]
  assert rows["scheduler.type"]["fate"] == "not_needed" and "no scheduler section" in rows["scheduler.type"]["reason"]
  assert any("no optimizer section is written" in w for w in report.warnings)


def _cli(*argv):
  from parity.cli.port import main
  return main([str(a) for a in argv])


LLAVA_FLAGS = ["--micro-batch", 4, "--grad-accum", 2, "--hidden-size", 64, "--lr", 1e-3, "--betas", "0.9,0.999",
               "--eps", 1e-8, "--weight-decay", 0.1, "--fp32", "--quiet"]


def test_rerun_replaces_its_own_output_and_refuses_an_edited_one(tmp_path, capsys):
  """Item 5.2: `--to-deepspeed -o back.json` run twice replaces its own file (a JSON has no marker: the record
  back.json.parity holds its sha256); a port output edited since is refused naming why, replaced with --force."""
  x, back = tmp_path / "x.yaml", tmp_path / "back.json"
  assert _cli(LLAVA, *LLAVA_FLAGS, "-o", x) == 0
  assert _cli("--to-deepspeed", x, "-o", back, "--quiet") == 0
  assert (tmp_path / "back.json.parity").exists()
  assert _cli("--to-deepspeed", x, "-o", back, "--quiet") == 0  # its own output: replaced
  back.write_text(back.read_text().replace('"gradient_clipping": 1.0', '"gradient_clipping": 0.5'))
  capsys.readouterr()
  assert _cli("--to-deepspeed", x, "-o", back, "--quiet") == 2
  err = capsys.readouterr().err
  assert "is not the file `parity port` wrote there" in err and "changed since" in err and "--force" in err
  assert '"gradient_clipping": 0.5' in back.read_text()  # untouched
  x.write_text(x.read_text() + "# my note\n")  # a hand-edited port YAML
  assert _cli(LLAVA, *LLAVA_FLAGS, "-o", x) == 2
  assert "# my note" in x.read_text() and "changed since" in capsys.readouterr().err
  assert _cli(LLAVA, *LLAVA_FLAGS, "-o", x, "--force") == 0
  assert "# my note" not in x.read_text()


def test_a_foreign_file_is_refused_and_says_so(tmp_path, capsys):
  from parity.migrate.outputs import check_outputs
  from parity.migrate import PortError
  foreign, old = tmp_path / "notes.json", tmp_path / "old.yaml"
  foreign.write_text("{}")
  old.write_text("schema: parity.ported/2\n")  # an older port's output: no record
  for path, why in ((foreign, "written by something else"), (old, "looks like a port output but has no record")):
    with pytest.raises(PortError, match=why):
      check_outputs(tmp_path / "ds.json", [("-o", str(path))])
    check_outputs(tmp_path / "ds.json", [("-o", str(path))], force=True)


MEGATRON = REAL / "microsoft__DeepSpeedExamples__Megatron-LM__scripts__ds_zero2_cpu_offload_config.json"


@pytest.mark.parametrize("path", [MEGATRON, LLAVA], ids=["activation_checkpointing", "none"])
def test_resolve_run_gives_both_sides_the_same_checkpointing_plan(path):
  """Item 5.4: a config with an activation_checkpointing section checkpoints each block on the DeepSpeed side
  (DeepSpeedPlan.activation_checkpointing, which torch_impl.engine turns into deepspeed.checkpointing) as JAX
  rematerialises it; without one neither side does."""
  from parity.pipeline.resolve import resolve_run
  run = resolve_run("gpt2-tiny", deepspeed_config=path)
  has = "activation_checkpointing" in read_deepspeed_config(path)
  assert (run.spec.jax.remat != "none") == has
  assert run.spec.deepspeed.activation_checkpointing == has
  assert ("activation_checkpointing" in run.deepspeed_config) == has


def test_verify_still_runs_a_client_optimizer_port_as_torch_adamw():
  """--to-deepspeed writes no section for a client optimizer; --verify's DeepSpeed side still needs one (its probe
  model has no training script): the AdamW of the flags, as torch.optim runs it."""
  from parity.migrate.verify import verify_request
  raw = read_deepspeed_config(LLAVA)
  res = port_config(raw, flags_for(raw), source=str(LLAVA))
  ds_req, _, notes = verify_request(res, 5)
  p = res.ported.optimizer.params
  assert ds_req["ds_config"]["optimizer"] == {"type": "AdamW", "params": {
      "lr": p["lr"], "betas": p["betas"], "eps": p["eps"], "weight_decay": p["weight_decay"], "torch_adam": True}}
  assert any("client torch.optim.AdamW" in n for n in notes)


def test_an_output_that_is_another_outputs_record_is_refused(tmp_path):
  from parity.migrate.outputs import check_outputs
  from parity.migrate import PortError
  with pytest.raises(PortError, match=r"the same file as the record .*a\.json\.parity of -o"):
    check_outputs(tmp_path / "ds.json", [("-o", str(tmp_path / "a.json")),
                                         ("--report-json", str(tmp_path / "a.json.parity"))], force=True)
