"""The engines tandem's benchmarks measure against in the same run (vLLM, in a venv of its own).

Nothing imports this package but tandem.bench.cli, which hands a benchmark its peer module
(``tandem.bench.offline.Peer``, ``tandem.bench.serve.Peer``) and adds the peer's arguments to
the benchmark's. The files run by the peer's own python (``vllm_cli.py``,
``vllm_offline_driver.py``) import nothing of tandem.
"""
