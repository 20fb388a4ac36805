"""The OpenAI-compatible HTTP server: ``protocol`` (pydantic models), ``serving`` (request handling), ``api_server``
(FastAPI app, ``kvserve serve``), ``metrics`` (Prometheus)."""
