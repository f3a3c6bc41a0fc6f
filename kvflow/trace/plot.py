"""One figure from a step trace: (a) a timeline, one lane per request, prefill chunks and decode
steps in different colours, preemptions and finishes marked; (b) tokens scheduled per step
against the budget, split prefill/decode; (c) KV blocks in use (and cached-free, when the trace
has them). Stays readable from 5 requests to 500: lanes thin out and labels drop."""
from __future__ import annotations

import numpy as np
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from kvflow.trace.reader import Step

PREFILL, DECODE = "#4C72B0", "#DD8452"
PREEMPT, FINISH = "#C44E52", "#222222"
USED, CACHED = "#55A868", "#B8DDB9"
TITLES = ("Timeline: one lane per request", "Tokens scheduled per step",
          "KV cache blocks in use")
LEGEND = dict(loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False,
              borderaxespad=0.2)  # above the panel, right of its title: never over the data
MAX_LABELLED_LANES = 40  # beyond this, lane names would overlap
MAX_ANNOTATED = (12, 60)  # requests, steps: small enough to print each prefill chunk's size


def _rect(x0: float, x1: float, y: float, h: float) -> list[tuple[float, float]]:
    return [(x0, y - h / 2), (x1, y - h / 2), (x1, y + h / 2), (x0, y + h / 2)]


def _timeline(ax, steps: list[Step], ids: list[str]) -> None:
    lane = {rid: i for i, rid in enumerate(ids)}
    many = len(ids) > MAX_LABELLED_LANES
    h = 0.9 if many else 0.7
    few = len(ids) <= MAX_ANNOTATED[0] and len(steps) <= MAX_ANNOTATED[1]
    boxes: dict[str, list] = {"prefill": [], "decode": []}
    # Merge a request's consecutive decode steps into one box (500 lanes x 1000 steps stays
    # cheap); small runs keep one box per step so that the steps can be counted.
    merge = not few
    open_decode: dict[str, list[float]] = {}
    for s in steps:
        for r in s.requests:
            if r.id not in lane:
                continue
            y = lane[r.id]
            if r.phase == "decode" and not merge:
                boxes["decode"].append(_rect(s.step, s.step + 1, y, h))
                continue
            if r.phase == "decode":
                run = open_decode.get(r.id)
                if run is not None and run[1] == s.step:
                    run[1] = s.step + 1
                    continue
                if run is not None:
                    boxes["decode"].append(_rect(run[0], run[1], y, h))
                open_decode[r.id] = [s.step, s.step + 1]
                continue
            boxes["prefill"].append(_rect(s.step, s.step + 1, y, h))
            if few:
                ax.text(s.step + 0.5, y, str(r.tokens), ha="center", va="center", fontsize=7,
                        color="white")
    for rid, (x0, x1) in open_decode.items():
        boxes["decode"].append(_rect(x0, x1, lane[rid], h))
    edge = "none" if many else "white"
    for phase, colour in (("prefill", PREFILL), ("decode", DECODE)):
        ax.add_collection(PolyCollection(boxes[phase], facecolors=colour, edgecolors=edge,
                                         linewidths=0.4))
    size = 10 if not many else max(1.0, 400 / len(ids))
    # Past ~40 lanes a lane's end already shows its finish; marks would only add clutter.
    marks = [("preempted", PREEMPT, "X")] + ([] if many else [("finished", FINISH, "|")])
    for kind, colour, marker in marks:
        xs, ys = [], []
        for s in steps:
            for rid in getattr(s, kind):
                if rid in lane:
                    xs.append(s.step + (1 if kind == "finished" else 0))
                    ys.append(lane[rid])
        if xs:
            ax.scatter(xs, ys, s=size * (6 if kind == "preempted" else 14), c=colour, marker=marker,
                       linewidths=(1.2 if kind == "preempted" else 2.0) if not many else 0.6, zorder=3)
    ax.set_ylim(len(ids) - 0.5, -0.5)  # first request on top
    if many:
        ax.set_yticks([])
        ax.set_ylabel(f"{len(ids)} requests")
    else:
        ax.set_yticks(range(len(ids)), ids, fontsize=8 if len(ids) > 12 else 9)
        ax.set_ylabel("request")
    handles = [Patch(color=PREFILL, label="prefill chunk"), Patch(color=DECODE, label="decode"),
               Line2D([], [], color=PREEMPT, marker="X", ls="none", label="preempted")]
    if not many:
        handles.append(Line2D([], [], color=FINISH, marker="|", ls="none", markersize=10,
                              markeredgewidth=2, label="finished"))
    ax.legend(handles=handles, **LEGEND, ncol=4)


