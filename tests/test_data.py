import numpy as np
import pytest

from parity.data import DataError, load_corpus, make_batches


def test_stdlib_corpus_is_real_and_deterministic():
  a = load_corpus("stdlib", max_bytes=1 << 20)
  b = load_corpus("stdlib", max_bytes=1 << 20)
  assert a.sha256 == b.sha256 and a.n_files > 1
  text = bytes(a.train[:20000].astype(np.uint8)).decode("utf-8", "replace")
  assert "def " in text and "import" in text
  assert a.val.size == pytest.approx(0.1 * (a.train.size + a.val.size), rel=1e-3)


def test_sampler_is_seeded_and_shaped():
  c = load_corpus("stdlib", max_bytes=1 << 18)
  tr, va = make_batches(c, steps=5, grad_accum_steps=2, micro_batch_size=3, seq_len=16, seed=7, eval_batches=2)
  assert tr.shape == (5, 2, 3, 17) and va.shape == (2, 3, 17) and tr.dtype == np.uint16
  tr2, _ = make_batches(c, steps=5, grad_accum_steps=2, micro_batch_size=3, seq_len=16, seed=7, eval_batches=2)
  assert np.array_equal(tr, tr2)
  tr3, _ = make_batches(c, steps=5, grad_accum_steps=2, micro_batch_size=3, seq_len=16, seed=8, eval_batches=2)
  assert not np.array_equal(tr, tr3)
  # windows are contiguous slices of the train split
  s = np.frombuffer(c.train.astype(np.uint16).tobytes(), dtype=np.uint16)
  w = tr[0, 0, 0]
  hits = np.flatnonzero(s[:-17] == w[0])
  assert any(np.array_equal(s[h:h + 17], w) for h in hits)


def test_text_folder_and_bin(tmp_path):
  (tmp_path / "a.txt").write_text("hello world " * 200)
  (tmp_path / "sub").mkdir()
  (tmp_path / "sub" / "b.md").write_text("# title\n" * 100)
  c = load_corpus(str(tmp_path))
  assert c.n_files == 2 and c.vocab_size == 256
  ids = (np.arange(5000) % 1000).astype(np.uint16)
  ids.tofile(tmp_path / "train.bin")
  c = load_corpus(str(tmp_path / "train.bin"))
  assert c.vocab_size == 1000 and c.train.size + c.val.size == 5000


def test_bad_sources_are_clear(tmp_path):
  with pytest.raises(DataError, match="does not exist"):
    load_corpus(str(tmp_path / "nope.txt"))
  (tmp_path / "small.txt").write_text("hi")
  with pytest.raises(DataError, match="only 2 tokens"):
    load_corpus(str(tmp_path / "small.txt"))
  (tmp_path / "x.txt").write_text("abc " * 30)
  c = load_corpus(str(tmp_path / "x.txt"))
  with pytest.raises(DataError, match="fewer than one window"):
    make_batches(c, steps=1, grad_accum_steps=1, micro_batch_size=1, seq_len=64, seed=0, eval_batches=1)


# ----------------------------------------------------------------------------- token ids of any vocabulary

import json  # noqa: E402

from conftest import requires_jax, requires_torch  # noqa: E402
from parity.data import batch_dtype  # noqa: E402


def _ids(n=4000, high=151936, seed=0):
  return np.random.default_rng(seed).integers(0, high, size=n)


def _llmc(path, ids, magic, version, dtype):
  head = np.zeros(256, dtype="<i4")
  head[:3] = (magic, version, ids.size)
  path.write_bytes(head.tobytes() + ids.astype(dtype).tobytes())


