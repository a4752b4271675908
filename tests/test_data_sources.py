"""Bring your own data: parquet / jsonl(.gz/.zst) / arrow sources, mixtures, chat, prepare-data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from data_fixtures import (
    CHATML_PLAIN,
    conversations,
    make_docs,
    write_chat_tokenizer_dir,
    write_jsonl,
    write_parquet,
)

from titan_tpu.data import iter_documents, train_bpe_tokenizer
from titan_tpu.data.build import PreparedData, build_loaders
from titan_tpu.data.mixture import ChatRows, MixtureLoader, TextRows
from titan_tpu.data.prepare import build_shards, prepare_sources
from titan_tpu.data.shards import TokenShards
from titan_tpu.data.sources import SourceConfig, source_from_table
from titan_tpu.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return make_docs(60)


@pytest.fixture(scope="module")
def tokenizer(docs, tmp_path_factory):
    return train_bpe_tokenizer(docs, vocab_size=320, save_path=tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    return write_chat_tokenizer_dir(tmp_path_factory.mktemp("chat_tok"))


def expected_stream(tokenizer, docs: list[str]) -> np.ndarray:
    """An independent tokenization: each document on its own, eos after each."""
    out = []
    for d in docs:
        out += tokenizer.encode(d) + [tokenizer.eos_id]
    return np.array(out)


def prepare(specs, tokenizer, cache, **kw):
    return prepare_sources(specs, max_bytes=None, tokenizer_path=str(tokenizer.path), vocab_size=tokenizer.vocab_size,
                           cache_dir=cache, log=lambda m: None, **kw)


def cache_entries(cache: Path) -> list[str]:
    """The token and chat shard entries of the cache, hidden or not (empty build-lock files aside)."""
    return sorted(p.name for sub in ("tokens", "chat") if (cache / sub).is_dir() for p in (cache / sub).iterdir()
                  if not p.name.endswith(".lock"))


# ----------------------------------------------------------------------------------------------
# sources: every format gives the documents, and the tokens equal an independent tokenization


def write_all_formats(root: Path, docs: list[str]) -> dict[str, str]:
    """The same documents as each kind of source; returns {kind: source path}."""
    import datasets

    half = len(docs) // 2
    write_parquet(root / "pq" / "part-0.parquet", docs[:half])
    write_parquet(root / "pq" / "part-1.parquet", docs[half:])
    write_jsonl(root / "gz" / "a.jsonl.gz", [{"text": d, "n": i} for i, d in enumerate(docs)])
    write_jsonl(root / "zst" / "a.jsonl.zst", [{"text": d} for d in docs])
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(root / "arrow"), max_shard_size=2_000)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs}),
                          "test": datasets.Dataset.from_dict({"text": docs[:3]})}).save_to_disk(str(root / "dict"))
    # A local copy of a Hub dataset repository: README + data/ with parquet shards.
    (root / "hub").mkdir()
    (root / "hub" / "README.md").write_text("---\nlicense: mit\n---\n# not a document\n")
    write_parquet(root / "hub" / "data" / "train-00000-of-00002.parquet", docs[:half])
    write_parquet(root / "hub" / "data" / "train-00001-of-00002.parquet", docs[half:])
    return {"parquet folder": str(root / "pq"), "parquet glob": str(root / "pq" / "*.parquet"),
            "jsonl.gz": str(root / "gz" / "a.jsonl.gz"), "jsonl.zst": str(root / "zst" / "a.jsonl.zst"),
            "arrow dir": str(root / "arrow"), "dataset dict": str(root / "dict"), "hf dataset dir": str(root / "hub")}


def test_every_format_yields_the_documents_and_their_tokens(tmp_path, docs, tokenizer):
    sources = write_all_formats(tmp_path / "data", docs)
    assert len(list((tmp_path / "data" / "arrow").glob("*.arrow"))) > 1  # several arrow shards, order matters
    want = expected_stream(tokenizer, docs)
    for kind, path in sources.items():
        assert list(iter_documents(path)) == docs, kind
        _, [prepared] = prepare([SourceConfig(path=path)], tokenizer, tmp_path / "cache")
        got = prepared.shards.read(0, prepared.shards.num_tokens)
        assert np.array_equal(got, want), kind
        assert prepared.shards.num_documents == len(docs)


def test_other_text_field_and_max_bytes(tmp_path, docs):
    path = write_parquet(tmp_path / "a.parquet", docs, field="content")
    assert list(iter_documents(str(path), text_field="content")) == docs
    cut = list(iter_documents(str(path), text_field="content", max_bytes=100))
    assert "".join(cut).encode() == "".join(docs).encode()[:100]


def test_parallel_prepare_equals_one_process(tmp_path, docs, tokenizer, monkeypatch):
    import titan_tpu.data.prepare as prepare_mod

    monkeypatch.setattr(prepare_mod, "_CHUNK_DOCS", 7)  # several chunks from a small source
    many = docs * 3
    write_parquet(tmp_path / "a.parquet", many)
    spec = [SourceConfig(path=str(tmp_path / "a.parquet"))]
    _, [one] = prepare(spec, tokenizer, tmp_path / "c1", workers=1)
    _, [two] = prepare(spec, tokenizer, tmp_path / "c2", workers=2)
    assert len(json.loads((one.shards.directory / "index.json").read_text())["shards"]) == -(-len(many) // 7)
    assert np.array_equal(one.shards.read(0, one.shards.num_tokens), two.shards.read(0, two.shards.num_tokens))
    assert np.array_equal(one.shards.read(0, one.shards.num_tokens), expected_stream(tokenizer, many))


def test_interrupted_prepare_resumes_and_is_never_read_half_done(tmp_path, docs, tokenizer, monkeypatch):
    import titan_tpu.data.prepare as prepare_mod

    monkeypatch.setattr(prepare_mod, "_CHUNK_DOCS", 5)
    out = tmp_path / "cache" / "tokens" / "k"

    def interrupted():
        for i, d in enumerate(docs):
            if i == 23:
                raise KeyboardInterrupt  # Ctrl-C in the middle of chunk 4
            yield d

    with pytest.raises(KeyboardInterrupt):
        build_shards(interrupted(), tokenizer, out, log=lambda m: None)
    assert not out.exists()  # nothing a reader could open
    partial = out.with_name(".k.partial")
    assert sorted(p.name for p in partial.glob("*.json")) == [f"chunk_00000{i}.json" for i in range(4)]
    # A chunk an older version cut another way (its record names no or other chunking) is redone.
    record = json.loads((partial / "chunk_000001.json").read_text())
    del record["chunking"]
    (partial / "chunk_000001.json").write_text(json.dumps(record))
    # The rerun tokenizes only that one and the missing chunks (8 more) and gives the whole stream.
    calls = []
    real = prepare_mod._encode_chunk
    monkeypatch.setattr(prepare_mod, "_encode_chunk", lambda task: calls.append(task[0]) or real(task))
    build_shards(iter(docs), tokenizer, out, log=lambda m: None)
    assert calls == [1, *range(4, 12)]
    assert not partial.exists()
    shards = TokenShards.open(out)
    assert np.array_equal(shards.read(0, shards.num_tokens), expected_stream(tokenizer, docs))


def test_progress_is_reported(tmp_path, docs, tokenizer):
    lines = []
    build_shards(iter(docs), tokenizer, tmp_path / "k", label="mine", total_bytes=10_000, log=lines.append)
    assert lines and lines[-1].startswith("prepare: mine:") and "MB/s" in lines[-1]


# ----------------------------------------------------------------------------------------------
# bad input: one line each, nothing left in the cache


def assert_one_line(excinfo, *fragments):
    message = str(excinfo.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_bad_inputs_are_one_line_and_leave_no_cache(tmp_path, docs, tokenizer, chat_dir, monkeypatch):
    cache = tmp_path / "cache"
    write_parquet(tmp_path / "a.parquet", docs)
    with pytest.raises(ValueError) as e:  # missing text field: name the fields present
        prepare([SourceConfig(path=str(tmp_path / "a.parquet"), text_field="body")], tokenizer, cache)
    assert_one_line(e, "'body'", "text, id")
    write_jsonl(tmp_path / "b.jsonl.gz", [{"text": "x"}, {"content": "y", "meta": 1}])
    with pytest.raises(ValueError) as e:
        prepare([SourceConfig(path=str(tmp_path / "b.jsonl.gz"))], tokenizer, cache)
    assert_one_line(e, "line 2", "content, meta")
    (tmp_path / "c.jsonl").write_text('{"text": "x"}\n{"text": "a raw\ttab"}\n')
    with pytest.raises(ValueError) as e:  # json's message ends "... at": the column completes it
        prepare([SourceConfig(path=str(tmp_path / "c.jsonl"))], tokenizer, cache)
    assert_one_line(e, "c.jsonl' line 2 is not valid JSON (Invalid control character at column 16); fix or remove")
    write_parquet(tmp_path / "empty.parquet", [])
    with pytest.raises(ValueError) as e:  # empty source
        prepare([SourceConfig(path=str(tmp_path / "empty.parquet"))], tokenizer, cache)
    assert_one_line(e, "empty")
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes((tmp_path / "a.parquet").read_bytes()[:300])
    with pytest.raises(ValueError) as e:  # corrupt parquet
        prepare([SourceConfig(path=str(corrupt))], tokenizer, cache)
    assert_one_line(e, "corrupt", "corrupt.parquet")
    rows = conversations(4)
    rows[2]["messages"] = [m for m in rows[2]["messages"] if m["role"] != "assistant"]
    write_jsonl(tmp_path / "chat.jsonl", rows)
    chat_tok = load_tokenizer(chat_dir)
    with pytest.raises(ValueError) as e:  # a chat row without an assistant turn
        prepare([SourceConfig(path=str(tmp_path / "chat.jsonl"), format="chat")], chat_tok, cache)
    assert_one_line(e, "row 3", "no assistant turn", "chat.jsonl")
    ok = str(tmp_path / "a.parquet")
    with pytest.raises(ValueError) as e:  # negative weight
        source_from_table({"path": ok, "weight": -1}, key="data.sources[0]")
    assert_one_line(e, "data.sources[0].weight")
    with pytest.raises(ValueError) as e:  # all-zero weights
        prepare([SourceConfig(path=ok, weight=0.0), SourceConfig(path=ok, weight=0.0, name="b")], tokenizer, cache)
    assert_one_line(e, "all zero")
    with pytest.raises(ValueError) as e:  # a tokenizer larger than the model's vocabulary
        prepare_sources([SourceConfig(path=ok)], max_bytes=None, tokenizer_path=str(tokenizer.path), vocab_size=300,
                        cache_dir=cache, log=lambda m: None)
    assert_one_line(e, "320 tokens", "model vocab is 300")
    with pytest.raises(ValueError) as e:  # a Hub address: download it first, in one line
        iter_documents("hf://datasets/org/name")
    assert_one_line(e, "Hugging Face Hub dataset", "hf download org/name --repo-type dataset --local-dir")
    # A relative path that is not there is missing, with the path it resolved to, whatever its shape:
    # "data/corpus" and "org/name" look alike, and neither is sent to the Hub.
    monkeypatch.chdir(tmp_path)
    for missing in ("data/corpus", "HuggingFaceFW/fineweb", "corpus.jsonl"):
        with pytest.raises(FileNotFoundError) as e:
            iter_documents(missing)
        assert_one_line(e, f"data source '{missing}' does not exist", str(tmp_path / missing))
        assert "Hub" not in str(e.value) and "network" not in str(e.value)
    with pytest.raises(FileNotFoundError) as e:
        iter_documents(str(tmp_path / "nothing" / "*.parquet"))
    assert_one_line(e, "matches no")
    assert cache_entries(cache) == []  # nothing half-written stays behind


def test_source_table_checks_keys(tmp_path):
    with pytest.raises(ValueError, match="data.sources\\[1\\].paht is not a source key"):
        source_from_table({"paht": "x"}, key="data.sources[1]")
    with pytest.raises(ValueError, match="format = 'dialog'"):
        source_from_table({"path": "x", "format": "dialog"}, key="data.sources[0]")
    spec = source_from_table({"path": "data/web/*.parquet", "weight": 3}, key="k")
    assert spec.weight == 3.0 and spec.label == "web" and spec.field == "text"


# ----------------------------------------------------------------------------------------------
# mixtures


class FakeRows:
    """n rows; row i is filled with i (enough to see which rows were read)."""

    def __init__(self, n: int, *, tag: int, seq_len: int = 4):
        self.num_train, self.num_val, self.tag, self.seq_len = n, 0, tag, seq_len

    def row(self, index: int):
        x = np.full(self.seq_len, self.tag * 100_000 + index, dtype=np.int64)
        return x, x, np.arange(self.seq_len)


def mixture(sizes=(50, 200, 1000), weights=(0.5, 0.3, 0.2), repeat=(True, True, True), **kw):
    rows = [FakeRows(n, tag=i + 1) for i, n in enumerate(sizes)]
    args = dict(names=["a", "b", "c"][: len(sizes)], weights=list(weights), repeat=list(repeat), seq_len=4,
                batch_size=8, seed=3)
    args.update(kw)
    return MixtureLoader(rows, **args)


def rows_of(batch) -> list[int]:
    return batch[0][:, 0].tolist()


def test_mixture_shares_within_2_percent_over_1000_steps_and_epochs_counted():
    loader = mixture(weights=(5, 3, 2))  # normalised to 0.5 / 0.3 / 0.2
    for step in range(1000):
        loader.next_batch()
        if step in (9, 99):  # also close early on
            m = loader.metrics()
            assert abs(m["data/a/share"] - 0.5) < 0.02 and abs(m["data/c/share"] - 0.2) < 0.02, m
    m = loader.metrics()
    for name, w in zip("abc", (0.5, 0.3, 0.2)):
        assert abs(m[f"data/{name}/share"] - w) < 0.02, m
    assert m["data/a/epochs"] == 4000 // 50 and m["data/c/epochs"] == 1600 // 1000


def test_each_epoch_reads_every_row_once():
    loader = mixture(sizes=(50, 200), weights=(1, 1))
    seen = []
    for _ in range(25):  # 200 rows, ~100 from source a: two epochs of it
        seen += [r for r in rows_of(loader.next_batch()) if r < 200_000]
    assert sorted(seen[:50]) == [100_000 + i for i in range(50)]
    assert sorted(seen[50:100]) == [100_000 + i for i in range(50)]
    assert seen[:50] != seen[50:100]  # a new permutation each epoch


def test_repeat_false_leaves_the_mixture_then_stops():
    loader = mixture(sizes=(20, 30), weights=(0.9, 0.1), repeat=(False, False))
    got = []
    with pytest.raises(ValueError, match="every data source is exhausted after 50 rows"):
        for _ in range(100):
            got += rows_of(loader.next_batch())
    # Whole batches only (48 rows): every row of a once, 28 distinct rows of b, nothing twice.
    assert len(got) == len(set(got)) == 48
    assert sorted(r for r in got if r < 200_000) == [100_000 + i for i in range(20)]


def test_mixture_resume_and_reshard_and_disjoint_ranks():
    straight = mixture()
    batches = [rows_of(straight.next_batch()) for _ in range(30)]
    first = mixture()
    for _ in range(10):
        first.next_batch()
    resumed = mixture()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert [rows_of(resumed.next_batch()) for _ in range(20)] == batches[10:]
    # Two ranks of batch 4 each: disjoint, and together the one-rank global batch.
    ranks = [mixture(batch_size=4, dp_rank=r, dp_world_size=2) for r in (0, 1)]
    for r in ranks:
        r.load_state_dict(first.state_dict())
    for step in range(10, 30):
        a, b = (rows_of(r.next_batch()) for r in ranks)
        assert not set(a) & set(b)
        assert a + b == batches[step]


def test_mixture_resume_refuses_other_sources():
    loader = mixture()
    other = mixture(sizes=(50, 200, 999))
    with pytest.raises(ValueError, match="resume with the same data.sources"):
        other.load_state_dict(loader.state_dict())


def test_text_rows_match_token_loader_windows(tmp_path, docs, tokenizer):
    write_parquet(tmp_path / "a.parquet", docs)
    _, [p] = prepare([SourceConfig(path=str(tmp_path / "a.parquet"))], tokenizer, tmp_path / "cache")
    rows = TextRows(p.shards, seq_len=16, val_fraction=0.1)
    stream = p.shards.read(0, p.shards.num_tokens)
    inputs, labels, positions = rows.row(3)
    assert np.array_equal(inputs, stream[48:64]) and np.array_equal(labels, stream[49:65])


# ----------------------------------------------------------------------------------------------
# chat


def transformers_mask(chat_dir: Path, messages: list[dict]):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(chat_dir))
    out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def test_assistant_mask_equals_transformers(tmp_path, chat_dir):
    from titan_tpu.data.chat import ChatRenderer, load_chat_template

    tok = load_tokenizer(chat_dir)
    template, special = load_chat_template(chat_dir)
    tagged = ChatRenderer(template, tok, special_tokens=special)
    plain = ChatRenderer(CHATML_PLAIN, tok, special_tokens=special)  # the prefix-difference path
    assert tagged.marks and not plain.marks
    for row in conversations(12, seed=5, turns=3):
        want_ids, want_mask = transformers_mask(chat_dir, row["messages"])
        for renderer in (tagged, plain):
            ids, mask = renderer.encode(row["messages"], where="row")
            assert ids.tolist() == want_ids
            assert mask.tolist() == want_mask
        assert 0 < sum(want_mask) < len(want_mask)


# A template that renders the last assistant turn unlike the earlier ones (Qwen3's adds an empty
# thinking block to it): the prefix rule cannot find the assistant's tokens.
LAST_TURN_THINKS = CHATML_PLAIN.replace(
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}",
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% if loop.last %}{{ '<think>\n\n</think>\n\n' }}{% endif %}")


def test_builtin_chatml_takes_over_a_template_that_rewrites_earlier_turns(tmp_path):
    """data.chat_template = chatml: the built-in ChatML with generation blocks marks the same tokens
    as transformers' return_assistant_tokens_mask; a template that rewrites earlier turns is refused
    in one line that names it."""
    from titan_tpu.data.chat import CHATML, ChatRenderer, load_chat_template

    assert LAST_TURN_THINKS != CHATML_PLAIN
    thinking = write_chat_tokenizer_dir(tmp_path / "thinking", template=LAST_TURN_THINKS)
    tok = load_tokenizer(thinking)
    rows = conversations(8, seed=3, turns=3)
    template, special = load_chat_template(thinking)
    with pytest.raises(ValueError) as e:
        ChatRenderer(template, tok, special_tokens=special).encode(rows[0]["messages"], where="row 0")
    assert_one_line(e, "rewrites earlier turns", "--data.chat_template chatml")
    template, special = load_chat_template(thinking, "chatml")
    assert template == CHATML
    reference = write_chat_tokenizer_dir(tmp_path / "chatml", template=CHATML)  # transformers reads it
    for row in rows:
        ids, mask = ChatRenderer(template, tok, special_tokens=special).encode(row["messages"], where="row")
        assert (ids.tolist(), mask.tolist()) == transformers_mask(reference, row["messages"])
    (tmp_path / "mine.jinja").write_text(CHATML_PLAIN)
    assert load_chat_template(thinking, str(tmp_path / "mine.jinja"))[0] == CHATML_PLAIN
    with pytest.raises(FileNotFoundError) as e:
        load_chat_template(thinking, str(tmp_path / "missing.jinja"))
    assert_one_line(e, "data.chat_template", "chatml")


def test_chat_rows_pack_label_only_assistant_tokens(tmp_path, chat_dir):
    rows = conversations(40, seed=2)
    write_jsonl(tmp_path / "chat.jsonl", rows)
    tok = load_tokenizer(chat_dir)
    _, [p] = prepare([SourceConfig(path=str(tmp_path / "chat.jsonl"), format="chat")], tok, tmp_path / "cache")
    chat = p.chat
    assert chat.num_conversations == 40
    from titan_tpu.data.chat import ChatRenderer, load_chat_template

    template, special = load_chat_template(chat_dir)
    renderer = ChatRenderer(template, tok, special_tokens=special)
    seq_len = int(np.sort(chat.lengths)[-3])  # the two longest conversations do not fit
    packed = ChatRows(chat, seq_len=seq_len, val_fraction=0.0, overlong="drop")
    assert packed.num_dropped == int((chat.lengths > seq_len).sum()) >= 2
    seen = 0
    for r in range(packed.num_train):
        inputs, labels, positions = packed.row(r)
        starts = np.flatnonzero(positions == 0)
        at = 0
        for c in packed.conv[packed.bounds[r]: packed.bounds[r + 1]]:
            ids, mask = renderer.encode(rows[c]["messages"], where="row")
            assert at in starts
            assert inputs[at: at + len(ids)].tolist() == ids.tolist()
            want = np.where(mask[1:] == 1, ids[1:], -100)
            assert labels[at: at + len(ids) - 1].tolist() == want.tolist()
            assert labels[at + len(ids) - 1] == -100  # never predict across conversations
            at += len(ids)
            seen += 1
        assert (labels[at:] == -100).all()  # padding is never trained
    assert seen == 40 - packed.num_dropped
    cut = ChatRows(chat, seq_len=seq_len, val_fraction=0.0, overlong="truncate")
    assert cut.num_truncated == packed.num_dropped and len(cut.conv) == 40


def test_loss_mean_is_over_trained_tokens_across_micro_batches():
    from titan_tpu.models.registry import build_model, get_model_args
    from titan_tpu.train.optim import AdamW
    from titan_tpu.train.step import EagerStep

    args = get_model_args("llama3", "debug")
    g = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, args.vocab_size, (4, 16), generator=g)
    labels = torch.randint(0, args.vocab_size, (4, 16), generator=g)
    labels[0, :12] = -100  # micro-batch 1 trains few tokens, micro-batch 2 many
    labels[1, 3:] = -100
    positions = torch.arange(16).repeat(4, 1)
    results = []
    for split in ([slice(0, 4)], [slice(0, 2), slice(2, 4)], [slice(0, 1), slice(1, 4)]):
        model = build_model(args, device=torch.device("cpu"), dtype=torch.float32, seed=0)
        opt = AdamW(dict(model.named_parameters()), beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
        step = EagerStep(model, opt, max_norm=0.0)
        results.append(step([(inputs[s], labels[s], positions[s]) for s in split], lr=1e-3))
        results[-1] = (results[-1], model.state_dict()["norm.weight"].clone())
    reference = results[0][0]
    assert reference.num_tokens == int((labels != -100).sum())
    for result, norm in results[1:]:
        assert result.num_tokens == reference.num_tokens
        assert result.loss == pytest.approx(reference.loss, rel=1e-5)
        assert torch.allclose(norm, results[0][1], atol=1e-6)


def test_build_loaders_mixes_chat_and_text_with_validation(tmp_path, chat_dir, docs):
    write_jsonl(tmp_path / "chat.jsonl", conversations(60, seed=4))
    write_parquet(tmp_path / "web.parquet", docs)
    tok = load_tokenizer(chat_dir)
    specs = [SourceConfig(path=str(tmp_path / "chat.jsonl"), format="chat", weight=1, name="chat"),
             SourceConfig(path=str(tmp_path / "web.parquet"), weight=1, name="web")]
    tokenizer, prepared = prepare(specs, tok, tmp_path / "cache")

    class Data:
        val_source, val_fraction, overlong, document_mask = "", 0.1, "drop", False

    train, val = build_loaders(Data, PreparedData(tokenizer, prepared, []), seq_len=64, batch_size=4, seed=0,
                               dp_rank=0, dp_size=1, validation=True, log=lambda m: None)
    inputs, labels, positions = train.next_batch()
    assert inputs.shape == labels.shape == positions.shape == (4, 64)
    val_batches = list(val.val_batches(3))
    assert val_batches and all(b[0].shape == (4, 64) for b in val_batches)
    assert set(train.metrics()) == {"data/chat/share", "data/chat/epochs", "data/web/share", "data/web/epochs"}


def test_prepare_data_command_fills_the_cache_training_reads(tmp_path, docs, capsys):
    from titan_tpu.cli import main

    write_parquet(tmp_path / "web" / "a.parquet", docs)
    write_jsonl(tmp_path / "val.jsonl.gz", [{"text": d} for d in make_docs(30, seed=9, tag="val")])
    recipe = tmp_path / "r.toml"
    recipe.write_text(f"""
[model]
name = "llama3"
flavor = "debug"
[data]
cache_dir = "{tmp_path / 'cache'}"
val_source = "{tmp_path / 'val.jsonl.gz'}"
[[data.sources]]
path = "{tmp_path / 'web'}"
""")
    assert main(["prepare-data", "--config", str(recipe), "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("data: tokenized") == 2 and "prepare: web:" in out and "MB/s" in out
    assert main(["prepare-data", "--config", str(recipe), "--workers", "2"]) == 0  # all cached now
    assert "tokenized" not in capsys.readouterr().out
    assert main(["prepare-data", "--config", str(recipe), "--workers", "0"]) == 2
    assert "--workers 0 must be >= 1" in capsys.readouterr().err
