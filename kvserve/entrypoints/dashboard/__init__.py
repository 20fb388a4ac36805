"""The live dashboard of ``kvserve serve``: ``hub`` (the ``/dashboard`` page and ``/v1/engine/state``, fed by the
engine loop between steps), ``snapshot`` (what the page shows, built from the engine's public state: the block pool,
the queues, the metric history) and ``static/`` (the page's HTML, JS and CSS)."""
