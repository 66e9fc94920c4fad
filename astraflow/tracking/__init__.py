"""Experiment trackers (TensorBoard, W&B, MLflow) fed from the run's `metrics` stream by one process."""
