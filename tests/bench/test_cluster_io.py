"""The cluster benchmarks' config files (tandem.bench.cluster_io.toml): what Python's own TOML
parser reads back is what was written, nested tables, lists, quotes and booleans included."""
from __future__ import annotations

import tomllib

from tandem.bench.cluster_io import child_env, toml


def test_toml_reads_back_as_written():
    sections = {"model": {"path": "/tmp/a \"quoted\" dir", "served_model_name": "tiny"},
                "engine": {"max_num_seqs": 8, "enable_prefix_caching": False, "gpu_memory_utilization": 0.5},
                "disaggregation": {"instances": [{"url": "http://10.0.0.2:8000", "role": "prefill"},
                                                 {"url": "http://10.0.0.3:8000", "role": "decode"}],
                                   "kv_transfer_secret": "s3cret\\with\\backslashes"}}
    assert tomllib.loads(toml(sections)) == sections


def test_a_child_environment_drops_tandem_settings(monkeypatch):
    monkeypatch.setenv("TANDEM_ENGINE__MAX_NUM_SEQS", "3")
    monkeypatch.setenv("PATH_FOR_THE_TEST", "kept")
    env = child_env(UCX_TLS="tcp")
    assert "TANDEM_ENGINE__MAX_NUM_SEQS" not in env
    assert env["PATH_FOR_THE_TEST"] == "kept" and env["UCX_TLS"] == "tcp"
