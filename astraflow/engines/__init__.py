"""Inference engines behind one protocol: vllm, hf, openai."""
