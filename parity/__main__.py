"""`python -m parity ...`: the same as the `parity` command (parity.cli.main)."""
import sys

from parity.cli import main

if __name__ == "__main__":
  sys.exit(main())
