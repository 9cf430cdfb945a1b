"""Pictures for the Prefect UI: the loss curve as a PNG (matplotlib, no display needed)."""

from __future__ import annotations

import io


def loss_curve_png(losses: list[float], title: str) -> bytes:
    """A line chart of the loss per optimizer step."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render to memory
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 3.6), dpi=100)
    axes = figure.add_subplot()
    axes.plot(range(1, len(losses) + 1), losses, color="#2c6fbb", linewidth=1.5)
    axes.set(title=title, xlabel="optimizer step", ylabel="training loss")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    out = io.BytesIO()
    figure.savefig(out, format="png")
    return out.getvalue()
