"""ddphooks: make silent inconsistency between data-parallel workers visible.

A DDP communication hook measures, on the gradient allreduce it already performs, how far the
ranks' losses and local gradients drift apart: loss dispersion, gradient-norm dispersion and
inter-worker gradient cosine similarity (arXiv 2602.14462).
"""

from ddphooks.config import SilentConfig
from ddphooks.hook import SilentState, silent_hook
from ddphooks.sinks import JsonlSink, Sink, SinkGroup
from ddphooks.stats import SilentStats

__all__ = ["JsonlSink", "SilentConfig", "SilentState", "SilentStats", "Sink", "SinkGroup", "silent_hook"]
__version__ = "0.1.0"
