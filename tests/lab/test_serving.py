"""The serving lab: ``pyinfra inventories/lab/inventory.py deploys/vllm.py`` brought it from provisioned nodes to
serving
(scenario ``serving``), and these tests only read it; the healthy watch (scenario ``watched``) closes them.

lab1 (pool lab_single) serves the tiny model on its own; lab2 and lab3 (pool lab_pipeline) serve one
replica with pipeline parallel 2 over vLLM's multiprocessing backend. The real CPU build of vLLM runs
everywhere; traffic goes only to the lab nodes.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.client import HTTPException

import pytest
import yaml

from gpufleet.monitoring import dashboards
from gpufleet.node_paths import ADAPTERS_DIR
from gpufleet.units.security import EXPOSURE_BOUND, exposure_score
from tests.lab.checks import assert_no_errors, main_pid, metrics
from tests.lab.fleet import (
    INVENTORY,
    PIPELINE,
    PORT,
    ROUTER_METRICS_PORT,
    api_key,
    client_key,
    completion_tokens,
    deploy,
    http,
    lab_adapters,
    model_of,
    router_completion_tokens,
    router_counter,
    router_servers,
    router_url,
    served_name,
    single,
    tls,
    vllm_child,
)
from tests.lab.harness import LAB_FLEET, LAB_VARS, LAB_VENV, LAB_VLLM_VERSION, PYINFRA, Completed, Lab, run
from tests.lab.prometheus import (
    SCRAPE_INTERVAL_S,
    Prometheus,
    health_story,
    needs_a_bench,
    queries_without_data,
    wait_for,
)
from tests.lab.scenarios import LabStates

pytestmark = pytest.mark.filterwarnings("ignore:Unknown ssh-ed25519 host key:UserWarning")

MODEL_DIR = "/var/lib/gpufleet/models/tiny-llama"
# The healthy watch outlasts the lab's longest alert wait (its group_vars/lab.yml: a stalled engine's window and its
# `for`)
# by two scrapes; an alert whose condition held at any evaluation within it is pending there, whatever its `for`.
HEALTHY_WATCH_S = max(LAB_VARS["alert_engine_stall_s"] + LAB_VARS["alert_engine_stall_for_s"],
                      LAB_VARS["alert_replica_down_for_s"], LAB_VARS["alert_serving_for_s"],
                      LAB_VARS["alert_exporter_down_for_s"], LAB_VARS["alert_gpu_missing_for_s"]
                      ) + 2 * SCRAPE_INTERVAL_S


def test_deploy_converges_bare_nodes_to_serving(lab: Lab, serving: Completed | None) -> None:
    """The deploy that brought the lab to its scenario (deploys/vllm.py on nodes with at most the base setup of
    deploys/common.py): every replica serves behind its key, and every exporter answers."""
    assert serving is not None
    assert_no_errors(serving)
    key = api_key(lab)
    for node in (lab.nodes[0], lab.nodes[1]):  # lab1's replica; lab2 is rank 0 of the pipeline replica
        base = f"http://{node.address}:{PORT}"
        assert http(f"{base}/health")[0] == 200
        assert completion_tokens(lab, node) > 0
        status, metrics = http(f"{base}/metrics")
        assert status == 200 and re.search(r"^vllm:\w+", metrics, re.M), metrics[:500]
        assert http(f"{base}/v1/models")[0] == 401  # the API key guards /v1
        assert http(f"{base}/v1/models", key=key)[0] == 200
    for node in lab.nodes:
        status, metrics = http(f"http://{node.address}:9100/metrics")
        assert status == 200 and "node_systemd_unit_state" in metrics
        status, metrics = http(f"http://{node.address}:9400/metrics")
        assert status == 200 and "DCGM_FI_DEV_XID_ERRORS" in metrics  # our counters file


def test_vllm_reports_the_kv_cache_the_plan_planned(lab: Lab, serving: Completed | None) -> None:
    """The converge's readiness waits recorded what vLLM reports of each replica's KV cache on its first node
    (observed.json): within 2% of the plan, as the file says and as ``gpufleet plan --observed`` plans and reads it,
    and that it caches prefixes."""
    done = run([str(PYINFRA.parent / "gpufleet"), "plan", INVENTORY, "--json", "--observed"], lab.env, 300)
    assert done.rc == 0, done.output[-4000:]
    plan = {replica["name"]: replica for replica in json.loads(done.out)}
    for node, replica in ((lab.nodes[0], single(lab)), (lab.nodes[1], PIPELINE)):
        file = lab.host(node).file(f"/etc/gpufleet/vllm/{replica}/observed.json")
        assert (file.user, file.mode) == ("root", 0o644)
        observed = json.loads(file.content_string)
        planned = plan[replica]["kv_tokens_per_gpu"]
        assert observed["planned_kv_cache_tokens"] == planned and plan[replica]["observed"] == observed
        assert observed["source"] == "vllm:cache_config_info", observed
        assert observed["kv_cache_tokens"] == pytest.approx(planned, rel=0.02), observed
        assert observed["max_concurrency"] == pytest.approx(plan[replica]["max_concurrency"], rel=0.02), observed
        assert observed["vllm_version"].startswith(LAB_VLLM_VERSION), observed
        # vLLM caches prefixes by default (tests/data/vllm_ready/cache_config_0.31.metrics is the lab's answer)
        assert (observed["enable_prefix_caching"], observed["prefix_caching_hash_algo"]) == (True, "sha256"), observed


def _targets_by_job(lab: Lab) -> dict[str, dict[str, dict[str, str]]]:
    """What the lab's plan has Prometheus scrape, by job and address:port, with the labels of each target (its
    node, pool, and for a replica its model, replica and role; GPU indices are checked apart)."""
    pools = {lab.nodes[0].address: "lab_single", **{n.address: "lab_pipeline" for n in lab.nodes[1:]}}
    model = served_name("lab")
    node = {f"{n.address}:9100": {"node": n.address, "pool": pools[n.address]} for n in lab.nodes}
    dcgm = {f"{n.address}:9400": {"node": n.address, "pool": pools[n.address]} for n in lab.nodes}
    first, rank0 = lab.nodes[0].address, lab.nodes[1].address
    vllm = {f"{first}:{PORT}": {"node": first, "pool": "lab_single", "model": model, "replica": single(lab),
                                "role": "rank0"},
            f"{rank0}:{PORT}": {"node": rank0, "pool": "lab_pipeline", "model": model, "replica": PIPELINE,
                                "role": "rank0"}}
    router = {f"{n.address}:{ROUTER_METRICS_PORT}": {"node": n.address, "pool": pools[n.address]}
              for n in lab.nodes[:2]}  # the routers: lab1 and lab2
    return {"node": node, "dcgm": dcgm, "vllm": vllm, "router": router}


def test_prometheus_scrapes_every_target_of_the_plan_with_its_labels(lab: Lab, serving: Completed | None,
                                                                     lab_states: LabStates) -> None:
    """The monitoring group's Prometheus (lab1) scrapes every exporter, replica API and router of the plan, all
    up, each target and each of its series labelled with its node and pool, a replica's with its model, replica,
    role and GPUs."""
    prometheus = Prometheus(lab.nodes[0])
    expected = _targets_by_job(lab)
    lab_states.healthy_since()  # every target up, and the alerts of before the deploy resolved
    targets = prometheus.targets()
    found: dict[str, dict[str, dict[str, str]]] = {}
    for target in targets:
        labels = dict(target["labels"])
        job, instance = labels.pop("job"), labels.pop("instance")
        gpus = labels.pop("gpus", None)
        if job == "vllm":
            assert gpus and re.fullmatch(r"\d+(,\d+)*", gpus), target
        found.setdefault(job, {})[instance] = labels
    assert found == expected
    for job, needed in (("node", "node"), ("dcgm", "node"), ("vllm", "replica"), ("router", "node")):
        assert prometheus.query(f'count({{job="{job}"}})'), f"no series of job {job}"
        unlabelled = prometheus.query(f'count by (__name__) ({{job="{job}", {needed}=""}})')
        assert unlabelled == [], (job, unlabelled[:5])
    assert prometheus.query('count by (node) (DCGM_FI_DEV_GPU_TEMP{job="dcgm", pool!="", gpu!=""})')


def test_a_second_run_changes_nothing(lab: Lab, serving: Completed | None) -> None:
    rows = assert_no_errors(deploy(lab))
    operations = [name for name in rows if name != "Grand total"]
    changed = {name: row for name, row in rows.items() if name != "Grand total" and row[0] != "-"}
    assert operations and not changed, changed


def test_check_reports_no_drift_then_names_a_drifted_node(lab: Lab, serving: Completed | None) -> None:
    clean = run([str(PYINFRA), INVENTORY, "deploys/check.py", "-y"], lab.env, 600)
    assert clean.rc == 0, clean.output[-4000:]
    for node in lab.nodes:
        assert f"[{node.address}] gate: pass; drift: 0 operation(s)" in clean.output
    node = lab.nodes[2]
    policy = "/etc/gpufleet/gpu-health.json"
    # drift that leaves the policy valid: the node's GPU watch (every 30 s) reads it meanwhile
    lab.host(node).check_output(f"cp {policy} {policy}.saved && echo >> {policy}")
    try:
        drifted = run([str(PYINFRA), INVENTORY, "deploys/check.py", "-y"], lab.env, 600)
        assert lab.host(node).file(policy).content_string.endswith("\n\n")  # check changes nothing
    finally:
        lab.host(node).check_output(f"mv {policy}.saved {policy}")
    assert drifted.rc != 0
    assert f"[{node.address}] drift: vLLM: install and configure the replicas | Write the GPU health gate policy" \
        in drifted.output, drifted.output[-4000:]


def test_the_pipeline_replica_spans_two_nodes(lab: Lab, serving: Completed | None) -> None:
    rank0, rank1 = lab.nodes[1], lab.nodes[2]
    configs = [yaml.safe_load(lab.host(n).file(f"/etc/gpufleet/vllm/{PIPELINE}/config.yaml").content_string)
               for n in (rank0, rank1)]
    for rank, config in enumerate(configs):
        assert config["pipeline-parallel-size"] == 2 and config["nnodes"] == 2
        assert config["node-rank"] == rank and config["master-addr"] == rank0.address
        assert config["distributed-executor-backend"] == "mp"
    assert "headless" not in configs[0] and configs[1]["headless"] is True
    for node in (rank0, rank1):
        assert lab.host(node).service(f"vllm@{PIPELINE}").is_running
        env = lab.host(node).file(f"/etc/gpufleet/vllm/{PIPELINE}/vllm.env").content_string
        assert f'VLLM_HOST_IP="{node.address}"' in env and 'NCCL_SOCKET_IFNAME="host0"' in env
        assert 'GLOO_SOCKET_IFNAME="host0"' in env
    # rank 1 holds half the layers: rank 0 cannot answer without it
    assert completion_tokens(lab, rank0) > 0


def test_the_router_spreads_one_models_requests_over_both_replicas(lab: Lab, serving: Completed | None) -> None:
    """Both pools serve the tiny model under one name: the router on lab1 holds both replicas; the routers'
    virtual address answers the model list over HTTPS for the client's key, refuses it without a key and with the
    replicas' own key, refuses a model the client may not use (any model no pool serves), and sends requests to
    both replicas (least connections)."""
    servers = router_servers(lab)
    assert {name: entry["status"] for name, entry in servers.items()} == {single(lab): "UP", PIPELINE: "UP"}
    url, context, key = router_url(lab), tls(lab), client_key(lab)
    status, body = http(f"{url}/v1/models", key=key, context=context)
    # the model, and the LoRA adapters lab_single declares (tests/lab/test_adapters.py): the routers list names sorted
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == sorted(
        [served_name("lab"), *lab_adapters()]), body
    assert http(f"{url}/v1/models", context=context)[0] == 401
    assert http(f"{url}/v1/models", key=api_key(lab), context=context)[0] == 401
    assert http(f"{url}/v1/completions", {"model": "another", "prompt": "x"}, key, context=context)[0] == 403
    with pytest.raises((OSError, HTTPException)):  # TLS only: no answer to plain HTTP on router_port
        http(url.replace("https://", "http://") + "/v1/models", key=key, timeout=10)
    before = router_counter(lab, "haproxy_server_http_responses_total")
    done: list[int] = []
    threads = [threading.Thread(target=lambda: done.append(router_completion_tokens(lab))) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert len(done) == 6 and all(done), done
    assert router_counter(lab, "haproxy_server_http_responses_total") >= before + 6
    for server in (single(lab), PIPELINE):  # each replica answered some (2xx responses counted per server)
        answered = [float(line.rsplit(" ", 1)[1]) for router in lab.nodes[:2]
                    for line in metrics(router, ROUTER_METRICS_PORT).splitlines()
                    if line.startswith("haproxy_server_http_responses_total{") and f'server="{server}"' in line
                    and 'code="2xx"' in line]
        assert sum(answered) > 0, (server, answered)


# The series of the routers' clients (router_admin.py client-metrics): written only where router_clients is set.
CLIENT_SERIES = "gpufleet_router_client_"


def test_every_dashboard_query_parses_and_returns_data_on_the_lab(lab: Lab, serving: Completed | None) -> None:
    """Each panel's and variable's query of the shipped dashboards, with the lab's model and an NVLink node, on the
    lab's Prometheus while requests flow through the router (latency and rate panels need recent requests)."""
    prometheus = Prometheus(lab.nodes[0])
    queries = [q for q in dashboards.panel_queries() + dashboards.variable_queries() if not needs_a_bench(q)]
    values = {"model": served_name("lab"), "node": lab.nodes[1].address}  # lab2: 8xH100-SXM, NVLink

    def needing_data() -> dict[str, str]:
        """Every query without data (the Clients row's come from the routers' clients' counters: the requests below
        are the lab client's)."""
        return queries_without_data(prometheus, queries, values)

    def all_answer() -> bool | None:
        for _ in range(4):
            assert router_completion_tokens(lab) > 0
        return True if not needing_data() else None

    assert any(CLIENT_SERIES in query.expr for query in queries)  # the row is there, and is parsed below
    try:
        wait_for("every dashboard query returns data", all_answer, timeout=150, every=5)
    except AssertionError:
        raise AssertionError(f"without data: {needing_data()}") from None


