"""The built-in scheduling policies: registration, admission keys, victims, preemption rule."""
from importlib.metadata import entry_points

import pluggy
import pytest

import tandem.hookspecs
from tandem.interfaces import SchedulingPolicy
from tandem.plugins import policies
from tandem.plugins.policies import FCFSPolicy, PriorityPolicy
from tandem.sched.request import Request
from tandem.sampling_params import SamplingParams


def req(rid, arrival, priority=0):
    return Request(request_id=rid, prompt_token_ids=[1], sampling_params=SamplingParams(),
                   arrival_time=arrival, priority=priority)


def test_the_hook_registers_both_policies_through_pluggy():
    pm = pluggy.PluginManager("tandem")
    pm.add_hookspecs(tandem.hookspecs)
    pm.register(policies)
    found = {}
    pm.hook.tandem_register_schedulers(register=lambda name, cls: found.setdefault(name, cls))
    assert found == {"fcfs": FCFSPolicy, "priority": PriorityPolicy}
    assert all(issubclass(cls, SchedulingPolicy) and cls.name == name for name, cls in found.items())


def test_the_module_is_a_tandem_entry_point():
    names = {ep.value for ep in entry_points(group="tandem")}
    assert "tandem.plugins.policies" in names


def test_fcfs_admits_by_arrival_then_id():
    requests = [req("b", 2.0), req("c", 1.0), req("a", 2.0)]
    order = sorted(requests, key=FCFSPolicy().sort_key)
    assert [r.request_id for r in order] == ["c", "a", "b"]


def test_fcfs_ignores_priorities():
    requests = [req("late", 5.0, priority=-9), req("early", 1.0, priority=9)]
    order = sorted(requests, key=FCFSPolicy().sort_key)
    assert [r.request_id for r in order] == ["early", "late"]


def test_fcfs_preempts_the_latest_arrival_and_a_forked_child_before_its_parent():
    policy = FCFSPolicy()
    assert policy.select_victim([req("x", 3.0), req("y", 1.0), req("z", 2.0)]).request_id == "x"
    assert policy.select_victim([req("r", 1.0), req("r#2", 1.0), req("r#1", 1.0)]).request_id == "r#2"


def test_fcfs_never_preempts_for_a_waiting_request_and_has_no_cap():
    policy = FCFSPolicy()
    assert not policy.should_preempt_for(req("w", 0.0, priority=-5), req("r", 1.0, priority=5))
    assert policy.max_prompt_tokens_per_step() is None


def test_priority_admits_lower_values_first_then_by_arrival():
    requests = [req("a", 1.0, priority=2), req("b", 3.0, priority=0), req("c", 2.0, priority=0)]
    order = sorted(requests, key=PriorityPolicy().sort_key)
    assert [r.request_id for r in order] == ["c", "b", "a"]


def test_priority_preempts_the_largest_priority_value_latest_first():
    policy = PriorityPolicy()
    running = [req("a", 1.0, priority=1), req("b", 0.5, priority=3), req("c", 2.0, priority=3)]
    assert policy.select_victim(running).request_id == "c"


@pytest.mark.parametrize(("waiting", "running", "expected"),
                         [(0, 1, True), (1, 1, False), (2, 1, False)])
def test_priority_preempts_only_for_a_strictly_smaller_value(waiting, running, expected):
    policy = PriorityPolicy()
    assert policy.should_preempt_for(req("w", 9.0, waiting), req("r", 0.0, running)) is expected
