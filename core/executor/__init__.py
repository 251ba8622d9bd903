"""The executor: between the engine and the model (ARCHITECTURE.md §2).

The engine process owns the scheduler, the detokenizer and the API; an executor owns the workers —
one per rank, each with its share of the model, its KV pool, its model runner and CUDA graphs —
and runs each step's ``SchedulerOutput`` on them.

    parallel.py   a rank's place (tp rank, pp stage), its process groups and collectives
    worker.py     one rank's model, KV pool, runner, graphs, KV connector (built where it runs)
    uniproc.py    "uniproc": one worker in the engine's own process
    mp.py         "mp": one process per rank, started by the engine; other hosts run --headless
    worker_process.py   a rank's process: torch.distributed set-up and the step loop
    plugin.py     registers the built-in executors
"""