def test_vllm_runs_as_its_own_user_and_secrets_stay_out_of_sight(lab: Lab, serving: Completed | None) -> None:
    key = api_key(lab)
    replicas = [(lab.nodes[0], single(lab)), (lab.nodes[1], PIPELINE), (lab.nodes[2], PIPELINE)]
    for node, replica in replicas:
        host = lab.host(node)
        pid = main_pid(lab, node, f"vllm@{replica}")
        assert host.check_output(f"ps -o user= -p {pid}").strip() == "vllm"
        secret = host.file(f"/etc/gpufleet/secrets/{replica}.env")
        assert (secret.user, secret.group, secret.mode) == ("root", "root", 0o600)
        assert host.file("/etc/gpufleet/secrets").mode == 0o700
        assert key in host.check_output(f"cat /etc/gpufleet/secrets/{replica}.env")
        listing = host.check_output("ps -eo args")
        assert key not in listing and "VLLM_API_KEY" not in listing
        visible = host.run(f"grep -rl -- {key} /etc/systemd /etc/gpufleet/vllm /opt/gpufleet /var/log 2>/dev/null")
        assert visible.stdout.strip() == "", visible.stdout
        journal = host.run(f"journalctl --no-pager -u vllm@{replica} | grep -c -- {key}")
        assert journal.stdout.strip() == "0"
        unreadable = host.run(f"runuser -u vllm -- cat /etc/gpufleet/secrets/{replica}.env")
        assert unreadable.rc != 0


