"""ddphooks: make silent inconsistency between data-parallel workers visible.

A DDP communication hook measures, on the gradient allreduce it already performs, how far the
ranks' losses and local gradients drift apart: loss dispersion, gradient-norm dispersion and
inter-worker gradient cosine similarity (arXiv 2602.14462).

``import ddphooks`` imports torch and numpy only; the integrations (``ddphooks.integrations``)
and the TensorBoard / W&B / Prometheus sinks load their libraries when they are first used.
"""

import importlib

from ddphooks.attach import attach
from ddphooks.config import SilentConfig
from ddphooks.hook import SilentState, silent_hook
from ddphooks.sinks import JsonlSink, PrometheusSink, Sink, SinkGroup, TensorBoardSink, WandbSink
from ddphooks.stats import SilentStats

__all__ = [
    "JsonlSink", "PrometheusSink", "SilentConfig", "SilentState", "SilentStats", "Sink", "SinkGroup", "TensorBoardSink", "WandbSink", "attach", "silent_hook",
]  # fmt: skip
__version__ = "0.2.0"


def __getattr__(name: str):
    # `ddphooks.integrations.transformers.SilentCallback` works after a plain `import ddphooks`,
    # without importing any integration's library before it is asked for.
    if name == "integrations":
        return importlib.import_module("ddphooks.integrations")
    raise AttributeError(f"module 'ddphooks' has no attribute {name!r}")
