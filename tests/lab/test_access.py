"""Who can reach what on the serving lab (scenario ``serving``): the pipeline replica's rendezvous and API, and
how confined every unit gpufleet writes is. Ray's reach is tests/lab/test_ray.py's.

lab1 runs the router (its requests reach the replicas' APIs) and stands for any other machine on the fleet
network, while the controller's side of the lab (the bridge address) is the monitoring host and API client
(``monitoring_addresses``, ``vllm_api_allowed_from`` in inventories/lab.py).
"""

from __future__ import annotations

import ipaddress

import pytest

from gpufleet.lab.state import NodeRecord
from gpufleet.unit_security import EXPOSURE_BOUND
from roles import ray as ray_role
from tests.lab.fleet import PIPELINE, PORT, RENDEZVOUS, controller_reaches, exposures, reach
from tests.lab.harness import Completed, Lab

pytestmark = pytest.mark.filterwarnings("ignore:Unknown ssh-ed25519 host key:UserWarning")


@pytest.fixture
def mp_replica(lab: Lab, serving: Completed | None) -> tuple[NodeRecord, NodeRecord]:
    """The pipeline replica on vLLM's mp backend (the lab's default), serving: rank 0 and rank 1."""
    return lab.nodes[1], lab.nodes[2]


def test_only_the_replicas_nodes_reach_its_rendezvous(lab: Lab, mp_replica: tuple[NodeRecord, ...]) -> None:
    """The replica's nodes reach its rendezvous; the router (lab1) and vllm_api_allowed_from reach its API (and,
    in the same unit, the rendezvous); an address none of them lists reaches neither. The outsider is a second
    address given to lab1 for this test, on the lab's own bridge network."""
    rank0, rank1 = mp_replica
    router = lab.nodes[0]
    rendezvous, api = f"{rank0.address}:{RENDEZVOUS}", f"{rank0.address}:{PORT}"
    assert reach(lab, rank1, [rendezvous]) == {rendezvous: True}
    assert reach(lab, router, [api]) == {api: True}  # the routers group: its requests come from there
    outsider = str(ipaddress.ip_network(lab.state.subnet)[250])
    lab.host(router).check_output(f"ip address add {outsider}/32 dev host0")
    try:
        assert reach(lab, router, [rendezvous, api], source=outsider) == {rendezvous: False, api: False}
    finally:
        lab.host(router).run(f"ip address del {outsider}/32 dev host0")
    assert controller_reaches(api)  # vllm_api_allowed_from: the controller's side of the lab
    assert not lab.host(rank0).file(f"/etc/systemd/system/{ray_role.unit_name(PIPELINE)}").exists


def test_every_unit_gpufleet_writes_is_confined(lab: Lab, mp_replica: tuple[NodeRecord, ...]) -> None:
    worst = exposures(lab)
    for unit in ("vllm@*.service", "node_exporter.service", "dcgm-exporter.service"):
        assert worst.get(unit, 10.0) <= EXPOSURE_BOUND, worst