def test_bin_uint16_uint32_and_llmc_header_read_by_format(tmp_path):
  small, big = _ids(high=50257), _ids()
  small.astype("<u2").tofile(tmp_path / "gpt2.bin")  # nanoGPT: headerless uint16
  big.astype("<u4").tofile(tmp_path / "qwen.uint32.bin")  # the name says the dtype
  _llmc(tmp_path / "l3.bin", big, 20240801, 7, "<u4")  # llm.c llama-3 header: uint32
  _llmc(tmp_path / "l2.bin", small, 20240520, 1, "<u2")  # llm.c gpt-2 header: uint16
  cases = (("gpt2.bin", small, "nanogpt-bin", "uint16"), ("qwen.uint32.bin", big, "nanogpt-bin", "uint32"),
           ("l3.bin", big, "llmc-bin", "uint32"), ("l2.bin", small, "llmc-bin", "uint16"))
  for name, want, fmt, dt in cases:
    c = load_corpus(str(tmp_path / name))
    got = np.concatenate([c.train, c.val])
    assert np.array_equal(got, want), name  # the ids, not the bytes (nor the header)
    assert (c.format, c.file_dtype, c.max_id, c.vocab_size) == (fmt, dt, int(want.max()), int(want.max()) + 1)
    assert c.train.dtype == batch_dtype(c.vocab_size)
  assert load_corpus(str(tmp_path / "l3.bin")).sha256 == load_corpus(str(tmp_path / "qwen.uint32.bin")).sha256


@pytest.mark.parametrize("dtype", ["uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"])
def test_npy_of_any_integer_dtype(tmp_path, dtype):
  high = min(np.iinfo(dtype).max, 151936)
  ids = _ids(high=high).astype(dtype)
  np.save(tmp_path / "ids.npy", ids)
  c = load_corpus(str(tmp_path / "ids.npy"))
  assert np.array_equal(np.concatenate([c.train, c.val]), ids.astype(np.int64))
  assert c.format == "npy" and c.file_dtype == dtype and c.max_id == int(ids.max())


def test_refused_token_files_name_file_and_fix(tmp_path):
  cases = {"neg.npy": (np.array([1, 2, -100] * 30), "token id -100 at index 2 is negative"),
           "f.npy": (np.ones(100, np.float32), "float32 values, not integer token ids"),
           "two.npy": (np.ones((10, 10), np.int32), r"2-D array of shape \(10, 10\).*reshape\(-1\)")}
  for name, (arr, msg) in cases.items():
    np.save(tmp_path / name, arr)
    with pytest.raises(DataError, match=msg) as e:
      load_corpus(str(tmp_path / name))
    assert name in str(e.value)
  np.save(tmp_path / "obj.npy", np.array([{"a": 1}] * 70, dtype=object), allow_pickle=True)
  with pytest.raises(DataError, match="obj.npy: not a NumPy array file parity can read"):
    load_corpus(str(tmp_path / "obj.npy"))
  _ids().astype("<u4").tofile(tmp_path / "q.bin")  # uint32 ids under the nanoGPT (uint16) name: never misread
  with pytest.raises(DataError, match=r"q.bin: .*every second id is below 64.*rename it q.uint32.bin"):
    load_corpus(str(tmp_path / "q.bin"))
  (tmp_path / "odd.uint32.bin").write_bytes(b"\1" * 402)
  with pytest.raises(DataError, match="402 bytes is not a whole number of uint32"):
    load_corpus(str(tmp_path / "odd.uint32.bin"))
  _llmc(tmp_path / "cut.bin", _ids(), 20240801, 7, "<u4")
  (tmp_path / "cut.bin").write_bytes((tmp_path / "cut.bin").read_bytes()[:-8])
  with pytest.raises(DataError, match="header says 4000 uint32 tokens"):
    load_corpus(str(tmp_path / "cut.bin"))
  _llmc(tmp_path / "v9.bin", _ids(), 20240520, 9, "<u2")
  with pytest.raises(DataError, match="version 9"):
    load_corpus(str(tmp_path / "v9.bin"))
  _llmc(tmp_path / "l3.uint16.bin", _ids(), 20240801, 7, "<u4")
  with pytest.raises(DataError, match="name says uint16 but its llm.c header says uint32"):
    load_corpus(str(tmp_path / "l3.uint16.bin"))


