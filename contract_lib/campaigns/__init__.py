"""Many runs at once: status, audit, compare, search, traces."""
