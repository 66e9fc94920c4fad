"""Workflow and reward APIs, the registry, built-in workflows, rewards, tasks and datasets."""
