"""What runs inside SGLang's process: the warm server, the run, its capture and shims."""
