"""`python -m flexkv_py ...` is the `flexkv-py` command."""

from __future__ import annotations

import sys

from flexkv_py.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