def test_the_pipeline_ranks_share_a_rank_secret_that_vllm_never_sees(lab: Lab, serving: Completed | None) -> None:
    """The pipeline's two nodes hold one rank secret (root 0600), drawn by the deploy; it is in no argv, no
    journal line of the unit and not in vLLM's environment (replica_rank.py took it out)."""
    path, held = f"/etc/gpufleet/secrets/{PIPELINE}.rank.env", set()
    for node in lab.nodes[1:]:
        host = lab.host(node)
        found = host.file(path)
        assert (found.user, found.group, found.mode) == ("root", "root", 0o600)
        secret = host.check_output(f"sed -n 's/^GPUFLEET_RANK_SECRET=\"\\(.*\\)\"$/\\1/p' {path}").strip()
        assert re.fullmatch(r"[0-9a-f]{64}", secret)
        held.add(secret)
        assert secret not in host.check_output("ps -eo args")
        assert host.run(f"journalctl --no-pager -u vllm@{PIPELINE} | grep -c -- {secret}").stdout.strip() == "0"
        child = vllm_child(lab, node, f"vllm@{PIPELINE}")
        assert child and "GPUFLEET_RANK_SECRET" not in host.check_output(f"tr '\\0' '\\n' < /proc/{child}/environ")
    assert len(held) == 1


