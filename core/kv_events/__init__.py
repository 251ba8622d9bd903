"""KV cache events in vLLM's wire format: the encoding (``wire``), the instance's publisher
(``publisher``) and the router's subscriber (``subscriber``). docs/disaggregation.md §KV events."""
