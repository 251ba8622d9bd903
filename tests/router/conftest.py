"""Shared instances for the router tests: one prefill and two decode ``tandem serve``
subprocesses of the tiny Llama, started once per session (they are colocated instances: until
the engine reads kv_transfer_params they ignore it, so a decode instance recomputes the prompt
and its greedy output must equal a direct request's). The first is also the colocated oracle of
the disaggregated tests."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.tiny_models import tiny_model_dir
from tests.router.instances import PAIR_EXPIRY_S, InstanceProcess, instances, role_env


@dataclass
class Cluster:
    prefill: InstanceProcess
    decode: list[InstanceProcess]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("router-instance-logs")


@pytest.fixture(scope="session")
def cluster_instances(model_dir, log_dir) -> Iterator[list[InstanceProcess]]:
    with instances(model_dir, log_dir, 3) as procs:
        yield procs


@pytest.fixture(scope="session")
def cluster(cluster_instances) -> Cluster:
    prefill, decode0, decode1 = cluster_instances
    return Cluster(prefill, [decode0, decode1])


@pytest.fixture(scope="session")
def colocated(cluster_instances) -> InstanceProcess:
    """A colocated instance with the default test flags: the oracle whose greedy answers a
    disaggregated pair must repeat (the cluster's prefill instance; no test stops it)."""
    return cluster_instances[0]


@pytest.fixture(scope="session")
def nixl_pair(model_dir, log_dir) -> Iterator[tuple[InstanceProcess, InstanceProcess]]:
    """A prefill and a decode instance over NIXL (UCX's default transports), KV expiry
    PAIR_EXPIRY_S: shared by the disaggregated flow and the router's fuzzing, each with its own
    router; each leaves them idle, every block free."""
    prefill = InstanceProcess(model_dir, log_dir, **role_env("prefill", PAIR_EXPIRY_S)).start()
    decode = InstanceProcess(model_dir, log_dir, **role_env("decode", PAIR_EXPIRY_S)).start()
    try:
        yield prefill.wait_ready(), decode.wait_ready()
    finally:
        prefill.stop()
        decode.stop()
