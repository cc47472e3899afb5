"""``tools.evidence``: its steps' commands are those its benchmarks accept, and its runner keeps a deadline, records
every step, and resumes a run without repeating a completed step."""

from __future__ import annotations

import argparse
import json

import pytest

from tools import evidence
from tools.evidence import Step


def plan_args(tmp_path, *extra):
    return ["--out", str(tmp_path / "out"), "--pad-script", "pad_model.py", "--corpus", str(tmp_path), *extra]


def test_every_step_uses_only_options_its_benchmark_accepts(tmp_path, capsys, monkeypatch):
    import infer.bench.tasks
    import tools.profile
    import train.vocab

    mains = {("infer.bench", "tasks"): infer.bench.tasks.main, ("tools.profile",): tools.profile.main,
             ("train.vocab",): train.vocab.main}
    helps = {}
    for key, main in mains.items():
        with pytest.raises(SystemExit):
            main(["--help"])
        helps[key] = capsys.readouterr().out
    (tmp_path / "draft").mkdir()
    p = argparse.Namespace(out="OUT", pad_script="pad.py", corpus="CORPUS", fixture="FIXTURE",
                           draft=str(tmp_path / "draft"), work=str(tmp_path / "work"))
    steps = evidence.plan(p)
    vocab = next(s for s in steps if s.name == "vocab_tokens")
    ran = []
    monkeypatch.setattr(evidence.subprocess, "run", lambda argv, check: ran.append(argv))
    vocab.prepare()  # the draft copied, its vocabulary counted by train.vocab
    assert (tmp_path / "work" / "draft_k8192").is_dir() and ran[0][1:3] == ["-m", "train.vocab"]
    steps.append(Step("prepare", 0, ran[0][2:]))
    assert len({s.name for s in steps}) == len(steps) == 16
    for step in steps:
        key = next(k for k in mains if tuple(step.argv[:len(k)]) == k)
        flags = [a for a in step.argv if a.startswith("--")]
        assert flags and all(f" {flag} " in helps[key] or f" {flag}\n" in helps[key] for flag in flags), step.name
    for step in steps[:-1]:
        assert step.argv[step.argv.index("--out") + 1] == f"OUT/{step.name}"
    assert f"ours={tmp_path}/draft,k8192={tmp_path}/work/draft_k8192" in vocab.argv


def test_runner_keeps_the_deadline_records_and_resumes(tmp_path):
    out = str(tmp_path)
    prepared = []
    ok = Step("ok", 0, ["this"], lambda: prepared.append("ok"))
    failing = Step("failing", 0, ["json.tool", str(tmp_path / "missing.json")], lambda: prepared.append("failing"))
    too_long = Step("too_long", 10**6, ["this"])
    records = evidence.run([ok, failing, too_long], out, deadline_s=600)
    assert [(r["step"], r["rc"]) for r in records] == [("ok", 0), ("failing", 2), ("too_long", "not started")]
    assert records[0]["command"] == "python -m this" and prepared == ["ok", "failing"]
    assert "Beautiful is better than ugly" in (tmp_path / "ok" / "log.txt").read_text()
    assert json.loads((tmp_path / "failing" / "step.json").read_text())["rc"] == 2
    again = evidence.run([ok, failing], out, deadline_s=600)
    assert again[0] == records[0] and again[1]["rc"] == 2
    assert prepared == ["ok", "failing", "failing"]  # a step done before is kept, a failed one runs again

    sleeper = Step("sleeper", 0, ["timeit", "-n", "1", "-r", "1", "import time; time.sleep(30)"])
    assert evidence.run([sleeper], out, deadline_s=1.0)[0]["rc"] == "timeout"

    def broken():
        raise OSError("no space left")
    assert evidence.run([Step("broken", 0, ["this"], broken)], out, 600)[0]["rc"] == "prepare failed: no space left"


def test_command_line(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        evidence.main(plan_args(tmp_path, "--steps", "long_output,nonsense"))
    assert "--steps: unknown nonsense; the steps are draft_level_llama3," in capsys.readouterr().err
    assert evidence.main(plan_args(tmp_path, "--steps", "long_128k,auto_t0_b1", "--list")) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == ["long_128k", "auto_t0_b1"]
    assert "--rope-parameters" in listed[0] and "--temperatures 0" in listed[1]
    assert not (tmp_path / "out").exists()  # --list runs nothing

    monkeypatch.setattr(evidence, "plan", lambda args: [Step("ok", 0, ["this"])])
    assert evidence.main(plan_args(tmp_path)) == 0
    report = json.loads((tmp_path / "out" / "evidence.json").read_text())
    assert [r["step"] for r in report["steps"]] == ["ok"]
    assert "| ok | 0 |" in (tmp_path / "out" / "evidence.md").read_text()
    monkeypatch.setattr(evidence, "plan", lambda args: [Step("bad", 0, ["json.tool", "/missing"])])
    assert evidence.main(plan_args(tmp_path)) == 1
