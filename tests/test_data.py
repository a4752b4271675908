"""Data pipeline: corpus -> tokenizer -> token shards -> packed, resumable, rank-aware batches."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch

from titan_tpu.data import (
    Tokenizer,
    TokenLoader,
    TokenShards,
    build_token_shards,
    corpus as corpus_mod,
    corpus_fingerprint,
    iter_documents,
    load_tokenizer,
    prepare_dataset,
    shards as shards_mod,
    train_bpe_tokenizer,
)
from titan_tpu.data.loader import document_positions

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu def class return import".split()


def make_docs(n: int, *, seed: int = 0, words: int = 60) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) + f"\n# doc {i} ünïcödé\n" for i in range(n)]


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return make_docs(40)


@pytest.fixture(scope="module")
def tokenizer(docs, tmp_path_factory) -> Tokenizer:
    return train_bpe_tokenizer(docs, vocab_size=320, save_path=tmp_path_factory.mktemp("tok") / "tokenizer.json")


# ----------------------------------------------------------------------------------------------
# corpus


def test_directory_source_sorted_and_filtered(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "b.txt").write_text("bee")
    (tmp_path / "a.md").write_text("ay")
    (tmp_path / "sub" / "c.py").write_text("see")
    (tmp_path / "empty.txt").write_text("")  # skipped: no text
    (tmp_path / "data.bin").write_bytes(b"\x00\x01")  # not a text suffix
    (tmp_path / ".hidden" / "x.txt").write_text("hidden")  # hidden dirs are never corpus
    assert list(iter_documents(str(tmp_path))) == ["ay", "bee", "see"]
    # max_bytes cuts the stream (and the last document) to the byte budget.
    assert list(iter_documents(str(tmp_path), max_bytes=4)) == ["ay", "be"]


def test_jsonl_source(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"body": "one"}) + "\n\n" + json.dumps({"body": "two", "x": 1}) + "\n")
    assert list(iter_documents(str(path), text_field="body")) == ["one", "two"]
    with pytest.raises(ValueError, match=r"line 1 has no field 'text'.*--data.text_field"):
        list(iter_documents(str(path)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"other": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"line 2 has no field 'text'"):
        list(iter_documents(str(bad)))


def test_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist \(looked for .*nope'\); set the source's path"):
        iter_documents(str(tmp_path / "nope"))  # eager: fails before iteration
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"corpus directory .* is empty"):
        list(iter_documents(str(tmp_path / "empty")))
    (tmp_path / "x.csv").write_bytes(b"a,b\n")  # parquet is read since issue 26 (test_data_sources.py)
    with pytest.raises(ValueError, match=r"unsupported type '.csv'"):
        iter_documents(str(tmp_path / "x.csv"))
    with pytest.raises(ValueError, match=r"max_bytes"):
        iter_documents(str(tmp_path), max_bytes=0)


def test_stdlib_source_is_deterministic_and_filtered():
    a = list(iter_documents(None, max_bytes=50_000))
    b = list(iter_documents("stdlib", max_bytes=50_000))
    assert a == b and len(a) > 1
    assert sum(len(d.encode()) for d in a) <= 50_000
    files = corpus_mod._list_files(corpus_mod._stdlib_root(), suffixes=(".py",), stdlib=True)
    parts = {part for f in files for part in f.parts}
    assert not parts & {"site-packages", "test", "tests", "idlelib", "turtledemo"}
    assert any(f.name == "argparse.py" for f in files)


def test_fingerprint_tracks_changes(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    fp = corpus_fingerprint(str(tmp_path), text_field="text", max_bytes=None)
    assert fp == corpus_fingerprint(str(tmp_path), text_field="text", max_bytes=None)
    assert fp != corpus_fingerprint(str(tmp_path), text_field="text", max_bytes=3)
    (tmp_path / "a.txt").write_text("hello world")
    assert fp != corpus_fingerprint(str(tmp_path), text_field="text", max_bytes=None)
    j = tmp_path / "c.jsonl"
    j.write_text('{"text": "a"}\n')
    fj = corpus_fingerprint(str(j), text_field="text", max_bytes=None)
    j.write_text('{"text": "b"}\n')  # same size: the content hash still sees it
    assert fj != corpus_fingerprint(str(j), text_field="text", max_bytes=None)


# ----------------------------------------------------------------------------------------------
# tokenizer


def test_bpe_vocab_roundtrip_and_reload(tokenizer, docs, tmp_path):
    assert tokenizer.vocab_size == 320 and tokenizer.eos_id == 0
    text = docs[0] + " never seen: 日本語 🚀 tabs\t\tand <|endoftext|> as plain text"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert 0 not in ids  # literal "<|endoftext|>" in text is data, not a separator
    assert max(max(x) for x in tokenizer.encode_batch(docs)) < 320
    reloaded = load_tokenizer(tokenizer.path)
    assert reloaded.vocab_size == 320 and reloaded.eos_id == 0
    assert reloaded.encode_batch(docs) == tokenizer.encode_batch(docs)
    assert load_tokenizer(tokenizer.path.parent).encode(text) == ids  # a directory works too


def test_bpe_training_is_deterministic(docs, tokenizer, tmp_path):
    again = train_bpe_tokenizer(docs, vocab_size=320, save_path=tmp_path / "t.json")
    assert (tmp_path / "t.json").read_text() == tokenizer.path.read_text()
    assert again.encode(docs[1]) == tokenizer.encode(docs[1])


def test_bpe_small_corpus_still_exact_vocab(tmp_path):
    tok = train_bpe_tokenizer(["tiny corpus"], vocab_size=400, save_path=tmp_path / "t.json")
    assert tok.vocab_size == 400
    assert load_tokenizer(tmp_path / "t.json").vocab_size == 400
    with pytest.raises(ValueError, match=r"too small.*--model.vocab_size"):
        train_bpe_tokenizer(["x"], vocab_size=100, save_path=tmp_path / "u.json")


def test_load_tokenizer_errors(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match=r"--data.tokenizer_path"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"not a valid tokenizer.json"):
        load_tokenizer(tmp_path / "junk.json")
    # A tokenizer without any known end-of-text token is refused with a clear message.
    data = json.loads(tokenizer.path.read_text())
    data["added_tokens"] = []
    data["model"]["vocab"] = {k: v for k, v in data["model"]["vocab"].items() if k != "<|endoftext|>"}
    (tmp_path / "noeos.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"no end-of-text token"):
        load_tokenizer(tmp_path / "noeos.json")


# ----------------------------------------------------------------------------------------------
# shards


def test_shards_roundtrip_across_shard_boundaries(tokenizer, docs, tmp_path):
    shards = build_token_shards(docs, tokenizer, tmp_path / "s", shard_tokens=97)
    expected = np.concatenate([np.array(tokenizer.encode(d) + [tokenizer.eos_id]) for d in docs])
    assert shards.num_tokens == len(expected) and shards.num_documents == len(docs)
    assert shards.dtype == np.uint16 and shards.vocab_size == 320
    assert len(list((tmp_path / "s").glob("shard_*.bin"))) == -(-len(expected) // 97)
    stream = shards.read(0, shards.num_tokens)
    np.testing.assert_array_equal(stream, expected)
    assert tokenizer.decode(stream) == "".join(d + "<|endoftext|>" for d in docs)
    # Reads that start inside one shard and end several shards later.
    for start, length in [(90, 10), (96, 1), (97, 0), (50, 300), (shards.num_tokens - 5, 5)]:
        np.testing.assert_array_equal(shards.read(start, length), expected[start : start + length])
    with pytest.raises(IndexError):
        shards.read(shards.num_tokens - 1, 2)
    reopened = TokenShards.open(tmp_path / "s")
    np.testing.assert_array_equal(reopened.read(0, reopened.num_tokens), expected)


def test_reads_map_a_bounded_number_of_shards(tokenizer, docs, tmp_path, monkeypatch):
    """A map per shard would meet vm.max_map_count on a large corpus: at most MAX_OPEN_MAPS are
    mapped, reads through evicted and re-mapped shards still equal the stream."""
    monkeypatch.setattr(TokenShards, "MAX_OPEN_MAPS", 2)
    shards = build_token_shards(docs, tokenizer, tmp_path / "s", shard_tokens=13)
    expected = shards.read(0, shards.num_tokens)
    assert len(shards._maps) == 2 and len(shards._files) > 10
    rng = np.random.default_rng(0)
    for start in rng.integers(0, shards.num_tokens - 40, size=50):
        np.testing.assert_array_equal(shards.read(int(start), 40), expected[start : start + 40])
        assert len(shards._maps) <= 2
    np.testing.assert_array_equal(expected, np.concatenate([np.array(tokenizer.encode(d) + [tokenizer.eos_id])
                                                            for d in docs]))


def test_interrupted_build_leaves_nothing(tokenizer, docs, tmp_path):
    def failing_docs():
        yield from docs[:5]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_token_shards(failing_docs(), tokenizer, tmp_path / "s", shard_tokens=50)
    assert list(tmp_path.iterdir()) == []


def test_corrupted_shards_raise_clear_errors(tokenizer, docs, tmp_path):
    out = tmp_path / "s"
    build_token_shards(docs, tokenizer, out, shard_tokens=200)
    shard = out / "shard_00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])  # truncated
    with pytest.raises(ValueError, match=r"shard_00001.bin has .* bytes.*delete"):
        TokenShards.open(out)
    (out / "index.json").write_text('{"format": "titan_tpu.tok')  # cut mid-write
    with pytest.raises(ValueError, match=r"not valid JSON.*delete"):
        TokenShards.open(out)
    (out / "index.json").unlink()
    with pytest.raises(ValueError, match=r"index.json is missing"):
        TokenShards.open(out)
    with pytest.raises(FileNotFoundError):
        TokenShards.open(tmp_path / "nothing")


def test_prepare_dataset_caches(tmp_path, monkeypatch, capsys):
    src = tmp_path / "corpus"
    src.mkdir()
    for i, d in enumerate(make_docs(30, seed=1)):
        (src / f"{i:03d}.txt").write_text(d)
    calls = {"encode": 0, "train": 0}
    real_encode, real_train = Tokenizer.encode_batch, shards_mod.train_bpe_tokenizer

    def counting_encode(self, texts):
        calls["encode"] += 1
        return real_encode(self, texts)

    def counting_train(*args, **kwargs):
        calls["train"] += 1
        return real_train(*args, **kwargs)

    monkeypatch.setattr(Tokenizer, "encode_batch", counting_encode)
    monkeypatch.setattr(shards_mod, "train_bpe_tokenizer", counting_train)
    kwargs = dict(source=str(src), max_bytes=None, tokenizer_path=None, vocab_size=300, cache_dir=tmp_path / "cache")
    tok1, sh1 = prepare_dataset(**kwargs)
    assert calls == {"encode": 1, "train": 1}
    assert "tokenized 30 documents" in capsys.readouterr().out
    tok2, sh2 = prepare_dataset(**kwargs)
    assert calls == {"encode": 1, "train": 1}  # cache hit: no training, no tokenization
    assert "cached" in capsys.readouterr().out
    assert sh2.directory == sh1.directory and tok2.vocab_size == 300
    np.testing.assert_array_equal(sh1.read(0, sh1.num_tokens), sh2.read(0, sh2.num_tokens))

    # A broken cache entry is rebuilt, not trusted. (Drop the open memmaps before truncating
    # their file in place: touching a mapped page past the new end of file is SIGBUS.)
    stream, cache_entry = sh1.read(0, sh1.num_tokens), sh1.directory
    del sh1, sh2
    (cache_entry / "shard_00000.bin").write_bytes(b"")
    _, sh3 = prepare_dataset(**kwargs)
    assert calls == {"encode": 2, "train": 1}
    np.testing.assert_array_equal(sh3.read(0, sh3.num_tokens), stream)

    # An explicit tokenizer must fit in the model vocab.
    with pytest.raises(ValueError, match=r"raise --model.vocab_size to at least 300"):
        prepare_dataset(**{**kwargs, "tokenizer_path": str(tok1.path), "vocab_size": 256})
    tok4, sh4 = prepare_dataset(**{**kwargs, "tokenizer_path": str(tok1.path), "vocab_size": 512})
    assert sh4.directory == sh3.directory  # same corpus + same tokenizer file = same cache entry


# ----------------------------------------------------------------------------------------------
# loader

SEQ = 8
NUM_TOKENS = 4001  # -> (4001 - 1) // 8 = 500 windows


class PositionTokenizer:
    """Stub whose one document encodes to 0, 1, 2, ...: a token's value is its stream position,
    so a window is identified by its first token (window w starts at token w * SEQ)."""

    vocab_size = 70_000
    eos_id = 69_999

    def encode_batch(self, texts):
        return [list(range(int(t))) for t in texts]


@pytest.fixture(scope="module")
def pos_shards(tmp_path_factory) -> TokenShards:
    # NUM_TOKENS - 1 positional tokens + the eos separator; small shards so reads cross files.
    return build_token_shards([str(NUM_TOKENS - 1)], PositionTokenizer(), tmp_path_factory.mktemp("pos") / "s",
                              shard_tokens=333)


def loader(shards, **kw) -> TokenLoader:
    args = dict(seq_len=SEQ, batch_size=4, seed=0)
    args.update(kw)
    return TokenLoader(shards, **args)


def windows(inputs_BS: torch.Tensor) -> list[int]:
    return (inputs_BS[:, 0] // SEQ).tolist()


def test_batches_shapes_and_labels(pos_shards):
    x, y = loader(pos_shards).next_batch()
    assert x.shape == y.shape == (4, SEQ) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)  # positional stream: the label of each token is the next position
    assert (x[:, 0] % SEQ == 0).all()


def test_document_positions_restart_after_each_eos():
    tokens = np.array([[5, 6, 0, 7, 8, 9, 0, 0, 4], [0, 1, 2, 3, 4, 5, 6, 7, 8]])
    assert document_positions(tokens, eos_id=0).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0],
                                                            [0, 0, 1, 2, 3, 4, 5, 6, 7]]


def test_document_mask_batches_carry_positions(pos_shards):
    plain = loader(pos_shards).next_batch()
    x, y, positions = loader(pos_shards, document_mask=True).next_batch()
    assert torch.equal(x, plain[0]) and torch.equal(y, plain[1])  # same windows, same order
    eos = pos_shards.eos_id
    want = torch.from_numpy(document_positions(x.numpy(), eos))
    assert positions.dtype == torch.int64 and torch.equal(positions, want)
    assert (positions[:, 0] == 0).all()
    # The positional stream has one eos, at its end: a window that holds it restarts after it.
    val = TokenLoader(pos_shards, seq_len=SEQ, batch_size=1, seed=0, split="val", document_mask=True)
    for batch in val.val_batches():
        assert len(batch) == 3


def test_same_seed_same_batches_other_seed_differs(pos_shards):
    a, b, c = loader(pos_shards, seed=3), loader(pos_shards, seed=3), loader(pos_shards, seed=4)
    wa = [windows(a.next_batch()[0]) for _ in range(5)]
    assert wa == [windows(b.next_batch()[0]) for _ in range(5)]
    assert wa != [windows(c.next_batch()[0]) for _ in range(5)]


def test_resume_is_exact(pos_shards):
    ref = loader(pos_shards, seed=7)
    expected = [ref.next_batch() for _ in range(300)]  # crosses epoch boundaries (123 steps/epoch)
    run = loader(pos_shards, seed=7)
    for _ in range(130):
        run.next_batch()
    sd = run.state_dict()
    assert json.loads(json.dumps(sd)) == sd  # plain python values only
    resumed = loader(pos_shards, seed=999)  # the checkpoint's seed wins
    resumed.load_state_dict(sd)
    for want_x, want_y in expected[130:]:
        x, y = resumed.next_batch()
        assert torch.equal(x, want_x) and torch.equal(y, want_y)


def test_resume_rejects_mismatch(pos_shards):
    sd = loader(pos_shards).state_dict()
    with pytest.raises(ValueError, match=r"seq_len 8.*--training.seq_len 8"):
        TokenLoader(pos_shards, seq_len=16, batch_size=2, seed=0).load_state_dict(sd)
    with pytest.raises(ValueError, match=r"corpus with num_train_windows=495.*same --data.source"):
        loader(pos_shards, val_fraction=0.1).load_state_dict(sd)


def test_dp_ranks_are_disjoint_and_cover_the_global_batch(pos_shards):
    single = loader(pos_shards, batch_size=6)
    ranks = [loader(pos_shards, batch_size=2, dp_rank=r, dp_world_size=3) for r in range(3)]
    for _ in range(130):  # past an epoch boundary
        per_rank = [windows(rk.next_batch()[0]) for rk in ranks]
        flat = [w for ws in per_rank for w in ws]
        assert len(set(flat)) == len(flat)
        assert flat == windows(single.next_batch()[0])


def test_resume_with_another_world_size(pos_shards):
    ref = loader(pos_shards, batch_size=4)
    expected = [windows(ref.next_batch()[0]) for _ in range(200)]
    two = [loader(pos_shards, batch_size=2, dp_rank=r, dp_world_size=2) for r in range(2)]
    for _ in range(50):
        for rk in two:
            rk.next_batch()
    sd = two[0].state_dict()
    assert sd == two[1].state_dict()  # the position is global: identical on every rank
    four = [loader(pos_shards, batch_size=1, dp_rank=r, dp_world_size=4) for r in range(4)]
    for rk in four:
        rk.load_state_dict(sd)
    for step in range(50, 200):
        assert [w for rk in four for w in windows(rk.next_batch()[0])] == expected[step]


def test_epochs_and_validation_split(pos_shards):
    ld = loader(pos_shards, batch_size=4, val_fraction=0.05)
    assert (ld.num_windows, ld.num_val_windows, ld.num_train_windows) == (500, 25, 475)
    assert ld.steps_per_epoch == 118  # 475 // 4, the 3 left over are dropped
    epoch0 = [w for _ in range(118) for w in windows(ld.next_batch()[0])]
    assert len(set(epoch0)) == len(epoch0) == 472 and max(epoch0) < 475
    assert ld.state_dict()["epoch"] == 0
    epoch1 = [w for _ in range(118) for w in windows(ld.next_batch()[0])]
    assert ld.state_dict()["epoch"] == 1 and ld.state_dict()["samples_consumed"] == 944
    assert len(set(epoch1)) == 472 and epoch1 != epoch0  # a fresh permutation (seed + 1)

    val = [w for x, y in ld.val_batches() for w in windows(x)]
    assert val == list(range(475, 499))  # fixed order, last windows; 25 // 4 = 6 full batches
    assert not set(val) & set(epoch0 + epoch1)
    assert len(list(ld.val_batches(max_batches=2))) == 2
    # Two ranks split each validation batch; together they see the same windows.
    r0, r1 = (loader(pos_shards, batch_size=2, dp_rank=r, dp_world_size=2, val_fraction=0.05) for r in range(2))
    both = [w for (a, _), (b, _) in zip(r0.val_batches(), r1.val_batches()) for w in windows(a) + windows(b)]
    assert both == val
    # split="val": next_batch walks the validation windows in order, cycling.
    v = loader(pos_shards, batch_size=10, split="val", val_fraction=0.05)
    assert [windows(v.next_batch()[0]) for _ in range(3)] == [
        list(range(475, 485)),
        list(range(485, 495)),
        list(range(495, 500)) + list(range(475, 480)),
    ]


def test_too_small_corpus(tmp_path):
    def shards_of(n: int) -> TokenShards:  # a stream of exactly n tokens (n - 1 + eos)
        return build_token_shards([str(n - 1)], PositionTokenizer(), tmp_path / f"s{n}")

    kw = dict(seq_len=16, batch_size=4, seed=0, dp_world_size=2)
    with pytest.raises(ValueError, match=r"too few for one training batch.*needs at least") as err:
        TokenLoader(shards_of(100), **kw)
    needed = int(re.search(r"needs at least ([\d,]+) tokens", str(err.value)).group(1).replace(",", ""))
    assert needed == 9 * 16 + 1  # 8 training windows + 1 validation window, +1 final label
    TokenLoader(shards_of(needed), **kw)  # the reported minimum is enough...
    with pytest.raises(ValueError):
        TokenLoader(shards_of(needed - 1), **kw)  # ...and exact


def test_real_stdlib_pipeline_end_to_end(tmp_path):
    tok, shards = prepare_dataset(
        source=None, max_bytes=200_000, tokenizer_path=None, vocab_size=512, cache_dir=tmp_path
    )
    ld = TokenLoader(shards, seq_len=64, batch_size=4, seed=0)
    x, y = ld.next_batch()
    assert x.max() < 512 and torch.equal(x[:, 1:], y[:, :-1])
    corpus = "".join(d + "<|endoftext|>" for d in iter_documents(None, max_bytes=200_000))
    assert tok.decode(shards.read(0, 200)) in corpus
