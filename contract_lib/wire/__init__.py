"""What the parent and the run's process say to each other."""
