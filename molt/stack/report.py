"""Progress display and end-of-run report for `molt up`.

The trainer appends one JSON line per step to `steps.jsonl` (step, reward_mean, mismatch_kl,
staleness_mean, samples, seconds...). Progress prints a line per new step plus the queue lag scraped
from the trainer's /metrics; at the end `summary.json` and `reward.png` are written to the run folder.
"""

from __future__ import annotations

import functools
import json
import math
import time
from pathlib import Path

import httpx

from molt import strict_json


@functools.cache
def _scraper() -> httpx.Client:
    """One client for every scrape: `molt up` scrapes the gateway each second while the trainer runs, and an
    httpx.get builds a client per call, loading the CA bundle into a new TLS context. No
    kept-alive connections: a service restarted on its port is reached afresh."""
    return httpx.Client(timeout=3, limits=httpx.Limits(max_keepalive_connections=0))


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over label sets}; {} if unreachable."""
    try:
        text = _scraper().get(url).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


class Progress:
    def __init__(self, path: Path, total_steps: int | None, enabled: bool = True) -> None:
        self.path = path
        self.total = total_steps
        self.enabled = enabled
        self.rows: list[dict] = []
        self._quiet_rows = 0  # rows read quietly (a resumed run's earlier steps): not in this start's rate
        self._offset = 0
        self._started = time.monotonic()
        self.last_metrics: dict[str, float] = {}

    def poll(self, metrics_url: str | None = None, quiet: bool = False) -> None:
        """Read the steps logged since the last poll, printing a line for each unless ``quiet``."""
        if self.path.exists():
            with open(self.path) as f:
                f.seek(self._offset)
                chunk = f.read()
                # Only consume whole lines: the trainer may be mid-write.
                complete, _, _ = chunk.rpartition("\n")
                if complete:
                    self._offset += len(complete) + 1
                    for line in complete.splitlines():
                        if line.strip():
                            self.rows.append(json.loads(line))
                            if quiet:
                                self._quiet_rows = len(self.rows)
                            else:
                                self._print(self.rows[-1], metrics_url)

    def _print(self, row: dict, metrics_url: str | None) -> None:
        if metrics_url:
            self.last_metrics = scrape(metrics_url) or self.last_metrics
        if not self.enabled:
            return
        m = self.last_metrics
        samples = sum(r.get("samples", 0) for r in self.rows[self._quiet_rows :])
        rate = samples / max(time.monotonic() - self._started, 1e-9)
        print(
            f"[step {row.get('step', len(self.rows)):>4}/{self.total or '?'}]"
            f" reward {_fmt(row.get('reward_mean'), '.3f')}"
            f" | mismatch_kl {_fmt(row.get('mismatch_kl'), '.2e')}"
            f" (fresh {_fmt(row.get('mismatch_kl_fresh'), '.1e')})"
            # Rollouts written but not yet read by the trainer. Not the pending entries: with checkpoints those
            # include every trained one until its step's checkpoint acks it, so they climb to save_steps batches.
            f" | queue lag {m.get('molt_queue_undelivered_entries', 0):.0f}"
            f" | staleness {_fmt(row.get('staleness_mean'), '.2f')}"
            f" | {rate:.1f} samples/s | version {row.get('policy_version', '?')}",
            flush=True,
        )


def _fmt(value: float | None, spec: str) -> str:
    """``value`` in ``spec``; "-" for a metric the step did not have (no fresh tokens, say)."""
    v = _value(value)
    return "-" if v is None else format(v, spec)


def _value(value: float | None) -> float | None:
    """A logged metric; None where the step did not have it: absent, null, or NaN (files written before the trainer
    wrote strict JSON)."""
    return None if value is None or math.isnan(value) else value


def _mean(xs: list[float | None]) -> float:
    """Mean of the logged values (a step without the metric logs null, older files NaN)."""
    vals = [v for x in xs if (v := _value(x)) is not None]
    return sum(vals) / len(vals) if vals else float("nan")


def finish_report(
    run_dir: Path,
    progress: Progress,
    gateway_counts: dict[str, float],
    wall_s: float,
    recipe: str,
    pod_versions: list[float | None] | None = None,
    interrupted: bool = False,
    restarts: dict[str, int] | None = None,
) -> dict:
    """``restarts``: service name -> times `molt up` started it again after it died (only those it did)."""
    # A step trained after the last checkpoint of a run that was killed is trained again on resume: its last row.
    rows = list({r.get("step", -1 - i): r for i, r in enumerate(progress.rows)}.values())
    rows.sort(key=lambda r: r.get("step", 0))
    rewards = [r.get("reward_mean") for r in rows]
    k = max(1, math.ceil(len(rows) * 0.1))
    samples = sum(r.get("samples", 0) for r in rows)
    summary = {
        "recipe": recipe,
        "steps": len(rows),
        "reward_first_10pct": _mean(rewards[:k]),
        "reward_last_10pct": _mean(rewards[-k:]),
        "samples_per_s": samples / wall_s if wall_s else 0.0,
        "wall_s": round(wall_s, 1),
        "trajectories_produced": int(gateway_counts.get("molt_gateway_trajectories_written_total", 0)),
        "trajectories_trained": int(sum(r.get("trajectories", r.get("samples", 0)) for r in rows)),
        "mismatch_kl_max": max((abs(v) for r in rows if (v := _value(r.get("mismatch_kl"))) is not None), default=0.0),
        # Tokens scored by the very weights that generated them: engine-vs-trainer numerics alone.
        "mismatch_kl_fresh_max": max(
            (abs(v) for r in rows if (v := _value(r.get("mismatch_kl_fresh"))) is not None),
            default=None,
        ),
        "staleness_max": max((r.get("staleness_max", 0) for r in rows), default=0),
        "final_policy_version": rows[-1].get("policy_version") if rows else None,
        "pod_policy_versions": [None if v is None else int(v) for v in (pod_versions or [])],
    }
    if interrupted:
        summary["interrupted"] = True
    if restarts:
        summary["restarts"] = dict(restarts)
    evals = run_dir / "eval.jsonl"
    if evals.exists() and evals.read_text().strip():  # the last evaluation (the only one with --eval.eval_only)
        summary["last_eval"] = json.loads(evals.read_text().strip().splitlines()[-1])
    (run_dir / "summary.json").write_text(strict_json.dumps(summary, indent=2))
    _plot(run_dir / "reward.png", rows, recipe)
    return summary


def _plot(path: Path, rows: list[dict], recipe: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    steps = [r.get("step", i + 1) for i, r in enumerate(rows)]
    ax.plot(steps, [math.nan if (v := _value(r.get("reward_mean"))) is None else v for r in rows], marker="o", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(f"molt up --recipe {recipe}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