def _dense(steps: list[Step], value) -> tuple[np.ndarray, np.ndarray]:
    """Values per step over the whole step range (steps the trace skipped, being empty, are 0)
    and the bin edges for `stairs`."""
    first, last = steps[0].step, steps[-1].step
    out = np.zeros(last - first + 1)
    for s in steps:
        out[s.step - first] = value(s)
    return out, np.arange(first, last + 2)


def _tokens(ax, steps: list[Step]) -> None:
    prefill, edges = _dense(steps, lambda s: s.prefill_tokens)
    decode, _ = _dense(steps, lambda s: s.decode_tokens)
    ax.stairs(prefill, edges, fill=True, color=PREFILL, label="prefill tokens")
    ax.stairs(prefill + decode, edges, baseline=prefill, fill=True, color=DECODE, label="decode tokens")
    budget = max(s.budget for s in steps)
    ax.axhline(budget, color="black", ls="--", lw=1, label=f"budget ({budget})")
    ax.set_ylim(0, budget * 1.15)
    ax.set_ylabel("tokens")
    ax.legend(**LEGEND, ncol=3)


def _blocks(ax, steps: list[Step]) -> None:
    used, edges = _dense(steps, lambda s: s.used_blocks)
    ax.stairs(used, edges, fill=True, color=USED, label="in use")
    if any(s.cached_free_blocks for s in steps):
        cached, _ = _dense(steps, lambda s: s.cached_free_blocks or 0)
        ax.stairs(used + cached, edges, baseline=used, fill=True, color=CACHED,
                  label="free, holding a cached prefix")
    total = max(s.num_blocks for s in steps)
    ax.axhline(total, color="black", ls="--", lw=1, label=f"pool ({total} blocks)")
    ax.set_ylim(0, total * 1.15)
    ax.set_ylabel("blocks")
    ax.set_xlabel("engine step")
    ax.legend(**LEGEND, ncol=3)


def plot_trace(steps: list[Step], ids: list[str] | None = None, title: str | None = None) -> Figure:
    """The three-panel figure for `steps`; lanes for `ids` (default: every request that ran)."""
    if not steps:
        raise ValueError("the trace has no steps to plot")
    if ids is None:
        ids = list(dict.fromkeys(r.id for s in steps for r in s.requests))
    lane_height = 0.28 if len(ids) <= MAX_LABELLED_LANES else 0.0
    timeline_h = min(max(1.8, lane_height * len(ids)), 12) if lane_height else 6.0
    # A bare Figure (no pyplot): rendered by Agg on savefig, no GUI backend, no global state.
    fig = Figure(figsize=(11, timeline_h + 4.6), layout="constrained")
    a, b, c = fig.subplots(3, 1, sharex=True,
                           gridspec_kw={"height_ratios": [timeline_h, 2.1, 1.9]})
    _timeline(a, steps, ids)
    _tokens(b, steps)
    _blocks(c, steps)
    for ax, t in zip((a, b, c), TITLES):
        ax.set_title(t, fontsize=10, loc="left")
    span = steps[-1].step + 1 - steps[0].step
    a.set_xlim(steps[0].step, steps[-1].step + 1 + 0.01 * span)  # room for the last finish mark
    c.xaxis.set_major_locator(MaxNLocator(integer=True))
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


def save_plot(steps: list[Step], path: str, ids: list[str] | None = None,
              title: str | None = None, dpi: int = 110) -> Figure:
    """Draw and write the figure (PNG, or whatever the extension says); returns the figure."""
    fig = plot_trace(steps, ids, title)
    fig.savefig(path, dpi=dpi)
    return fig
