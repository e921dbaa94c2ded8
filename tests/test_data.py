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
