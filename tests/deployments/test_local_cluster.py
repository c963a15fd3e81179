"""``disagg serve``'s cluster is its own: a Ray address found on the machine is not joined."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray

PROBE = """
import ray
from disagg.launch.local import _init_ray, local_num_cpus
assert _init_ray() is True
assert ray.cluster_resources()["CPU"] == local_num_cpus()
print("own cluster at", ray.get_runtime_context().gcs_address)
ray.shutdown()
"""


def test_a_cluster_address_found_on_the_machine_is_not_joined():
    """Ray's ``init()`` without an address joins whatever it finds: ``RAY_ADDRESS``, or a
    ``gcs_server`` still running here (another cluster, or the last test's, still shutting down).
    Asked for its CPUs too, it then refused, and CI's next cluster test failed to start. The
    address here points at nothing; the old call failed on it before connecting, as it did on CI."""
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:9", "RAY_USAGE_STATS_ENABLED": "0"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    address = out.stdout.split("own cluster at ")[1].strip()
    assert not address.endswith(":9")
