"""The out-of-tree example plugin (examples/plugins/tandem-spf), pip-installed by the test set-up,
selected by a config file, drives tandem's Scheduler in shortest-prompt-first order."""
from __future__ import annotations

from tandem.config import load_config
from tandem.plugin_manager import get_registry
from tandem.sched.scheduler import Scheduler, SchedulerConfig
from tests.sched.sched_helpers import make_request, run_step


def test_config_selects_installed_spf_policy_and_scheduler_follows_it(tmp_path):
    (tmp_path / "spf.toml").write_text('[engine]\nscheduler = "spf"\nmax_num_seqs = 1\n')
    config = load_config(tmp_path / "spf.toml")
    registry = get_registry()
    entry = next(e for e in registry.entries() if e.kind == "scheduler" and e.name == "spf")
    assert entry.package == "tandem-spf"
    policy = registry.get("scheduler", config.engine.scheduler)()
    kv = registry.get("kv_allocator", config.engine.kv_allocator)(64, 4, True)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=config.engine.max_num_seqs), kv, policy)
    lengths = {"long": 12, "short": 2, "mid": 6}
    for arrival, (rid, n) in enumerate(lengths.items()):
        scheduler.add_request(make_request(rid, range(1, n + 1), max_tokens=1, arrival=arrival))
    order = []
    while scheduler.has_unfinished_requests():
        out, _ = run_step(scheduler)
        order += [r.request_id for r in out.new_requests]
    # One seat: requests run one at a time, shortest prompt first, not in arrival order.
    assert order == ["short", "mid", "long"]
