"""Where step records go: ``Sink`` (the interface), ``SinkGroup`` (fan-out) and the backends.

``JsonlSink`` needs nothing beyond the standard library; ``TensorBoardSink``, ``WandbSink`` and
``PrometheusSink`` import their libraries only when they are created (extras ``tensorboard``,
``wandb`` and ``prometheus``).
"""

from ddphooks.sinks.base import Sink, SinkGroup
from ddphooks.sinks.jsonl import JsonlSink
from ddphooks.sinks.prometheus import PrometheusSink
from ddphooks.sinks.scalars import record_scalars
from ddphooks.sinks.tensorboard import TensorBoardSink
from ddphooks.sinks.wandb import WandbSink

__all__ = ["JsonlSink", "PrometheusSink", "Sink", "SinkGroup", "TensorBoardSink", "WandbSink", "record_scalars"]