def test_binary_file_is_never_read_as_text(tmp_path):
  """An earlier defect: a token file under a name parity did not know was read as its raw bytes."""
  (tmp_path / "ids.dat").write_bytes(_ids().astype("<u4").tobytes())
  with pytest.raises(DataError, match=r"data file .*ids.dat is binary \(a NUL byte at offset \d+\).*\.npy"):
    load_corpus(str(tmp_path / "ids.dat"))
  (tmp_path / "latin.dat").write_bytes(("caf\xe9 " * 40).encode("latin-1"))
  with pytest.raises(DataError, match=r"latin.dat is not UTF-8 text \(byte 0xe9 at offset 3\).*text suffix"):
    load_corpus(str(tmp_path / "latin.dat"))
  (tmp_path / "latin.txt").write_bytes(("caf\xe9 " * 40).encode("latin-1"))  # named text: its bytes, as before
  assert load_corpus(str(tmp_path / "latin.txt")).train[3] == 0xE9
  (tmp_path / "nul.txt").write_bytes(b"abc\0" * 40)  # named text, holding a NUL: binary, refused
  with pytest.raises(DataError, match=r"nul.txt is binary \(a NUL byte at offset 3\)"):
    load_corpus(str(tmp_path / "nul.txt"))
  (tmp_path / "d").mkdir()
  (tmp_path / "d" / "a.txt").write_text("hello " * 50)
  (tmp_path / "d" / "b.json").write_bytes(b"{}" + b"\0" * 100)
  with pytest.raises(DataError, match="b.json is binary"):
    load_corpus(str(tmp_path / "d"))
  (tmp_path / "utf8.txt").write_text("naïve café ünïcode " * 20, encoding="utf-8")
  assert load_corpus(str(tmp_path / "utf8.txt")).format == "bytes"


def test_batches_dtype_follows_the_vocabulary(tmp_path):
  assert (batch_dtype(256), batch_dtype(65536), batch_dtype(65537), batch_dtype(151936)) == (
      np.uint16, np.uint16, np.uint32, np.uint32)
  np.save(tmp_path / "ids.npy", _ids(n=20000, high=151936).astype(np.int64))
  c = load_corpus(str(tmp_path / "ids.npy"))
  kw = dict(steps=3, grad_accum_steps=1, micro_batch_size=2, seq_len=16, seed=0, eval_batches=1)
  tr, va = make_batches(c, **kw)
  assert tr.dtype == va.dtype == np.uint32 and tr.max() > 65535
  with pytest.raises(DataError, match="does not fit batches of uint16"):
    make_batches(c, dtype=np.uint16, **kw)
  small = load_corpus("stdlib", max_bytes=1 << 16)
  assert make_batches(small, **kw)[0].dtype == np.uint16
  assert make_batches(small, dtype=np.uint32, **kw)[0].dtype == np.uint32


