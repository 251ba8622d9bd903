"""``python -m tandem.executor --rank R [--conn-fd FD]``: one rank's process of the "mp" executor,
started by tandem.executor.ranks (never by hand)."""
import sys

from tandem.executor.worker_process import main

sys.exit(main(sys.argv[1:]))