def test_the_served_model_name_is_served_literally(lab: Lab, serving: Completed | None) -> None:
    """lab_single's served name may hold spaces, ``$`` and ``%``: vLLM lists it and answers under it verbatim (first,
    then the LoRA adapters its pool declares, which the deploy's readiness wait asked for once)."""
    node = lab.nodes[0]
    status, body = http(f"http://{node.address}:{PORT}/v1/models", key=api_key(lab))
    assert status == 200, body
    listed = [m["id"] for m in json.loads(body)["data"]]
    assert listed[0] == model_of(lab, node) and sorted(listed[1:]) == sorted(lab_adapters()), listed
    assert completion_tokens(lab, node) > 0


def test_vllm_env_reaches_the_process_literally(lab: Lab, serving: Completed | None) -> None:
    """Every vllm_env value (lab_single's may hold quotes, ``$``, ``%``, backslashes) is what systemd hands vLLM."""
    node = lab.nodes[0]
    wanted = {}
    for group in ("lab", "lab_single"):  # the later group's mapping replaces the earlier one
        data = yaml.safe_load((LAB_FLEET / "group_vars" / f"{group}.yml").read_text()) or {}
        wanted = data.get("vllm_env", wanted)
    assert wanted
    pid = main_pid(lab, node, f"vllm@{single(lab)}")
    raw = lab.host(node).check_output(f"tr '\\0' '\\n' < /proc/{pid}/environ")
    environ = dict(line.split("=", 1) for line in raw.splitlines() if "=" in line)
    assert {name: environ.get(name) for name in wanted} == wanted


