"""Real data: `data prepare` writes a checked token file; the sampler's order depends on seed and step only.

The tokenizer is trained here, on the shipped public-domain text, with the ``tokenizers`` library.
"""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from parashift.cli import main
from parashift.data import DataPosition, Sampler, open_tokens, prepare, rank_rows
from parashift.data.prepare import split_documents
from parashift.errors import DataError, InputError

TEXT = Path(__file__).resolve().parents[1] / "data" / "lighthouse.txt"


def _train(tmp: Path, vocab: int = 400, eos: str = "<|endoftext|>") -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(TEXT)], trainer)
    d = tmp / "tok"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    return d


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("corpus")
    tok = _train(tmp)
    out = tmp / "lighthouse.bin"
    meta = prepare([TEXT], tok, out, split="paragraph")
    return tmp, tok, out, meta


def test_prepare_writes_documents_separated_by_eos(corpus):
    from tokenizers import Tokenizer
    _, tok, out, meta = corpus
    t = Tokenizer.from_file(str(tok / "tokenizer.json"))
    docs = split_documents(TEXT.read_text(), "paragraph")
    want = []
    for d in docs:
        want += t.encode(d, add_special_tokens=False).ids + [meta["eos_id"]]
    raw = np.fromfile(out, dtype="<u2")
    assert raw.tolist() == want
    assert meta["dtype"] == "uint16" and meta["tokens"] == len(want) and meta["bytes"] == out.stat().st_size
    assert meta["documents"] == len(docs) == 17   # 3 titles, 14 paragraphs
    off = meta["doc_offsets"]
    assert off[0] == 0 and off[-1] == len(want)
    assert all(raw[o - 1] == meta["eos_id"] for o in off[1:])                 # each document ends with EOS
    assert meta["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    assert json.loads(out.with_suffix(".json").read_text()) == meta
    assert t.decode(raw[off[0]:off[1] - 1].tolist()).strip() == docs[0]


def test_sequences_overlap_by_one_target_token(corpus):
    _, _, out, meta = corpus
    tf = open_tokens(out, seq_len=16, checksum=True)
    raw = np.fromfile(out, dtype="<u2").astype(np.int64)
    assert tf.num_sequences(16) == (meta["tokens"] - 1) // 16
    s = tf.sequences([0, 3, tf.num_sequences(16) - 1], 16)
    assert s.shape == (3, 17) and s.dtype == np.int64
    assert s[1].tolist() == raw[48:65].tolist()                  # tokens [i*L, i*L + L], both ends included
    with pytest.raises(DataError, match="outside the"):
        tf.sequences([tf.num_sequences(16)], 16)
    smp = tf.sampler(16, seed=5)
    assert smp.n == tf.num_sequences(16) and smp.start().source == meta["sha256"]
    assert tf.sequences(smp.global_batch(0, 4), 16).shape == (4, 17)


def test_uint32_when_the_vocabulary_needs_it(tmp_path):
    from parashift.data.tokens import dtype_for_vocab
    assert dtype_for_vocab(65536) == "<u2" and dtype_for_vocab(65537) == "<u4"
    from tokenizers import Tokenizer, models
    vocab = {f"w{i}": i for i in range(70000)}
    vocab["<|endoftext|>"] = 70000
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    from tokenizers import pre_tokenizers
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("w1 w69999 w5")
    meta = prepare([tmp_path / "a.txt"], tmp_path, tmp_path / "a.bin")
    assert meta["dtype"] == "uint32"
    assert np.fromfile(tmp_path / "a.bin", dtype="<u4").tolist() == [1, 69999, 5, 70000]
    assert open_tokens(tmp_path / "a.bin", checksum=True).tokens.dtype == np.dtype("<u4")


def _copy(corpus, tmp_path):
    _, _, out, _ = corpus
    b, j = tmp_path / "c.bin", tmp_path / "c.json"
    b.write_bytes(out.read_bytes())
    j.write_text(out.with_suffix(".json").read_text())
    return b, j


def test_truncated_file_is_one_data_error(corpus, tmp_path):
    b, _ = _copy(corpus, tmp_path)
    b.write_bytes(b.read_bytes()[:-2])
    with pytest.raises(DataError, match="truncated"):
        open_tokens(b)


def test_corrupt_tokens_fail_the_checksum(corpus, tmp_path):
    b, _ = _copy(corpus, tmp_path)
    raw = bytearray(b.read_bytes())
    raw[10] ^= 1
    b.write_bytes(bytes(raw))
    open_tokens(b)                                   # size and sidecar are fine ...
    with pytest.raises(DataError, match="SHA-256"):  # ... the checksum is not
        open_tokens(b, checksum=True)


@pytest.mark.parametrize("edit,match", [
    (lambda j: j.unlink(), "sidecar c.json is missing"),
    (lambda j: j.write_text("{"), "not valid JSON"),
    (lambda j: j.write_text(json.dumps({"format": "x"})), "not a parashift-tokens sidecar"),
    (lambda j: j.write_text(json.dumps({**json.loads(j.read_text()), "doc_offsets": [0, 5]})), "doc_offsets"),
    (lambda j: j.write_text(json.dumps({**json.loads(j.read_text()), "dtype": "int8"})), "dtype"),
])
def test_bad_sidecar_is_one_data_error(corpus, tmp_path, edit, match):
    b, j = _copy(corpus, tmp_path)
    edit(j)
    with pytest.raises(DataError, match=match):
        open_tokens(b)


def test_too_short_for_the_sequence_length(corpus):
    _, _, out, meta = corpus
    with pytest.raises(DataError, match="no sequence"):
        open_tokens(out, seq_len=meta["tokens"])


def test_prepare_refuses_bad_inputs(corpus, tmp_path):
    _, tok, _, _ = corpus
    with pytest.raises(InputError, match="no tokenizer.json"):
        prepare([TEXT], tmp_path, tmp_path / "x.bin")
    with pytest.raises(InputError, match="must end in .bin"):
        prepare([TEXT], tok, tmp_path / "x.dat")
    with pytest.raises(InputError, match="not a token of this tokenizer"):
        prepare([TEXT], tok, tmp_path / "x.bin", eos="<nope>")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(InputError, match="not UTF-8"):
        prepare([tmp_path / "bad.txt"], tok, tmp_path / "x.bin")
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "x.json").exists()


