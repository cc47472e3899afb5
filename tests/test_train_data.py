"""Training data: the row layouts (packed text, cut and padded text, prompt/answer with prompt masking), EOS
handling, the three file types, the tokenised-data cache, the deterministic, resumable order, and a run's draft
vocabulary, and ``python -m train.vocab`` over text files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from longspec_jax.errors import ConfigError
from longspec_jax.draft_vocab import token_counts
from tests.train_helpers import build_target_dir, build_tokenizer, corpus_lines, write_jsonl
from train.config import DataSection
from train.data import BatchOrder, Batches, build_rows
from train.vocab import main as vocab_main
from train.vocab import run_vocab

EOS, PAD = 1, 3


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _ids(tokenizer, text):
    return tokenizer(text)["input_ids"]


def test_packed_rows_concatenate_documents_with_eos(tokenizer, tmp_path):
    docs = corpus_lines(12, seed=0)
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    rows = build_rows([str(path)], DataSection(train=[str(path)], seq_len=32), tokenizer, EOS, PAD,
                      str(tmp_path / "cache"))
    stream = [t for d in docs for t in _ids(tokenizer, d) + [EOS]]
    n = len(stream) // 32
    assert len(rows) == n
    got = rows.rows(np.arange(n))
    np.testing.assert_array_equal(got["tokens"].reshape(-1), stream[:n * 32])
    np.testing.assert_array_equal(got["lengths"], 32)
    expected_targets = (got["tokens"] != EOS).astype(np.int8)  # EOS is never a target by default
    expected_targets[:, 0] = 0                                  # nothing predicts a row's first token
    np.testing.assert_array_equal(got["targets"], expected_targets)


def test_eos_is_a_target_when_asked(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", corpus_lines(6, seed=1))
    data = DataSection(train=[str(path)], seq_len=16, eos_is_target=True)
    got = build_rows([str(path)], data, tokenizer, EOS, PAD, str(tmp_path / "cache")).rows([0, 1, 2])
    assert (got["targets"][:, 1:] == 1).all()


def test_unpacked_rows_are_cut_and_padded(tokenizer, tmp_path):
    docs = ["short one", corpus_lines(1, seed=2)[0] * 3]
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    data = DataSection(train=[str(path)], seq_len=40, pack=False)
    got = build_rows([str(path)], data, tokenizer, EOS, PAD, str(tmp_path / "cache")).rows([0, 1])
    short = _ids(tokenizer, "short one") + [EOS]
    assert got["lengths"].tolist() == [len(short), 40]
    np.testing.assert_array_equal(got["tokens"][0, :len(short)], short)
    assert (got["tokens"][0, len(short):] == PAD).all() and (got["targets"][0, len(short) - 1:] == 0).all()
    np.testing.assert_array_equal(got["tokens"][1], _ids(tokenizer, docs[1])[:40])  # the first 40 tokens


def test_prompt_answer_rows_train_on_the_answer_only(tokenizer, tmp_path):
    path = tmp_path / "pa.jsonl"
    examples = [{"q": "def add(a, b):", "a": " return a + b"}, {"q": "x = 1\n" * 30, "a": "y = 2"}]
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    data = DataSection(train=[str(path)], format="prompt_answer", prompt_field="q", answer_field="a", seq_len=24)
    got = build_rows([str(path)], data, tokenizer, EOS, PAD, str(tmp_path / "cache")).rows([0, 1])
    p0, a0 = _ids(tokenizer, examples[0]["q"]), _ids(tokenizer, examples[0]["a"]) + [EOS]
    np.testing.assert_array_equal(got["tokens"][0, :len(p0) + len(a0)], p0 + a0)
    np.testing.assert_array_equal(got["targets"][0, :len(p0)], 0)
    np.testing.assert_array_equal(got["targets"][0, len(p0):len(p0) + len(a0) - 1], 1)  # answer, not its EOS
    # a long prompt loses its beginning; the answer stays whole at the end of the row
    a1 = _ids(tokenizer, "y = 2") + [EOS]
    assert got["lengths"][1] == 24
    np.testing.assert_array_equal(got["tokens"][1, -len(a1):], a1)
    np.testing.assert_array_equal(got["targets"][1, :24 - len(a1)], 0)


def test_txt_and_parquet_files_and_missing_fields(tokenizer, tmp_path):
    import pandas as pd

    docs = corpus_lines(8, seed=3)
    (tmp_path / "a.txt").write_text("\n".join(d.replace("\n", " ") for d in docs) + "\n")
    pd.DataFrame({"body": docs}).to_parquet(tmp_path / "b.parquet")
    txt = build_rows([str(tmp_path / "a.txt")], DataSection(train=["x"], seq_len=16), tokenizer, EOS, PAD,
                     str(tmp_path / "c1"))
    parquet = build_rows([str(tmp_path / "b.parquet")], DataSection(train=["x"], seq_len=16, text_field="body"),
                         tokenizer, EOS, PAD, str(tmp_path / "c2"))
    assert len(txt) > 5 and len(parquet) > 5
    with pytest.raises(ValueError, match="no field 'text'.*body"):
        build_rows([str(tmp_path / "b.parquet")], DataSection(train=["x"], seq_len=16), tokenizer, EOS, PAD,
                   str(tmp_path / "c3"))


def test_tokenised_rows_are_cached(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", corpus_lines(10, seed=4))
    data = DataSection(train=[str(path)], seq_len=16)
    first = build_rows([str(path)], data, tokenizer, EOS, PAD, str(tmp_path / "cache"))
    cached = sorted(p.name for p in (tmp_path / "cache").rglob("cache-*.arrow"))
    assert len(cached) >= 2  # tokenised documents and rows

    class Exploding:  # a second build must not tokenise again
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __call__(self, *a, **k):
            raise AssertionError("tokenised again")

    again = build_rows([str(path)], data, Exploding(), EOS, PAD, str(tmp_path / "cache"))
    np.testing.assert_array_equal(again.rows(np.arange(len(first)))["tokens"],
                                  first.rows(np.arange(len(first)))["tokens"])


def test_batch_order_is_a_function_of_the_step():
    order = BatchOrder(num_rows=10, batch_size=4, seed=7)
    seen = np.concatenate([order.indices(s) for s in range(5)])  # 20 rows = two epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert list(seen[:10]) != list(seen[10:20])  # each epoch has its own permutation
    fresh = BatchOrder(num_rows=10, batch_size=4, seed=7)
    np.testing.assert_array_equal(fresh.indices(3), order.indices(3))  # resuming at step 3 reads the same
    assert list(BatchOrder(10, 4, seed=8).indices(0)) != list(order.indices(0))


def test_batches_resume_where_they_left_off(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", corpus_lines(20, seed=5))
    rows = build_rows([str(path)], DataSection(train=[str(path)], seq_len=16), tokenizer, EOS, PAD,
                      str(tmp_path / "cache"))
    run = Batches(rows, BatchOrder(len(rows), 4, 0), micro_batches=2, start=0)
    full = [run.next() for _ in range(5)]
    run.close()
    resumed = Batches(rows, BatchOrder(len(rows), 4, 0), micro_batches=2, start=3)
    for step in (3, 4):
        batch = resumed.next()
        assert batch["tokens"].shape == (2, 2, 16)
        for k in batch:
            np.testing.assert_array_equal(batch[k], full[step][k])
    resumed.close()


def test_a_runs_draft_vocabulary_is_its_most_frequent_predicted_tokens(tokenizer, tmp_path):
    """Counted over target positions only (prompts and untrained EOS left out), written where export finds it."""
    path = tmp_path / "pa.jsonl"
    examples = [{"q": "zzzz " * 20, "a": f" return x + {i}"} for i in range(30)]
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    data = DataSection(train=[str(path)], format="prompt_answer", prompt_field="q", answer_field="a", seq_len=48)
    rows = build_rows([str(path)], data, tokenizer, EOS, PAD, str(tmp_path / "cache"))
    got = rows.rows(np.arange(len(rows)))
    counts = np.bincount(got["tokens"][got["targets"] > 0], minlength=len(tokenizer))
    ids = run_vocab(rows, 5, len(tokenizer), str(tmp_path / "run"))
    np.testing.assert_array_equal(np.load(tmp_path / "run" / "draft_vocab.npy"), ids)
    assert ids.size == 5 and (np.diff(ids) > 0).all()
    np.testing.assert_array_equal(run_vocab(rows, 5, len(tokenizer), None), ids)  # other processes write nothing
    assert counts[ids].min() >= np.delete(counts, ids).max() and counts[ids].min() > 0
    assert not np.isin(_ids(tokenizer, "zzzz"), ids).any() and EOS not in ids
    with pytest.raises(ConfigError, match=f"draft.vocab_size 999 exceeds the target's vocabulary of {len(tokenizer)}"):
        run_vocab(rows, 999, len(tokenizer), str(tmp_path / "run"))


def test_vocab_cli_writes_the_most_frequent_tokens_of_text_files(tmp_path, capsys):
    """Into a draft directory (``draft_vocab.npy``) or a ``.npy`` path; a bad size or a missing file is named."""
    from transformers import AutoTokenizer

    target_dir = build_target_dir(tmp_path / "target")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    docs = corpus_lines(12, seed=0)
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    counts = token_counts([_ids(tokenizer, d) for d in docs], len(tokenizer))
    base = ["--target", str(target_dir), "--data", str(path), "--size", "7"]
    assert vocab_main(base + ["--out", str(tmp_path / "draft")]) == 0
    assert f"7 of {len(tokenizer)} tokens" in capsys.readouterr().err
    ids = np.load(tmp_path / "draft" / "draft_vocab.npy")
    assert ids.size == 7 and (np.diff(ids) > 0).all() and counts[ids].min() >= np.delete(counts, ids).max()
    assert vocab_main(base + ["--out", str(tmp_path / "k7.npy")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "k7.npy"), ids)
    for args, words in ((["--size", "0"], "--size must be in"), (["--data", str(tmp_path / "none.jsonl")],
                                                                 "does not exist")):
        with pytest.raises(SystemExit):
            vocab_main(base + args + ["--out", str(tmp_path / "x")])
        assert words in capsys.readouterr().err
