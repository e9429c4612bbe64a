"""The parent: running a workload, the warm-server client, the frame cache."""