def test_run_folder_batches_dtype_inputs_record_and_side_check(tmp_path):
  from parity.pipeline.folder import prepare_run_dir
  from parity.pipeline.resolve import resolve
  from parity.protocol.side import SideIO
  ids = _ids(n=20000)
  np.save(tmp_path / "qwen_ids.npy", ids.astype(np.uint32))
  spec = resolve("gpt2-tiny", steps=3, data=str(tmp_path / "qwen_ids.npy"),
                 overrides=["model.vocab_size=151936"], sides=("jax", "torch"))
  prepare_run_dir(spec, tmp_path / "run")
  b = np.load(tmp_path / "run" / "batches.npy")
  assert b.dtype == np.uint32 and b.max() > 65535 and b.max() <= ids.max()
  from parity.sizing.resources import estimate_resources  # the resource check counts 4-byte ids
  on_disk = sum((tmp_path / "run" / n).stat().st_size for n in ("batches.npy", "val_batches.npy"))
  assert abs(estimate_resources(spec).batches_bytes - on_disk) <= 128  # the two .npy headers, as test_inputs
  inp = json.loads((tmp_path / "run" / "request.json").read_text())["inputs"]
  assert {k: inp[k] for k in ("tokens", "format", "file_dtype", "max_id", "vocab_size", "batches_dtype")} == {
      "tokens": "ids", "format": "npy", "file_dtype": "uint32", "max_id": int(ids.max()), "vocab_size": 151936,
      "batches_dtype": "uint32"}
  assert f"largest id in the file {ids.max()}" in inp["tokenizer"] and "batches stored as uint32" in inp["tokenizer"]
  io = SideIO(tmp_path / "run" / "request.json", "torch")
  assert io.training_batches()[0].dtype == np.uint32
  np.save(tmp_path / "run" / "batches.npy", b.astype(np.uint16))  # what the defect wrote: refused by the side
  with pytest.raises(ValueError, match="batches.npy holds uint16 token ids; model.vocab_size=151936 needs uint32"):
    io.batches()


def test_id_beyond_vocab_is_refused_by_the_cli_with_exit_2(tmp_path, capsys):
  from parity.cli import main
  np.save(tmp_path / "qwen_ids.npy", _ids(n=5000).astype(np.uint32))
  rc = main(["compare", "--preset", "gpt2-tiny", "--data", str(tmp_path / "qwen_ids.npy"), "--steps", "1",
             "--sides", "jax,torch", "--no-progress", "--out", str(tmp_path / "run")])
  err = capsys.readouterr().err
  assert rc == 2 and "Traceback" not in err
  top = int(_ids(n=5000).max())
  assert "qwen_ids.npy" in err and f"largest id is {top}" in err and f"--set model.vocab_size={top + 1}" in err
  assert not (tmp_path / "run" / "batches.npy").exists()


@pytest.mark.process
@requires_jax
@requires_torch
def test_vocab_151936_trains_on_the_files_ids_on_both_sides(tmp_path):
  """The raw-bytes defect, as a user with Qwen-sized uint32 ids runs it (at tiny width): both sides train on the file's
  ids, stored uint32, and the correct pair PASSes every check (the params rule for large vocabularies:
  tests/test_params_rule.py, benchmarks/results/params_rule.md)."""
  import parity
  ids = _ids(n=40000).astype(np.uint32)
  np.save(tmp_path / "qwen_ids.npy", ids)
  rep = parity.compare("gpt2-tiny", steps=3, sides=["jax", "torch"], data=str(tmp_path / "qwen_ids.npy"),
                       overrides=["model.vocab_size=151936", "model.d_model=32"], out=tmp_path / "run",
                       determinism_steps=0, noise_envelope=False, progress=False)
  b = np.load(tmp_path / "run" / "batches.npy")
  assert b.dtype == np.uint32 and b.max() > 65535  # ids above uint16 reached the batches, as stored in the file
  row = b[0, 0, 0]
  at = int(np.flatnonzero(ids == row[0])[0])
  assert np.array_equal(ids[at:at + row.size], row)  # a window of the file's ids, not of its bytes
  assert rep.data["inputs"]["batches_dtype"] == "uint32"
  losses = {s: rep.side(s)["series"]["loss"] for s in ("jax", "torch")}
  assert all(len(v) == 3 and np.isfinite(v).all() for v in losses.values()), losses
  assert abs(losses["jax"][0] - np.log(151936)) < 0.1  # an untrained 151,936-way softmax: ~ln V nats
  loss = {c["name"]: c for c in rep.checks}["loss jax~torch"]
  assert loss["passed"] and loss["value"] <= loss["tolerance"], loss
  failing = [(c["name"], c["detail"]) for c in rep.checks if not c["passed"]]
  assert rep.passed and not failing, failing
