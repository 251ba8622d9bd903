"""The scheduler side is pure Python: importing it must not load torch or numpy."""
import subprocess
import sys

MODULES = ["tandem.sched.block_pool", "tandem.sched.kv_manager", "tandem.sched.scheduler",
           "tandem.plugins.policies", "tandem.plugins.kv_allocators"]


def test_scheduler_modules_import_without_torch_or_numpy():
    code = (f"import sys; import {', '.join(MODULES)}; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
