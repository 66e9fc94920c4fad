"""`python -m` entry points, one per process kind: each parses settings and calls into astraflow.launch.
Nothing imports these modules."""
