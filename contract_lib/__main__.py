"""``python -m contract_lib``: see :mod:`contract_lib.cli`."""

import sys

from contract_lib.cli import main

if __name__ == "__main__":
    sys.exit(main())
