"""Registers tandem's built-in quantization methods (entry point ``builtin_quant``)."""
from __future__ import annotations

from collections.abc import Callable

import tandem
from tandem.quant.unquantized import UnquantizedLinearMethod


@tandem.hookimpl
def tandem_register_quant_methods(register: Callable[[str, type], None]) -> None:
    register("unquantized", UnquantizedLinearMethod)
