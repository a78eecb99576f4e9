"""Where step records go: ``Sink`` (the interface), ``SinkGroup`` (fan-out) and the backends.

``JsonlSink`` needs nothing beyond the standard library; ``TensorBoardSink`` and ``WandbSink``
import their libraries only when they are created (extras ``tensorboard`` and ``wandb``).
"""

from ddphooks.sinks.base import Sink, SinkGroup
from ddphooks.sinks.jsonl import JsonlSink
from ddphooks.sinks.scalars import record_scalars
from ddphooks.sinks.tensorboard import TensorBoardSink
from ddphooks.sinks.wandb import WandbSink

__all__ = ["JsonlSink", "Sink", "SinkGroup", "TensorBoardSink", "WandbSink", "record_scalars"]
