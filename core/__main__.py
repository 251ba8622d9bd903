"""``python -m tandem``: the same as the ``tandem`` command."""
import sys

from tandem.cli import main

if __name__ == "__main__":
    sys.exit(main())
