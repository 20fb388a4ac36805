"""The OpenAI-compatible HTTP server, in vLLM's layout: ``api_server`` (the FastAPI app, ``kvserve serve``),
``routes`` (the endpoints), ``errors`` (error bodies and status codes), ``protocol`` (pydantic models),
``serving_engine`` (what every endpoint shares), ``serving_completion``, ``serving_chat`` (with ``tool_parsers``),
``serving_tokenization``, and ``metrics`` (Prometheus)."""
