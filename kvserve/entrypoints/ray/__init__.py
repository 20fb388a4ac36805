"""``kvserve serve --data-parallel-size N``: N kvserve engines as Ray Serve replicas behind one OpenAI server.

Layout (one Ray Serve application, no Ray HTTP proxy):

- ``replica.KVServeReplica``: a Serve deployment of N replicas (1 CPU each); each owns one ``AsyncLLM`` and streams
  the ``RequestOutput``s of a request from ``generate`` (token ids in, validated ``SamplingParams``).
- ``router.KVServeRequestRouter``: the deployment's Ray Serve custom request router (``ray.serve.request_router``).
  It runs inside the ingress's ``DeploymentHandle`` and delegates the choice to ``kvserve.distributed.router``
  (``--router prefix|least-loaded|round-robin``), learning from every routed request's prompt block hashes. The load
  it sees per replica: the requests it has routed there and not yet seen complete (the ingress is the replica's
  only client, so that is the replica's running + waiting), and the KV usage the replica reports through Serve's
  ``record_routing_stats`` (every second).
- ``ingress``: the same FastAPI app and uvicorn server as ``kvserve serve`` (``api_server.build_app``; same routes,
  streaming, errors), over ``RayEngineClient``, which stands in for ``AsyncLLM``: prompts are tokenized and
  validated here, generation is forwarded to a replica through the handle. ``/metrics`` is every replica's metrics
  with a ``replica`` label (``ReplicaMetrics``, refreshed on each scrape); and the start-up of Ray and the
  deployment.
- ``args``: the ``kvserve serve`` flags (no Ray import: the flags exist without the extra) and the dispatch.

Failures: a replica that dies before it accepted a request is retried on another replica (at most
``MAX_ATTEMPTS`` tries); once accepted, the request fails with 503 (``EngineShutdownError``: a JSON response is a 503,
a stream ends with an error event). Serve replaces the dead replica; the router forgets what it learned about it.

Nothing here is imported by this ``__init__``: ``args`` must load without Ray installed.
"""