def test_cli_prepare_and_check(corpus, tmp_path, capsys):
    _, tok, out, meta = corpus
    dst = tmp_path / "cli.bin"
    assert main(["data", "prepare", str(TEXT), "--tokenizer", str(tok), "--out", str(dst),
                 "--split", "paragraph", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tokens"] == meta["tokens"] and got["sha256"] == meta["sha256"]
    assert main(["data", "check", str(dst), "--seq-len", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sequences"] == (meta["tokens"] - 1) // 32
    assert main(["data", "check", str(dst), "--seq-len", "32"]) == 0
    assert "sequences of 32 + 1 tokens" in capsys.readouterr().out
    dst.write_bytes(dst.read_bytes()[:100])
    assert main(["data", "check", str(dst)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "truncated" in err[0] and err[0].startswith("parashift data: error:")


# ---- the sampler ---------------------------------------------------------------------------------------
def test_order_depends_on_seed_and_epoch_only():
    a, b = Sampler(50, seed=3), Sampler(50, seed=3)
    assert np.array_equal(a.global_batch(7, 8), b.global_batch(7, 8))
    assert sorted(a.order(0).tolist()) == list(range(50))
    assert not np.array_equal(a.order(0), a.order(1))
    assert not np.array_equal(a.order(0), Sampler(50, seed=4).order(0))
    # a batch across the epoch boundary: the tail of epoch 0, then the head of epoch 1
    assert a.global_batch(6, 8).tolist() == a.order(0)[48:].tolist() + a.order(1)[:6].tolist()


def test_position_round_trips_and_resumes():
    s = Sampler(37, seed=11)
    pos = s.start()
    for _ in range(9):
        pos = pos.advance(8)
    assert (pos.step, pos.consumed, pos.epoch, pos.offset) == (9, 72, 1, 35)
    back = DataPosition.from_dict(json.loads(json.dumps(pos.to_dict())))
    assert back == pos
    assert np.array_equal(Sampler(37, seed=11).batch_at(back, 8), s.global_batch(9, 8))
    with pytest.raises(DataError, match="seed 11 over 37"):
        Sampler(37, seed=12).batch_at(back, 8)
    with pytest.raises(DataError, match="disagree"):
        DataPosition.from_dict({**pos.to_dict(), "epoch": 0})
    a, b = Sampler(37, 11, source="a" * 64), Sampler(37, 11, source="b" * 64)
    mine = a.start().advance(8)
    assert DataPosition.from_dict(mine.to_dict()).source == "a" * 64
    with pytest.raises(DataError, match="same token file"):
        b.batch_at(mine, 8)


def test_rank_rows_cut_the_batch_into_dp_blocks_and_microbatches():
    assert rank_rows(8, 2, 1) == slice(4, 8)
    assert rank_rows(8, 2, 1, mbs=2, mb=1) == slice(6, 8)
    with pytest.raises(DataError, match="not divisible"):
        rank_rows(6, 4, 0)
    with pytest.raises(DataError, match="does not fit"):
        rank_rows(8, 2, 0, mbs=3)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 60), per=st.integers(1, 6), dps=st.lists(
    st.sampled_from([1, 2, 3, 4, 6]), min_size=1, max_size=4), epochs=st.integers(1, 3))
def test_every_sequence_once_per_epoch_under_any_dp_split(seed, n, per, dps, epochs):
    gb = per * 12                                  # divisible by every dp drawn
    steps = -(-epochs * n // gb)
    s = Sampler(n, seed)
    stream = []
    for step in range(steps):
        dp = dps[step % len(dps)]                  # the strategy changes from step to step (hot switches)
        batch = s.global_batch(step, gb)
        parts = [batch[rank_rows(gb, dp, r)] for r in range(dp)]
        assert np.array_equal(np.concatenate(parts), batch)     # the ranks' union is the global batch, in order
        mbs = per if (gb // dp) % per == 0 else 1
        mbr = [batch[rank_rows(gb, dp, r, mbs, m)] for r in range(dp) for m in range(gb // dp // mbs)]
        assert np.array_equal(np.concatenate(mbr), batch)
        stream += batch.tolist()
    for e in range(len(stream) // n):              # every whole epoch is a permutation of the sequences
        assert sorted(stream[e * n:(e + 1) * n]) == list(range(n))
    tail = stream[(len(stream) // n) * n:]
    assert len(set(tail)) == len(tail)             # the partial epoch repeats nothing
