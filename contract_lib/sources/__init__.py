"""Which SGLang a run imports: releases, source trees, diffs, per-release compat."""
