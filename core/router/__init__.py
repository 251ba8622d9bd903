"""The disaggregation router: one OpenAI-compatible front door for prefill, decode and colocated
instances, which it reaches over HTTP alone (it never imports the engine, torch, the scheduler or
the transport, and carries addresses and block ids, never KV bytes).

    registry.py   instances, their health and load, the health-check loop
    prompts.py    what the router reads from a request: prompt length estimate, routing key;
                  the prefill and decode bodies it derives
    proxy.py      one HTTP exchange with an instance: a whole answer, or an SSE stream opened
                  up to its first token
    dispatch.py   the flow of one request: prefill → decode, retries, conditional disaggregation
    metrics.py    the router's Prometheus metrics; errors.py the errors it answers itself
    model_ids.py  which model ids may travel in an instance's URL path
    auth.py       the bearer-key checks (API key, admin key)
    admin.py      the operator's routes: /admin/instances, /health, /version, /metrics
    app.py        the FastAPI app; launch.py ``tandem router``
"""
