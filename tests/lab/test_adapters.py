"""LoRA adapters on the lab: declared by its single-node pool (inventories/lab/inventory.py: the tiny model's adapters
the lab's mirror made, pinned by their weights' digests), staged by their hashes, served through the routers by name,
one added to the running pool without a restart, and a corrupted one found and put back.

The pipeline pool declares none: vLLM's CPU build fails a pipeline rank after the first with LoRA on (the lab's
inventory says why), so an adapter's requests must never reach the pipeline replica. The file sorts first among the
lab's tests: in the ``changed`` scenario, the deploy that adds an adapter is the first change, made on the fleet as
the faults left it, with no deploy before it.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from gpufleet_lab.state import NodeRecord
from gpufleet_lab.tiny_adapters import LAB_ADAPTERS, LATER_ADAPTER, WEIGHTS_FILE

from gpufleet import node_paths
from roles.node_lifecycle import NODE_TEXTFILE
from tests.lab.checks import main_pid
from tests.lab.fleet import (
    INVENTORY,
    PORT,
    api_key,
    client_key,
    completion_text,
    http,
    lab_adapters,
    record_figure,
    router_url,
    seeded_completion,
    served_name,
    single,
    tls,
)
from tests.lab.harness import PYINFRA, Completed, Lab, run
from tests.lab.prometheus import wait_for
from tests.lab.scenarios import ADAPTER_ADDED, LabStates

pytestmark = pytest.mark.filterwarnings("ignore:Unknown ssh-ed25519 host key:UserWarning")

SERVABLE_WITHIN_S = 30


def _watch_verdicts(lab: Lab, node: NodeRecord) -> dict[str, int]:
    """Each adapter of lab1's replica as ``node``'s watch last judged it (its textfile): 1 staged as declared."""
    text = lab.host(node).check_output(f"cat {NODE_TEXTFILE}")
    return {match[1]: int(match[2]) for match in re.finditer(
        rf'^gpufleet_replica_adapter_staged{{replica="{single(lab)}",adapter="([^"]+)"}} ([01])$', text, re.M)}


def _staged(lab: Lab, sha256: str) -> str:
    return f"{node_paths.adapter_store(sha256)}/{WEIGHTS_FILE}"


def test_each_declared_adapter_is_staged_by_its_hash_answers_by_name_and_is_listed(
        lab: Lab, serving: Completed | None) -> None:
    """Three adapters declared: each staged on lab1 with the declared SHA-256, readable by the vllm user only; each
    answers through the routers (three times each: never from the pipeline replica, which serves none) otherwise
    than the model for the same prompt and seed; the replica lists them, the pipeline replica none of them."""
    adapters = lab_adapters()
    assert sorted(adapters) == sorted(a.name for a in LAB_ADAPTERS)
    host = lab.host(lab.nodes[0])
    for name, adapter in adapters.items():
        staged = host.file(_staged(lab, adapter["sha256"]))
        assert (staged.user, staged.group, staged.mode) == ("root", "vllm", 0o640), name
        assert host.check_output(f"sha256sum {_staged(lab, adapter['sha256'])}").split()[0] == adapter["sha256"]
        assert host.run(f"runuser -u nobody -- cat {_staged(lab, adapter['sha256'])}").rc != 0
        link = host.file(f"{node_paths.resolver_dir(single(lab))}/{name}/{WEIGHTS_FILE}")
        assert link.is_symlink and link.linked_to == _staged(lab, adapter["sha256"])
    status, body = seeded_completion(lab, served_name("lab"))
    assert status == 200, body
    model_text = completion_text(body)
    answers: dict[str, set[str]] = {}
    for name in adapters:
        for _ in range(3):
            status, body = seeded_completion(lab, name)
            assert status == 200, (name, body)
            answers.setdefault(name, set()).add(completion_text(body))
    assert all(len(texts) == 1 and model_text not in texts for texts in answers.values()), (model_text, answers)
    listed = {single(lab): set(adapters), "pipeline": set()}
    for node, expected in zip(lab.nodes[:2], listed.values(), strict=True):
        status, body = http(f"http://{node.address}:{PORT}/v1/models", key=api_key(lab))
        assert status == 200, body
        ids = {m["id"] for m in json.loads(body)["data"]}
        assert ids & set(adapters) == expected, (node.name, ids)
    status, body = http(f"{router_url(lab)}/v1/models", key=client_key(lab), context=tls(lab))
    assert set(adapters) <= {m["id"] for m in json.loads(body)["data"]}, body


def test_an_adapter_added_serves_without_a_restart_and_a_corrupted_one_is_found_and_put_back(
        lab: Lab, changed: Completed | None, lab_states: LabStates,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """lab1's staged copy of one adapter is corrupted: deploys/check.py names it as drift, and lab1's node watch
    exports it as not staged as declared (the series ReplicaAdapterNotAsDeclared reads; the rule itself:
    tests/data/alert_rules/serving.test.yml). The deploy that declares one adapter more
    (GPUFLEET_LAB_ADAPTERS) puts the corrupted one back by its hash and stages the new one, both then staged as
    declared, and the new one answers through the routers within 30 s of the deploy's end, with no engine
    restarted."""
    node, replica = lab.nodes[0], single(lab)
    host = lab.host(node)
    poet = lab_adapters()[LAB_ADAPTERS[0].name]
    verdicts = _watch_verdicts(lab, node)
    assert verdicts == dict.fromkeys(lab_adapters(), 1), verdicts
    host.check_output(f"printf x >> {_staged(lab, poet['sha256'])}")
    drift = lab.pyinfra(INVENTORY, "deploys/check.py", timeout=600)
    assert drift.rc != 0, drift.output[-4000:]
    assert f"Adapter {LAB_ADAPTERS[0].name}: stage {WEIGHTS_FILE}" in drift.output, drift.output[-4000:]
    wait_for("the node watch's verdict on the corrupted copy", lambda: True if _watch_verdicts(lab, node).get(
        LAB_ADAPTERS[0].name) == 0 else None, timeout=60, every=1)  # it looks every 10 s
    status, body = seeded_completion(lab, LATER_ADAPTER.name)
    assert status in (403, 404), body  # not declared yet: no client may use it
    engine = main_pid(lab, node, f"vllm@{replica}")
    began = time.monotonic()
    done = run([str(PYINFRA), INVENTORY, "deploys/vllm.py", "-y"],
               {**lab.env, "GPUFLEET_LAB_ADAPTERS": LATER_ADAPTER.name}, 1800)
    lab_states.changed(ADAPTER_ADDED)
    assert done.rc == 0, done.output[-4000:]
    deployed = time.monotonic()
    while True:
        status, body = seeded_completion(lab, LATER_ADAPTER.name)
        if status == 200 or time.monotonic() - deployed > SERVABLE_WITHIN_S:
            break
        time.sleep(1)
    servable = time.monotonic() - deployed
    assert status == 200, body
    assert main_pid(lab, node, f"vllm@{replica}") == engine  # no restart: the resolver loaded it
    assert host.check_output(f"sha256sum {_staged(lab, poet['sha256'])}").split()[0] == poet["sha256"]
    later = lab_adapters((LATER_ADAPTER,))[LATER_ADAPTER.name]
    assert host.check_output(f"sha256sum {_staged(lab, later['sha256'])}").split()[0] == later["sha256"]
    every = dict.fromkeys([a.name for a in (*LAB_ADAPTERS, LATER_ADAPTER)], 1)
    wait_for("every adapter staged as declared again", lambda: True if _watch_verdicts(lab, node) == every else None,
             timeout=60, every=1)
    record_figure(tmp_path_factory, {"figure": "an adapter added to a running pool", "deploy_s":
                                     round(deployed - began, 1), "servable_after_deploy_s": round(servable, 1),
                                     "restarted": False})
