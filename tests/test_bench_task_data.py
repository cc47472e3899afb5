"""Tasks-benchmark inputs on hand-made data: templates, jsonl errors, buckets and filters, and the repo-level
completion cut (a character-level tokenizer keeps the arithmetic checkable by hand)."""

from __future__ import annotations

import json

import pytest

from infer.bench.task_data import (BUCKETS, Sample, bucket_name, chat_prompt, load_longbench, load_reasoning,
                                   repo_completion, select)


class CharTokenizer:
    """One token per character (id = code point); no chat template."""

    chat_template = None

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        out = {"input_ids": [ord(c) for c in text]}
        if return_offsets_mapping:
            out["offset_mapping"] = [(i, i + 1) for i in range(len(text))]
        return out

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_longbench_templates_and_fields(tmp_path):
    path = tmp_path / "qmsum.jsonl"
    path.write_text(json.dumps({"context": "CTX", "input": "Q?", "answers": ["A"], "length": 3, "_id": "x1"}) + "\n")
    [sample] = load_longbench(str(path), "qmsum", CharTokenizer())
    user = ("You are given a meeting transcript and a query containing a question or instruction. Answer the "
            "query in one or more sentences.\n\nTranscript:\nCTX\n\nNow, answer the query based on the above "
            "meeting transcript in one or more sentences.\n\nQuery: Q?")
    assert sample.prompt == f"<s>system\nYou are a helpful assistant</s>\n<s>user\n{user}</s>\n<s>assistant\nAnswer:"
    assert (sample.id, sample.answers, sample.length) == ("x1", ["A"], len(sample.prompt))
    path.write_text(json.dumps({"context": "c", "input": "", "answers": []}) + "\n")
    [code] = load_longbench(str(path), "lcc", CharTokenizer())
    assert code.prompt.endswith("user\nPlease complete the code given below. \ncNow, complete the code given."
                                "</s>\n<s>assistant\n")


def test_bad_inputs_name_the_problem(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"context": "c", "answers": []}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:1: missing field\(s\) \['input'\]"):
        load_longbench(str(path), "gov_report", CharTokenizer())
    path.write_text('{"prompt": "p", "answer": "a"}\n{oops\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: not valid JSON"):
        load_reasoning(str(path), CharTokenizer())
    with pytest.raises(ValueError, match="unknown LongBench task 'narrativeqa'"):
        load_longbench(str(path), "narrativeqa", CharTokenizer())


def test_chat_template_is_used_when_the_tokenizer_has_one():
    class Templated(CharTokenizer):
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"

    assert chat_prompt(Templated(), "hi", "Summary:") == \
        "system:You are a helpful assistant|user:hi|assistant:Summary:"


def test_buckets_and_select():
    assert [bucket_name(n) for n in (2048, 2049, 4096, 4097, 32768, 32769)] == \
        [None, "2-4k", "2-4k", "4-8k", "16-32k", None]
    samples = [Sample("t", str(n), "", [], [0] * n) for n in (1200, 1201, 3000, 3500, 5000, 40000)]
    wide = ((1024, 2048),) + BUCKETS + ((32768, 65536),)
    assert [s.id for s in select(samples, buckets=wide)] == ["1201", "3000", "3500", "5000", "40000"]
    assert [s.id for s in select(samples, max_tokens=4000, buckets=wide)] == ["1201", "3000", "3500"]
    assert [s.id for s in select(samples)] == ["3000", "3500", "5000"]  # inside the default buckets
    assert [s.id for s in select(samples, buckets=((2048, 4096),), limit=1)] == ["3000"]


def test_repo_completion_cuts_after_a_def_and_answers_with_the_function():
    body = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(400))  # ~10k characters
    docs = [{"repo": "r", "text": body[:5000]}, {"repo": "r", "text": body[5000:]}]
    text = body[:5000] + "\n" + body[5000:]
    samples = repo_completion(docs, CharTokenizer(), buckets=((2048, 4096), (4096, 8192)), per_bucket=3)
    assert [s.bucket for s in samples] == ["2-4k"] * 3 + ["4-8k"] * 3
    for s in samples:
        cut = int(s.id.split(":")[1])
        assert s.prompt.endswith("def ") and text[:cut].endswith(s.prompt)
        assert s.answers[0] == text[cut:text.index("def ", cut)]
        assert s.answers[0].startswith("f") and s.answers[0].endswith("\n\n")
