"""One module per process kind: parse settings, configure logging, run the loop."""
