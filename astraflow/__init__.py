"""AstraFlow: dataflow-coordinated reinforcement learning of LLMs on Redis Streams."""

__version__ = "0.1.0"