def test_the_vllm_user_can_write_nothing_root_runs_or_trusts(lab: Lab, serving: Completed | None) -> None:
    """Models, gpufleet's configuration and the virtualenvs are root's: the vllm user writes only its home (it reads
    the LoRA adapters through their group, vllm, which may not write them)."""
    for node in lab.nodes:
        host = lab.host(node)
        probe = host.run("runuser -u vllm -- touch /var/lib/vllm/.gpufleet-probe && rm /var/lib/vllm/.gpufleet-probe")
        assert probe.rc == 0, probe.stderr  # the check below can fail: vllm can write where it should
        venv = host.check_output(f"readlink -f {LAB_VENV}").strip()
        assert venv.startswith(f"/opt/vllm/.build-{LAB_VLLM_VERSION}-"), venv
        for directory in (MODEL_DIR, "/var/lib/gpufleet/models", ADAPTERS_DIR, "/etc/gpufleet", "/etc/gpufleet/vllm",
                          "/opt/vllm", venv, f"{venv}/bin", "/opt/gpufleet/node"):
            target = f"{directory}/.written-by-vllm"
            done = host.run(f"runuser -u vllm -- touch {target}")
            assert done.rc != 0 and not host.file(target).exists, f"{node.name}: vllm wrote {target}"
        for existing in (f"{MODEL_DIR}/config.json", "/etc/gpufleet/gpu-health.json", f"{venv}/bin/vllm"):
            assert host.run(f"runuser -u vllm -- sh -c ': >> {existing}'").rc != 0, f"{node.name}: {existing}"
        owned = host.run("find /var/lib/gpufleet /etc/gpufleet /opt/vllm /opt/gpufleet"
                         " \\( -user vllm -o \\( -group vllm -perm -g+w ! -type l \\)"
                         " -o \\( -perm -o+w ! -type l \\) \\) -print")
        # and what it reads through its group is there: the staged adapters, on the node whose pool declares them
        readable = host.run(f"find {ADAPTERS_DIR} -group vllm -type f").stdout.split()
        assert len(readable) == (2 * len(lab_adapters()) if node == lab.nodes[0] else 0), readable
        assert owned.stdout.strip() == "", f"{node.name}: {owned.stdout[:2000]}"


def test_the_vllm_unit_is_sandboxed(lab: Lab, serving: Completed | None) -> None:
    node = lab.nodes[0]
    out = lab.host(node).check_output(f"systemd-analyze security --no-pager vllm@{single(lab)}.service")
    score = exposure_score(out)
    print(json.dumps({"unit": f"vllm@{single(lab)}.service", "exposure": score}))
    assert score <= EXPOSURE_BOUND, out[-2000:]


def test_no_alert_fires_on_the_healthy_lab(lab: Lab, watched: Completed | None, lab_states: LabStates) -> None:
    """From the moment Prometheus saw every target of the serving lab up and the alerts of before the deploy
    resolved, through the serving scenario's tests (checks, requests), for at least HEALTHY_WATCH_S: no alert fired,
    with the lab's short waits (inventories/lab/group_vars/lab.yml), and none was even pending."""
    healthy_since = lab_states.healthy_since()
    prometheus = Prometheus(lab.nodes[0])
    time.sleep(max(0.0, healthy_since + HEALTHY_WATCH_S - time.monotonic()))
    seconds = int(time.monotonic() - healthy_since)
    fired = prometheus.query(f'max_over_time(ALERTS{{alertstate="firing"}}[{seconds}s])')
    assert fired == [], ([f["metric"] for f in fired], health_story(prometheus, seconds))
    pending = prometheus.query(f'max_over_time(ALERTS{{alertstate="pending"}}[{seconds}s])')
    assert pending == [], ([p["metric"] for p in pending], health_story(prometheus, seconds))
    assert prometheus.alerts() == []

