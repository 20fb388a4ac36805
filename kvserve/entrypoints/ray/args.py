"""``kvserve serve`` flags for data-parallel replicas on Ray Serve (no Ray import: the flags exist without the extra),
and the dispatch to ``kvserve.entrypoints.ray.ingress``."""

from __future__ import annotations

import argparse

from kvserve.distributed.router import ROUTERS, add_bound_args


def add_args(parser: argparse.ArgumentParser) -> None:
    """``--data-parallel-size``, ``--router``, ``--ray-address``."""
    g = parser.add_argument_group("data parallel (Ray Serve replicas; needs pip install -e '.[ray]')")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas on Ray Serve behind this server (default 1: one in-process engine, no Ray)")
    g.add_argument("--router", choices=ROUTERS, default="prefix",
                   help="how requests are spread over replicas (default prefix: the longest cached prefix, within "
                        "a load-imbalance bound; see kvserve.distributed.router)")
    g.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    add_bound_args(g)


def wants_ray(args: argparse.Namespace) -> bool:
    """Whether ``kvserve serve`` should run replicas on Ray Serve.

    Raises:
        ValueError: ``--data-parallel-size`` < 1.
    """
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    ray = args.data_parallel_size > 1 or args.ray_address is not None
    return ray


def run(args: argparse.Namespace, engine_args: dict) -> int:
    """Serve with Ray Serve replicas (``ingress.run``).

    Raises:
        ValueError: Ray is not installed, or as ``ingress.run``.
    """
    try:
        from kvserve.entrypoints.ray import ingress
    except ImportError as e:
        raise ValueError(f"--data-parallel-size > 1 needs Ray Serve: pip install -e '.[ray]' ({e})") from None
    return ingress.run(args, engine_args)
