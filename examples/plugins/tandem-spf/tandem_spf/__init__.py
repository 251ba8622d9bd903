"""tandem-spf: a shortest-prompt-first scheduling policy, registered as ``spf``.

tandem loads this module through the ``spf`` entry point of the ``tandem`` group and calls its
hook implementations once per process; select the policy with ``engine.scheduler = "spf"``.
"""
from __future__ import annotations

import tandem

from tandem_spf.policy import ShortestPromptFirstPolicy

__version__ = "0.1.0"


@tandem.hookimpl
def tandem_register_schedulers(register):
    register("spf", ShortestPromptFirstPolicy)
