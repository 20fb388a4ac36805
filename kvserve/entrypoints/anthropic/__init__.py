"""Anthropic's Messages API over the engine client (``serving_messages``, ``routes``)."""
