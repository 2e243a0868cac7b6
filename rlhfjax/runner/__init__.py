"""The loop that runs any flow (`Runner`) and the evaluation before and after it."""

from rlhfjax.runner.evaluation import format_evaluation
from rlhfjax.runner.loop import Runner, RunResult, TooManySkippedUpdates

__all__ = ["RunResult", "Runner", "TooManySkippedUpdates", "format_evaluation"]
