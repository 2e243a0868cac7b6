"""What a run shows about itself: the stage timeline and the metrics log."""

from rlhfjax.observe.metrics import MetricsWriter, plot_metric
from rlhfjax.observe.timeline import StageRecord, Timeline, plot_gantt

__all__ = ["MetricsWriter", "StageRecord", "Timeline", "plot_gantt", "plot_metric"]
