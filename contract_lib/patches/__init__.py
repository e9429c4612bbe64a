"""Patches of SGLang's code: the built-in ones and patching by exact snippets."""
