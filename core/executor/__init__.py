"""The executor: between the engine and the model (docs/architecture.md §10).

The engine process owns the scheduler, the detokenizer and the API; an executor owns the workers —
one per rank, each with its share of the model, its KV pool, its model runner and CUDA graphs —
and runs each step's ``SchedulerOutput`` on them.

    uniproc.py    "uniproc": one worker (tandem.worker.worker) in the engine's own process
    mp.py         "mp": one process per rank, started by the engine; other hosts run --headless
    ranks.py      starts a host's rank processes (``python -m tandem.executor``, __main__.py)
    worker_process.py   a rank's process: torch.distributed set-up and the step loop
    messages.py   what the engine and the ranks send each other (dataclasses)
    rendezvous.py       the rendezvous store, listening on parallel.master_addr only
    rank_auth.py        every rank proves the cluster key (and rank 0 proves it back) before any step
    sealed_channel.py   the step messages and replies between ranks, sealed under the session key
    plugin.py     registers the built-in executors
"""
