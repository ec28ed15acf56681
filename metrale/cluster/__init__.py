"""metrale on Ray Serve: N engine replicas behind one OpenAI-compatible ingress.

- config.py     frozen, validated settings (the router's epsilon and spread rule among them)
- ranking.py    the adapter-affinity ranking with bounded loads: pure, testable without Ray
- router.py     the Ray Serve RequestRouter that feeds replica stats to ranking.py
- registry.py   the cluster-wide adapter registry (desired state) and its Ray actor
- sync.py       a replica following the registry: register/reload/pin/unload on its engine
- staging.py    a replica landing an adapter from a neighbour's slot before disk
- replica.py    the engine replica deployment (its own /metrics, export, routing stats)
- ingress.py    the ingress: the single-engine server's routes over the cluster (EngineAPI)
- launch.py     `metrale serve --replicas N` / `--ray-address`

Nothing here is imported by the rest of metrale; Ray is only needed by the last four.
"""
