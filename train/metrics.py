"""Where a training run's numbers go: ``<dir>/metrics.jsonl`` (one JSON object per logged step), TensorBoard
(``tensorboardX``), a line on stdout, and a tqdm progress bar with loss, tokens/s and ETA."""

from __future__ import annotations

import json
import math
import os

from tqdm.auto import tqdm

METRICS_FILE = "metrics.jsonl"
TIMING_KEYS = ("tokens_per_s", "elapsed_s", "mfu")  # differ between runs of the same computation


def read_metrics(directory) -> list[dict]:
    path = os.path.join(os.fspath(directory), METRICS_FILE)
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class MetricsLog:
    """Opened at ``start_step``: lines of later steps (written after the checkpoint a resumed run starts from)
    are dropped first, so a resumed run's file equals an uninterrupted run's, timing fields aside."""

    def __init__(self, directory, total_steps: int, start_step: int, *, tensorboard: bool = True,
                 progress: bool = True):
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, METRICS_FILE)
        kept = [m for m in read_metrics(directory) if m["step"] <= start_step]
        with open(self.path, "w") as f:
            f.writelines(json.dumps(m) + "\n" for m in kept)
        self.file = open(self.path, "a")
        self.writer = None
        if tensorboard:
            from tensorboardX import SummaryWriter
            self.writer = SummaryWriter(os.path.join(directory, "tensorboard"), purge_step=start_step + 1)
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, disable=not progress)

    def advance(self, steps: int = 1) -> None:
        self.bar.update(steps)

    def write(self, step: int, metrics: dict) -> None:
        record = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            for name, value in record.items():
                if name != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(name, value, step)
        shown = {k: record[k] for k in ("loss", "tokens_per_s", "eval_chain_tau") if k in record}
        self.bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=False)
        self.bar.write(" ".join(f"{k}={_fmt(v)}" for k, v in record.items()))

    def close(self) -> None:
        self.bar.close()
        self.file.close()
        if self.writer is not None:
            self.writer.close()


def _plain(value):
    value = value.item() if hasattr(value, "item") else value
    return float(value) if isinstance(value, float) else value


def _fmt(value) -> str:
    return f"{value:.5g}" if isinstance(value, float) else str(value)
