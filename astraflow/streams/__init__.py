"""The Redis Streams bus: publish, consume, hand off atomically, lease, reclaim, dead-letter, trim."""

from astraflow.streams.bus import Bus
from astraflow.streams.consumer import Consumer
from astraflow.streams.entries import DUP, LOST, OK, Delivery, Out
from astraflow.streams.keys import Keys
from astraflow.streams.runner import Runner

__all__ = ["DUP", "LOST", "OK", "Bus", "Consumer", "Delivery", "Keys", "Out", "Runner"]
