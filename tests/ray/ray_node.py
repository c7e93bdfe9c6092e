"""`ray start` for a test cluster that stays on loopback: `python ray_node.py start ...`.

Ray binds its servers to the node address only when that address is loopback (127.0.0.1), and
on Linux its CLI rewrites a loopback `--address` / `--node-ip-address` to the machine's external
address (ray-project/ray#59110, open; `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` keeps loopback but
then refuses every non-head node). This launcher runs Ray's own CLI with that one rewrite
switched off, so a head and more nodes all bind 127.0.0.1. Test-only: a real cluster uses
`ray start` with the nodes' real addresses.
"""

from __future__ import annotations

import ray._private.services as services


def _keep(host: str) -> str:
    if not host:
        raise ValueError(f"Malformed host: {host}")
    return host


if __name__ == "__main__":
    services.resolve_ip_for_localhost = _keep
    from ray.scripts.scripts import main

    main()
