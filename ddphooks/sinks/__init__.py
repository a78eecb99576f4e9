"""Where step records go: ``Sink`` (the interface), ``SinkGroup`` (fan-out) and the backends.

``JsonlSink`` needs nothing beyond the standard library; ``TensorBoardSink`` and ``WandbSink``
import their libraries only when they are created (extras ``tensorboard`` and ``wandb``).
"""

from ddphooks.sinks.base import Sink, SinkGroup
from ddphooks.sinks.jsonl import JsonlSink

__all__ = ["JsonlSink", "Sink", "SinkGroup"]
