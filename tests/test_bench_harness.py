"""infer.bench.harness: in-loop timing arithmetic, the copy ceiling, logging and the report writers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax.numpy as jnp
import pytest

from infer.bench import harness


def test_loop_count():
    assert harness.loop_count(0.025, 1e-3) == 25
    assert harness.loop_count(0.025, 0.024) == 2  # rounds up
    assert harness.loop_count(0.0, 1e-3) == 1     # at least one step
    assert harness.loop_count(1.0, 0.0) == 1_000_000  # at most the limit
    assert harness.loop_count(1.0, 1e-9, limit=50) == 50


def _add_one(c):
    return c + 1


def test_time_loop_runs_reps_steps_per_call_after_a_warm_up():
    t, carry = harness.time_loop(_add_one, jnp.int32(0), (), reps=3, calls=2)
    assert int(carry) == 3 * (1 + 2)  # warm-up + 2 timed calls, 3 steps each
    assert t.reps == 3 and len(t.call_times_s) == 2
    assert t.call_s == pytest.approx(sorted(t.call_times_s)[0] / 2 + sorted(t.call_times_s)[1] / 2)
    assert t.per_step_s == pytest.approx(t.call_s / 3)
    assert t.compile_s > 0 and t.first_call_s > 0
    assert "while" in t.compiled.as_text()  # one fori_loop


def test_time_loop_consts_and_reset():
    def step(c, inc):
        return c + inc

    reset_calls = []

    def reset(c):
        reset_calls.append(int(c))
        return jnp.zeros_like(c)

    t, carry = harness.time_loop(step, jnp.float32(0), (jnp.float32(2),), reps=4, calls=3, reset=reset)
    assert reset_calls == [8, 8, 8]  # after the warm-up and each timed call but the last
    assert float(carry) == 8


def test_time_loop_rechooses_reps_for_the_target_once():
    # every call lasts far more than 10x a 1e-12 s target: reps drops to one and the loop compiles again
    t, carry = harness.time_loop(_add_one, jnp.int32(0), (), reps=5, calls=2, target_s=1e-12)
    assert t.reps == 1
    assert int(carry) == 5 + 1 + 2  # warm-up of the first loop, then of the second, then 2 calls


def test_time_loop_compiles_with_the_options_given():
    with pytest.raises(Exception, match="xla_no_such_option"):
        harness.time_loop(_add_one, jnp.int32(0), (), reps=2, options={"xla_no_such_option": 1})


def test_net_of_overhead():
    r = harness.net_of_overhead(30e-6, 12e-6)
    assert r["us"] == pytest.approx(18.0) and r["raw_us"] == pytest.approx(30.0)
    assert r["overhead_us"] == pytest.approx(12.0)


def test_copy_bandwidth_smoke():
    c = harness.copy_bandwidth(smoke=True)
    assert c["buffer_bytes"] == 4 * 2**12 and c["bytes"] == 2 * c["buffer_bytes"]
    assert c["bytes_per_s"] == pytest.approx(c["bytes"] / c["seconds"])
    assert c["seconds"] == pytest.approx(c["call_s"] / c["iters"])
    assert c["dispatch"]["bytes_per_s"] > 0


def test_log_and_error_text(capsys):
    harness.log("hello")
    assert re.fullmatch(r"\[bench \d\d:\d\d:\d\d\] hello\n", capsys.readouterr().out)
    assert harness.error_text(ValueError("x" * 50), limit=20) == "ValueError: xxxxxxxx"


def test_record_failure_keeps_the_error_and_logs_it(capsys):
    rec = dict(impl="mosaic")
    try:
        raise RuntimeError("y" * 2000)
    except RuntimeError as exc:
        harness.record_failure(rec, "padded S=16384 mosaic", exc)
    assert rec == dict(impl="mosaic", error="RuntimeError: " + "y" * 986)
    captured = capsys.readouterr()
    assert re.fullmatch(r"\[bench [\d:]{8}\]   padded S=16384 mosaic: FAILED RuntimeError: y{386}\n", captured.out)
    assert "Traceback" in captured.err


def test_markdown_and_report_writers(tmp_path):
    lines = harness.md_header(["a", "b"]) + [harness.md_row([1, 2.5])]
    assert lines == ["| a | b |", "|---|---|", "| 1 | 2.5 |"]
    json_path, md_path = harness.write_report(tmp_path / "new", "bench_x", {"p": Path("/x"), 3: [1]}, "# md\n")
    assert json.loads(json_path.read_text()) == {"p": "/x", "3": [1]}
    assert md_path.read_text() == "# md\n" and md_path.name == "bench_x.md"


def test_time_runs_times_each_run_from_a_fresh_start():
    starts = []

    def start():
        starts.append(len(starts))
        return jnp.float32(len(starts))

    seconds, last = harness.time_runs(start, lambda x: x * 10, reps=3)
    assert starts == [0, 1, 2, 3]  # the warm-up, then 3 timed runs
    assert float(last) == 40 and seconds > 0


def test_arg_parser_has_out_and_smoke():
    p = harness.arg_parser("x", "doc", "tiny")
    args = p.parse_args(["--out", "d", "--smoke"])
    assert args.out == "d" and args.smoke and p.prog == "python -m infer.bench x"
    with pytest.raises(SystemExit):
        p.parse_args([])  # --out is required
