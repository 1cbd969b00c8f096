"""Draw a pipeline timeline (simulated or measured): as text, or as a PNG with matplotlib."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from pathlib import Path

from colossal.pipeline.ir import ActionType, TimelineEvent

logger = logging.getLogger(__name__)

_LETTER = {
    ActionType.FORWARD: "F",
    ActionType.BACKWARD: "B",
    ActionType.BACKWARD_INPUT: "I",
    ActionType.BACKWARD_WEIGHT: "W",
}
_COLOR = {
    ActionType.FORWARD: "#4C72B0",
    ActionType.BACKWARD: "#DD8452",
    ActionType.BACKWARD_INPUT: "#C44E52",
    ActionType.BACKWARD_WEIGHT: "#55A868",
}
PLOT_HINT = "install matplotlib (pip install 'colossal-pipeline[plot]') to draw PNG timelines"


def _normalise(events: Sequence[TimelineEvent]) -> tuple[list[TimelineEvent], float, int]:
    if not events:
        raise ValueError(
            "no timeline events to draw; run with record_timeline=True or simulate first"
        )
    t0 = min(e.start for e in events)
    shifted = [TimelineEvent(e.stage, e.action, e.start - t0, e.end - t0) for e in events]
    return shifted, max(e.end for e in shifted), max(e.stage for e in shifted) + 1


def render_text(events: Sequence[TimelineEvent], width: int = 100) -> str:
    """A text Gantt chart: one row per stage, ``width`` columns spanning the step.

    Forward is ``F``, full backward ``B``, input backward ``I``, weight backward ``W``;
    lower case marks chunk 1 and above, ``.`` is idle. Each column shows the action covering
    its midpoint.
    """
    if width < 10:
        raise ValueError(f"width must be at least 10 columns, got {width}")
    shifted, span, stages = _normalise(events)
    rows = [["."] * width for _ in range(stages)]
    scale = width / span if span > 0 else 0.0
    for e in shifted:
        letter = _LETTER[e.action.type]
        letter = letter if e.action.chunk == 0 else letter.lower()
        first, last = int(e.start * scale), max(int(e.start * scale), int(e.end * scale + 0.5) - 1)
        for col in range(first, min(last, width - 1) + 1):
            rows[e.stage][col] = letter
    label = len(str(stages - 1))
    return "\n".join(f"stage {s:>{label}} |{''.join(r)}|" for s, r in enumerate(rows))


def save_png(
    events: Sequence[TimelineEvent], path: str | Path, title: str | None = None
) -> Path | None:
    """Draw the timeline as a PNG at ``path``; without matplotlib warn and return ``None``.

    Args:
        events: Timeline events (from :func:`~colossal.pipeline.simulate.simulate` or a run
            with ``record_timeline=True``).
        path: Output file.
        title: Figure title.

    Returns:
        The path written, or ``None`` when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn(
            f"no PNG timeline written to {path}: {PLOT_HINT}", RuntimeWarning, stacklevel=2
        )
        logger.warning("no PNG timeline written to %s: %s", path, PLOT_HINT)
        return None
    shifted, span, stages = _normalise(events)
    fig, ax = plt.subplots(figsize=(max(6.0, min(24.0, len(shifted) / 6)), 0.6 * stages + 1.2))
    for e in shifted:
        ax.barh(
            e.stage,
            e.duration,
            left=e.start,
            height=0.8,
            color=_COLOR[e.action.type],
            alpha=1.0 if e.action.chunk == 0 else 0.6,
            edgecolor="black",
            linewidth=0.3,
        )
        if e.duration > span / 80:
            ax.text(
                e.start + e.duration / 2,
                e.stage,
                str(e.action.microbatch),
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_xlim(0, span)
    if title:
        ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLOR.values()]
    ax.legend(handles, [t.name.lower() for t in _COLOR], loc="upper right", fontsize=6)
    out = Path(path)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
