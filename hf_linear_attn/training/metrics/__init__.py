"""Task metrics through `evaluate`: the Hub modules where reachable, the offline copies in this folder otherwise."""

import os
from pathlib import Path

import evaluate

from ..data import Task
from ..errors import UsageError

LOCAL_METRICS = Path(__file__).resolve().parent


def load_task_metric(task: Task, source: str = "auto"):
    """The `evaluate` module of task.metric: "hub", "local" (this folder), or "auto" (local when HF_HUB_OFFLINE)."""
    if source not in ("auto", "hub", "local"):
        raise UsageError(f"metric source must be auto, hub or local, got {source!r}")
    config = task.name if task.metric == "glue" else None
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    if source == "hub" or (source == "auto" and not offline):
        try:
            return evaluate.load(task.metric, config)
        except Exception as error:
            if source == "hub":
                raise UsageError(f"cannot load the {task.metric} metric from the Hub: {error}") from error
            print(f"the Hub {task.metric} metric is unreachable ({type(error).__name__}); using the offline copy")
    return evaluate.load(str(LOCAL_METRICS / task.metric), config)
