"""The one-machine launcher: supervised worker processes, live progress, the run directory's report."""
