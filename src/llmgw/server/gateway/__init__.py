"""OpenAI-compatible gateway: policies (balancing, breakers, retries, admission) and the proxy.

The policy modules (`balance`, `breaker`, `retry`, `admission`, `enginemetrics`) are pure: no
trio, no I/O, time passed in as a float. `admission_gate` is the thin trio wrapper that waits.
"""
