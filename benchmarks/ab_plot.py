"""One picture of a recycling A/B: running requests and KV pages in use, OFF vs ON, on one x axis.

Shared by bench_offline.py (x = engine step), bench_head_wise_swa.py (x = seconds, sampled from
/metrics) and simulate_serving.py (x = virtual seconds), so the three A/B pictures read alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class ArmSeries:
    label: str  # "recycle OFF", "1-D", ...
    x: list
    running: list
    pages_in_use: list


COLORS = ("tab:gray", "tab:blue")  # OFF, ON: the baseline recedes, the feature stands out


def plot_running_and_pages(path: str, title: str, arms: list[ArmSeries], pages_total: float, xlabel: str) -> None:
    """Write a PNG (small enough to commit: 8 x 5 inches at 100 dpi) of both arms' running requests and
    pages in use, with the pool's size as a dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_run, ax_pages) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    for arm, color in zip(arms, COLORS):
        ax_run.step(arm.x, arm.running, where="post", color=color, label=arm.label)
        ax_pages.step(arm.x, arm.pages_in_use, where="post", color=color, label=arm.label)
    if pages_total:
        ax_pages.axhline(pages_total, color="black", linestyle=":", linewidth=1, label="pages in the pool")
    ax_run.set_ylabel("running requests")
    ax_pages.set_ylabel("KV pages in use")
    ax_pages.set_xlabel(xlabel)
    ax_run.set_title(title, fontsize=10)
    for ax in (ax_run, ax_pages):
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
