"""``pytest -p sglang_import_shims``: lets a test process import ``sglang`` in this
venv, as SGLang's own tests do, by installing contract_lib's import shims (SGLang's
Triton stand-in; this CPU-only venv has no triton) the way every run's process does.
Used to run the SGLang-tree test in ``contrib/`` here (``tests/test_plugin.py``)."""

from contract_lib.child.shims import install_import_shims

install_import_shims()
