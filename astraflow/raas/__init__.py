"""The RaaS runtime: slots, episode execution, weight follow."""
