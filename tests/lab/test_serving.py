"""The full stack on the lab: ``pyinfra inventories/lab.py deploys/vllm.py`` from bare nodes to serving.

lab1 (pool lab_single) serves the tiny model on its own; lab2 and lab3 (pool lab_pipeline) serve one
replica with pipeline parallel 2 over vLLM's multiprocessing backend. The real CPU build of vLLM runs
everywhere. Tests run in file order and build on each other; traffic goes only to the lab nodes.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpufleet import dashboards
from gpufleet.dashboards import Query
from gpufleet.lab.nodes import API_KEY_FILE, power_off
from gpufleet.lab.request_load import RequestLoad
from gpufleet.lab.sim_profile import write_sim_profile
from gpufleet.lab.state import NodeRecord
from gpufleet.unit_security import EXPOSURE_BOUND, exposure_score
from tests.lab.checks import assert_no_errors, assert_nothing_changed, main_pid, metrics
from tests.lab.conftest import LAB_VENV, LAB_VLLM_VERSION, PYINFRA, ROOT, Completed, Lab, _run
from tests.lab.prometheus import Prometheus, wait_for

pytestmark = [
    pytest.mark.lab,
    pytest.mark.filterwarnings("ignore:Unknown ssh-ed25519 host key:UserWarning"),
]

INVENTORY = "inventories/lab.py"
DEPLOY = "deploys/vllm.py"
PORT = 8000
MODEL_DIR = "/var/lib/gpufleet/models/tiny-llama"
SINGLE = "lab_single-{}"
PIPELINE = "lab_pipeline-0"


def _served_name(group: str) -> str:
    """The model name a pool serves under, as its group_vars give it (lab_single's may be hostile text)."""
    for name in (group, "lab"):
        data = yaml.safe_load((ROOT / "group_vars" / f"{name}.yml").read_text()) or {}
        if data.get("vllm_served_model_name"):
            return data["vllm_served_model_name"]
    raise AssertionError(f"no vllm_served_model_name for {group}")


def _deploy(lab: Lab, *options: str, inventory: str = INVENTORY, timeout: float = 1800) -> Completed:
    return _run([str(PYINFRA), inventory, DEPLOY, "-y", *options], lab.env, timeout)


def _single(lab: Lab) -> str:
    return SINGLE.format(lab.nodes[0].address.replace(".", "-"))


def _api_key(lab: Lab) -> str:
    return (lab.directory / API_KEY_FILE).read_text().strip()


def _http(url: str, body: dict | None = None, key: str | None = None, timeout: float = 120) -> tuple[int, str]:
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                     method="GET" if body is None else "POST")
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _model(lab: Lab, node: NodeRecord) -> str:
    """The name the replica on ``node`` serves under: lab1 is in lab_single, the others in lab_pipeline."""
    return _served_name("lab_single" if node == lab.nodes[0] else "lab_pipeline")


def _completion_tokens(lab: Lab, node: NodeRecord) -> int:
    status, body = _http(f"http://{node.address}:{PORT}/v1/completions",
                         {"model": _model(lab, node), "prompt": "The fleet is", "max_tokens": 8, "temperature": 0},
                         _api_key(lab))
    assert status == 200, body
    return json.loads(body)["usage"]["completion_tokens"]



ROUTER_PORT = 8080
ROUTER_METRICS_PORT = 8405
ROUTER_ADMIN = "python3 /opt/gpufleet/node/router_admin.py"


def _router_completion_tokens(lab: Lab) -> int:
    """One completion through the router on lab1 (the ``routers`` group of inventories/lab.py)."""
    status, body = _http(f"http://{lab.nodes[0].address}:{ROUTER_PORT}/v1/completions",
                         {"model": _served_name("lab"), "prompt": "The fleet is", "max_tokens": 8,
                          "temperature": 0}, _api_key(lab))
    assert status == 200, body
    return json.loads(body)["usage"]["completion_tokens"]


def _router_servers(lab: Lab) -> dict[str, dict[str, object]]:
    """The router's servers (replicas) as its runtime API shows them, read on lab1 with router_admin.py."""
    shown = json.loads(lab.host(lab.nodes[0]).check_output(f"{ROUTER_ADMIN} show"))
    return {entry["server"]: entry for entry in shown["servers"]}


def _wait_router_status(lab: Lab, server: str, status: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    found: object = None
    while time.monotonic() < end:
        found = _router_servers(lab)[server]["status"]
        if found == status:
            return
        time.sleep(0.5)
    pytest.fail(f"the router shows {server} {found}, not {status}, after {timeout} s")


def _router_counter(lab: Lab, name: str) -> float:
    """The sum of one of HAProxy's Prometheus counters over its backends, read from the bridge."""
    text = metrics(lab.nodes[0], ROUTER_METRICS_PORT)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _router_retries(lab: Lab) -> float:
    """Requests the router sent again (to the same replica, or redispatched to another), over every backend."""
    return sum(_router_counter(lab, f"haproxy_backend_{kind}_warnings_total") for kind in ("retry", "redispatch"))


def _wait_serving(lab: Lab, node: NodeRecord, timeout: float = 600) -> None:
    end = time.monotonic() + timeout
    last = ""
    while time.monotonic() < end:
        try:
            if _completion_tokens(lab, node) > 0:
                return
        except (OSError, AssertionError) as exc:
            last = str(exc)
        time.sleep(3)
    pytest.fail(f"{node.name} did not serve again within {timeout} s: {last}")



def test_deploy_converges_bare_nodes_to_serving(lab: Lab) -> None:
    done = _deploy(lab)
    assert_no_errors(done)
    key = _api_key(lab)
    for node in (lab.nodes[0], lab.nodes[1]):  # lab1's replica; lab2 is rank 0 of the pipeline replica
        base = f"http://{node.address}:{PORT}"
        assert _http(f"{base}/health")[0] == 200
        assert _completion_tokens(lab, node) > 0
        status, metrics = _http(f"{base}/metrics")
        assert status == 200 and re.search(r"^vllm:\w+", metrics, re.M), metrics[:500]
        assert _http(f"{base}/v1/models")[0] == 401  # the API key guards /v1
        assert _http(f"{base}/v1/models", key=key)[0] == 200
    for node in lab.nodes:
        status, metrics = _http(f"http://{node.address}:9100/metrics")
        assert status == 200 and "node_systemd_unit_state" in metrics
        status, metrics = _http(f"http://{node.address}:9400/metrics")
        assert status == 200 and "DCGM_FI_DEV_XID_ERRORS" in metrics  # our counters file


def test_vllm_reports_the_kv_cache_the_plan_planned(lab: Lab) -> None:
    """The converge's readiness waits recorded what vLLM reports of each replica's KV cache on its first node
    (observed.json): within 2% of the plan, as the file says and as ``gpufleet plan --observed`` plans and reads it."""
    done = _run([str(PYINFRA.parent / "gpufleet"), "plan", INVENTORY, "--json", "--observed"], lab.env, 300)
    assert done.rc == 0, done.output[-4000:]
    plan = {replica["name"]: replica for replica in json.loads(done.out)}
    for node, replica in ((lab.nodes[0], _single(lab)), (lab.nodes[1], PIPELINE)):
        file = lab.host(node).file(f"/etc/gpufleet/vllm/{replica}/observed.json")
        assert (file.user, file.mode) == ("root", 0o644)
        observed = json.loads(file.content_string)
        planned = plan[replica]["kv_tokens_per_gpu"]
        assert observed["planned_kv_cache_tokens"] == planned and plan[replica]["observed"] == observed
        assert observed["source"] == "vllm:cache_config_info", observed
        assert observed["kv_cache_tokens"] == pytest.approx(planned, rel=0.02), observed
        assert observed["max_concurrency"] == pytest.approx(plan[replica]["max_concurrency"], rel=0.02), observed
        assert observed["vllm_version"].startswith(LAB_VLLM_VERSION), observed


HEALTHY_WATCH_S = 300
_healthy_since: list[float] = []  # when Prometheus first saw every target up: the healthy watch starts there


def _targets_by_job(lab: Lab) -> dict[str, dict[str, dict[str, str]]]:
    """What the lab's plan has Prometheus scrape, by job and address:port, with the labels of each target (its
    node, pool, and for a replica its model, replica and role; GPU indices are checked apart)."""
    pools = {lab.nodes[0].address: "lab_single", **{n.address: "lab_pipeline" for n in lab.nodes[1:]}}
    model = _served_name("lab")
    node = {f"{n.address}:9100": {"node": n.address, "pool": pools[n.address]} for n in lab.nodes}
    dcgm = {f"{n.address}:9400": {"node": n.address, "pool": pools[n.address]} for n in lab.nodes}
    first, rank0 = lab.nodes[0].address, lab.nodes[1].address
    vllm = {f"{first}:{PORT}": {"node": first, "pool": "lab_single", "model": model, "replica": _single(lab),
                                "role": "rank0"},
            f"{rank0}:{PORT}": {"node": rank0, "pool": "lab_pipeline", "model": model, "replica": PIPELINE,
                                "role": "rank0"}}
    router = {f"{first}:{ROUTER_METRICS_PORT}": {"node": first, "pool": "lab_single"}}
    return {"node": node, "dcgm": dcgm, "vllm": vllm, "router": router}


def test_prometheus_scrapes_every_target_of_the_plan_with_its_labels(lab: Lab) -> None:
    """The monitoring group's Prometheus (lab1) scrapes every exporter, replica API and router of the plan, all
    up, each target and each of its series labelled with its node and pool, a replica's with its model, replica,
    role and GPUs."""
    prometheus = Prometheus(lab.nodes[0])
    expected = _targets_by_job(lab)

    def all_up() -> list[dict[str, Any]] | None:
        targets = prometheus.targets()
        return targets if targets and all(t["health"] == "up" for t in targets) else None

    try:
        targets, _ = wait_for("every target up", all_up, timeout=180)
    except AssertionError:
        down = [(t["scrapeUrl"], t["lastError"]) for t in prometheus.targets() if t["health"] != "up"]
        raise AssertionError(f"targets not up: {down}") from None
    # Prometheus may have run before the replicas did (deploys/monitoring.py): the lab is healthy once what it
    # said then has resolved.
    wait_for("the alerts of before the deploy resolved", lambda: True if not prometheus.firing() else None,
             timeout=180)
    _healthy_since.append(time.monotonic())
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


def test_a_second_run_changes_nothing(lab: Lab) -> None:
    rows = assert_no_errors(_deploy(lab))
    operations = [name for name in rows if name != "Grand total"]
    changed = {name: row for name, row in rows.items() if name != "Grand total" and row[0] != "-"}
    assert operations and not changed, changed


def test_check_reports_no_drift_then_names_a_drifted_node(lab: Lab) -> None:
    clean = _run([str(PYINFRA), INVENTORY, "deploys/check.py", "-y"], lab.env, 600)
    assert clean.rc == 0, clean.output[-4000:]
    for node in lab.nodes:
        assert f"[{node.address}] gate: pass; drift: 0 operation(s)" in clean.output
    node = lab.nodes[2]
    policy = "/etc/gpufleet/gpu-health.json"
    lab.host(node).check_output(f"cp {policy} {policy}.saved && echo '# edited' >> {policy}")
    try:
        drifted = _run([str(PYINFRA), INVENTORY, "deploys/check.py", "-y"], lab.env, 600)
        assert "# edited" in lab.host(node).file(policy).content_string  # check changes nothing
    finally:
        lab.host(node).check_output(f"mv {policy}.saved {policy}")
    assert drifted.rc != 0
    assert f"[{node.address}] drift: vLLM: install and configure the replicas | Write the GPU health gate policy" \
        in drifted.output, drifted.output[-4000:]


def test_the_pipeline_replica_spans_two_nodes(lab: Lab) -> None:
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
    assert _completion_tokens(lab, rank0) > 0


def test_the_router_spreads_one_models_requests_over_both_replicas(lab: Lab) -> None:
    """Both pools serve the tiny model under one name: the router on lab1 holds both replicas, answers the model
    list for the API key, refuses it without the key, and sends requests to both (least connections)."""
    servers = _router_servers(lab)
    assert {name: entry["status"] for name, entry in servers.items()} == {_single(lab): "UP", PIPELINE: "UP"}
    url = f"http://{lab.nodes[0].address}:{ROUTER_PORT}"
    status, body = _http(f"{url}/v1/models", key=_api_key(lab))
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == [_served_name("lab")], body
    assert _http(f"{url}/v1/models")[0] == 401
    assert _http(f"{url}/v1/completions", {"model": "another", "prompt": "x"}, _api_key(lab))[0] == 404
    before = _router_counter(lab, "haproxy_server_http_responses_total")
    done: list[int] = []
    threads = [threading.Thread(target=lambda: done.append(_router_completion_tokens(lab))) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert len(done) == 6 and all(done), done
    assert _router_counter(lab, "haproxy_server_http_responses_total") >= before + 6
    text = metrics(lab.nodes[0], ROUTER_METRICS_PORT)
    for server in (_single(lab), PIPELINE):  # each replica answered some (2xx responses counted per server)
        answered = [line for line in text.splitlines() if line.startswith("haproxy_server_http_responses_total{")
                    and f'server="{server}"' in line and 'code="2xx"' in line]
        assert answered and float(answered[0].rsplit(" ", 1)[1]) > 0, (server, answered)


def _without_data(prometheus: Prometheus, queries: list[Query], values: dict[str, str]) -> dict[str, str]:
    """The queries that return nothing, or NaN only, on the lab's Prometheus now: name -> the query as run. A
    query Prometheus cannot parse fails the test at once."""
    empty = {}
    for query in queries:
        expr = query.resolve(values)
        try:
            result = prometheus.query(expr)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{query.name}: Prometheus refused {expr!r}: {exc.read().decode()[:300]}") from None
        numbers = [float((r.get("value") or r["values"][-1])[1]) for r in result]
        if not any(n == n for n in numbers):  # NaN != NaN
            empty[query.name] = expr
    return empty


def test_every_dashboard_query_parses_and_returns_data_on_the_lab(lab: Lab) -> None:
    """Each panel's and variable's query of the shipped dashboards, with the lab's model and an NVLink node, on the
    lab's Prometheus while requests flow through the router (latency and rate panels need recent requests)."""
    prometheus = Prometheus(lab.nodes[0])
    queries = dashboards.panel_queries() + dashboards.variable_queries()
    values = {"model": _served_name("lab"), "node": lab.nodes[1].address}  # lab2: 8xH100-SXM, NVLink

    def all_answer() -> bool | None:
        for _ in range(4):
            assert _router_completion_tokens(lab) > 0
        return True if not _without_data(prometheus, queries, values) else None

    try:
        wait_for("every dashboard query returns data", all_answer, timeout=150, every=5)
    except AssertionError:
        raise AssertionError(f"without data: {_without_data(prometheus, queries, values)}") from None


def test_vllm_runs_as_its_own_user_and_secrets_stay_out_of_sight(lab: Lab) -> None:
    key = _api_key(lab)
    replicas = [(lab.nodes[0], _single(lab)), (lab.nodes[1], PIPELINE), (lab.nodes[2], PIPELINE)]
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


def test_the_served_model_name_is_served_literally(lab: Lab) -> None:
    """lab_single's served name may hold spaces, ``$`` and ``%``: vLLM lists it and answers under it verbatim."""
    node = lab.nodes[0]
    status, body = _http(f"http://{node.address}:{PORT}/v1/models", key=_api_key(lab))
    assert status == 200, body
    assert [m["id"] for m in json.loads(body)["data"]] == [_model(lab, node)]
    assert _completion_tokens(lab, node) > 0


def test_vllm_env_reaches_the_process_literally(lab: Lab) -> None:
    """Every vllm_env value (lab_single's may hold quotes, ``$``, ``%``, backslashes) is what systemd hands vLLM."""
    node = lab.nodes[0]
    wanted = {}
    for group in ("lab", "lab_single"):  # the later group's mapping replaces the earlier one
        data = yaml.safe_load((ROOT / "group_vars" / f"{group}.yml").read_text()) or {}
        wanted = data.get("vllm_env", wanted)
    assert wanted
    pid = main_pid(lab, node, f"vllm@{_single(lab)}")
    raw = lab.host(node).check_output(f"tr '\\0' '\\n' < /proc/{pid}/environ")
    environ = dict(line.split("=", 1) for line in raw.splitlines() if "=" in line)
    assert {name: environ.get(name) for name in wanted} == wanted


def test_the_vllm_user_can_write_nothing_root_runs_or_trusts(lab: Lab) -> None:
    """Models, gpufleet's configuration and the virtualenvs are root's: the vllm user writes only its home."""
    for node in lab.nodes:
        host = lab.host(node)
        probe = host.run("runuser -u vllm -- touch /var/lib/vllm/.gpufleet-probe && rm /var/lib/vllm/.gpufleet-probe")
        assert probe.rc == 0, probe.stderr  # the check below can fail: vllm can write where it should
        venv = host.check_output(f"readlink -f {LAB_VENV}").strip()
        assert venv.startswith(f"/opt/vllm/.build-{LAB_VLLM_VERSION}-"), venv
        for directory in (MODEL_DIR, "/var/lib/gpufleet/models", "/etc/gpufleet", "/etc/gpufleet/vllm",
                          "/opt/vllm", venv, f"{venv}/bin", "/opt/gpufleet/node"):
            target = f"{directory}/.written-by-vllm"
            done = host.run(f"runuser -u vllm -- touch {target}")
            assert done.rc != 0 and not host.file(target).exists, f"{node.name}: vllm wrote {target}"
        for existing in (f"{MODEL_DIR}/config.json", "/etc/gpufleet/gpu-health.json", f"{venv}/bin/vllm"):
            assert host.run(f"runuser -u vllm -- sh -c ': >> {existing}'").rc != 0, f"{node.name}: {existing}"
        owned = host.run("find /var/lib/gpufleet /etc/gpufleet /opt/vllm /opt/gpufleet"
                         " \\( -user vllm -o -group vllm -o \\( -perm -o+w ! -type l \\) \\) -print")
        assert owned.stdout.strip() == "", f"{node.name}: {owned.stdout[:2000]}"


def test_the_vllm_unit_is_sandboxed(lab: Lab) -> None:
    node = lab.nodes[0]
    out = lab.host(node).check_output(f"systemd-analyze security --no-pager vllm@{_single(lab)}.service")
    score = exposure_score(out)
    print(json.dumps({"unit": f"vllm@{_single(lab)}.service", "exposure": score}))
    assert score <= EXPOSURE_BOUND, out[-2000:]


def test_no_alert_fires_on_the_healthy_lab(lab: Lab) -> None:
    """From the moment Prometheus saw every target up and the alerts of before the deploy resolved, through the
    tests above (deploys, checks, requests), for at least HEALTHY_WATCH_S: no alert fired, with the lab's short
    waits (group_vars/lab.yml)."""
    assert _healthy_since, "test_prometheus_scrapes_every_target_of_the_plan_with_its_labels did not pass"
    prometheus = Prometheus(lab.nodes[0])
    time.sleep(max(0.0, _healthy_since[0] + HEALTHY_WATCH_S - time.monotonic()))
    watched = int(time.monotonic() - _healthy_since[0])
    fired = prometheus.query(f'max_over_time(ALERTS{{alertstate="firing"}}[{watched}s])')
    assert fired == [], [f["metric"] for f in fired]
    pending = prometheus.query(f'max_over_time(ALERTS{{alertstate="pending"}}[{watched}s])')
    print(f"healthy watch: {watched} s, no alert fired; pending on the way: {[p['metric'] for p in pending]}")
    assert prometheus.firing() == {}


def test_kill_9_of_vllm_is_restarted_and_serves_again(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> None:
    """systemd restarts a killed vLLM; meanwhile the router takes the replica out and the clients' requests, in
    flight included, go to the other replica: none fails."""
    node, unit = lab.nodes[0], f"vllm@{_single(lab)}"
    retried_before = _router_retries(lab)
    # Load through the router from before the kill until the router has taken the replica out and the other one
    # carried it alone for a while; not during the restart, which the lab's two cores could not also carry.
    load = _load(lab, None, streams=2, pause_s=1.0).start()
    try:
        time.sleep(5)  # requests in flight on both replicas
        before = main_pid(lab, node, unit)
        lab.host(node).check_output(f"kill -{int(signal.SIGKILL)} {before}")
        killed = time.monotonic()
        _wait_router_status(lab, _single(lab), "DOWN", timeout=60)
        taken_out = time.monotonic() - killed
        time.sleep(15)
    finally:
        load.stop()
    end = time.monotonic() + 120
    after = 0
    while time.monotonic() < end:
        after = main_pid(lab, node, unit)
        if after and after != before:
            break
        time.sleep(2)
    assert after and after != before, f"systemd did not restart {unit}"
    _wait_serving(lab, node)
    _wait_router_status(lab, _single(lab), "UP", timeout=60)
    back = time.monotonic() - killed
    figures = load.figures()
    assert figures["requests"] > 0 and load.failures == [], load.failures[:3]
    _record_figure(tmp_path_factory, {
        "fault": "kill -9 of a replica behind the router", "replica": _single(lab), **figures,
        "retried": _router_retries(lab) - retried_before, "taken_out_s": round(taken_out, 1),
        "back_in_router_s": round(back, 1)})


def _vllm_child(lab: Lab, node: NodeRecord, unit: str) -> int:
    """The vLLM process replica_rank.py runs for ``unit`` on ``node`` (0: none yet)."""
    supervisor = main_pid(lab, node, unit)
    found = lab.host(node).run(f"pgrep -P {supervisor} -f 'vllm serve'").stdout.split()
    return int(found[0]) if supervisor and found else 0


def _load(lab: Lab, node: NodeRecord | None, **options: Any) -> RequestLoad:
    """Completions against the replica on ``node`` (or, with ``node`` None, through the router), one every 3 s
    unless ``pause_s`` says otherwise: what must keep answering while another replica fails. Spaced out because
    the lab's CPU vLLMs share this machine's two cores: a replica kept busy starves the one restarting."""
    if node is None:
        return RequestLoad(f"http://{lab.nodes[0].address}:{ROUTER_PORT}", _served_name("lab"), _api_key(lab),
                           **options)
    return RequestLoad(f"http://{node.address}:{PORT}", _model(lab, node), _api_key(lab), **options)


@pytest.mark.parametrize("rank", [0, 1])
def test_kill_9_of_any_rank_restarts_the_whole_pipeline_replica_once(lab: Lab, rank: int,
                                                                     tmp_path_factory: pytest.TempPathFactory) -> None:
    """Killing either rank's vLLM stops the other rank too; both start again as one new generation and the
    replica serves, without an operator; lab1's replica answers throughout."""
    unit = f"vllm@{PIPELINE}"
    ranks = lab.nodes[1:]  # lab2 is rank 0 (the API), lab3 rank 1
    _wait_serving(lab, ranks[0])
    before = {n.name: _vllm_child(lab, n, unit) for n in ranks}
    assert all(before.values()), before
    restarts = {n.name: lab.host(n).check_output(f"systemctl show -p NRestarts --value {unit}") for n in ranks}
    loop = _load(lab, lab.nodes[0])
    loop.start()
    try:
        killed = time.monotonic()
        lab.host(ranks[rank]).check_output(f"kill -{int(signal.SIGKILL)} {before[ranks[rank].name]}")
        _wait_serving(lab, ranks[0], timeout=600)
        recovered = time.monotonic() - killed
    finally:
        loop.stop()
    after = {n.name: _vllm_child(lab, n, unit) for n in ranks}
    assert all(after.values()) and set(after.values()).isdisjoint(before.values()), (before, after)
    for n in ranks:  # one restart of each rank's unit: no storm
        count = int(lab.host(n).check_output(f"systemctl show -p NRestarts --value {unit}"))
        assert count == int(restarts[n.name]) + 1, (n.name, restarts[n.name], count)
    assert loop.sent > 0 and loop.failures == [], loop.failures[:3]
    _record_figure(tmp_path_factory, {
        "fault": f"kill -9 of rank {rank}'s vLLM", "replica": PIPELINE, "serving_again_s": round(recovered, 1),
        "other_replica_requests": loop.sent, "other_replica_failures": 0})


def _record_figure(tmp_path_factory: pytest.TempPathFactory, figure: dict[str, object]) -> None:
    """Add one fault's figure to the session's lab-fault-figures.jsonl, beside its temporary files."""
    with (tmp_path_factory.getbasetemp() / "lab-fault-figures.jsonl").open("a") as figures:
        figures.write(json.dumps(figure) + "\n")


DRIVER_PACKAGES = "nvidia-driver-580-open libnvidia-compute-580 nvidia-persistenced"
NVML_INIT = "python3 -c 'import ctypes; print(ctypes.CDLL(\"libnvidia-ml.so.1\").nvmlInit_v2())'"


def test_one_deploy_converges_a_node_without_a_driver(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> None:
    """lab1 loses its driver and its replica (purged, stopped): one deploy plans it from its gpu_profile, installs
    the driver, gates it on a fresh probe and serves; the pipeline replica answers throughout."""
    node, unit = lab.nodes[0], f"vllm@{_single(lab)}"
    host = lab.host(node)
    host.check_output(f"systemctl stop {unit} && apt-get purge -y -q {DRIVER_PACKAGES} >/dev/null 2>&1")
    assert host.run(NVML_INIT).rc != 0  # bare: no NVML
    loop = _load(lab, lab.nodes[1])
    loop.start()
    try:
        started = time.monotonic()
        done = _deploy(lab)
        assert_no_errors(done)  # no node stopped at the gate or anywhere else
        _wait_serving(lab, node, timeout=60)  # the deploy waited for it: it answers at once
        converged = time.monotonic() - started
    finally:
        loop.stop()
    assert host.run(NVML_INIT).stdout.strip() == "0"
    assert host.service(unit).is_running
    assert loop.sent > 0 and loop.failures == [], loop.failures[:3]
    assert_nothing_changed(_deploy(lab))  # and it is converged: the next run changes nothing
    _record_figure(tmp_path_factory, {
        "fault": "a node without a driver (driver purged, replica stopped), one deploy", "node": node.name,
        "serving_after_s": round(converged, 1), "other_replica_requests": loop.sent, "other_replica_failures": 0})


def test_a_reboot_of_the_followers_node_brings_the_pipeline_replica_back(
        lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> None:
    """lab3 (rank 1) reboots: rank 0 stops its vLLM and waits; lab3's unit starts at boot and both ranks start
    together again, without a deploy; lab1's replica answers throughout."""
    leader, follower = lab.nodes[1], lab.nodes[2]
    _wait_serving(lab, leader)
    loop = _load(lab, lab.nodes[0])
    loop.start()
    try:
        rebooted = time.monotonic()
        lab.reboot(follower)  # until it booted again: the replica cannot serve before that
        _wait_serving(lab, leader, timeout=600)
        recovered = time.monotonic() - rebooted
    finally:
        loop.stop()
    assert loop.sent > 0 and loop.failures == [], loop.failures[:3]
    _record_figure(tmp_path_factory, {
        "fault": "reboot of the follower's node", "replica": PIPELINE, "serving_again_s": round(recovered, 1),
        "other_replica_requests": loop.sent, "other_replica_failures": 0})


def test_a_wedged_engine_is_restarted_by_the_watchdog(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> None:
    """SIGSTOP of lab1's engine process: /health may still answer, completions do not; the watchdog on the
    replica's node restarts the replica after vllm_watchdog_stall_s (30 s on the lab) and says why in the
    journal; the pipeline replica answers throughout."""
    node, unit = lab.nodes[0], f"vllm@{_single(lab)}"
    host = lab.host(node)
    _wait_serving(lab, node)
    engine = host.check_output("pgrep -f 'VLLM::EngineCore'").split()
    assert len(engine) == 1, engine
    since = host.check_output("date +%s").strip()
    loop = _load(lab, lab.nodes[1])
    loop.start()
    try:
        stopped = time.monotonic()
        host.check_output(f"kill -STOP {engine[0]}")
        try:  # a figure, not a verdict: the watchdog must act whichever way /health answers
            health: int | str = _http(f"http://{node.address}:{PORT}/health", timeout=10)[0]
        except OSError as exc:
            health = f"no answer: {exc}"
        end = time.monotonic() + 300
        said = ""
        while time.monotonic() < end and not said:
            time.sleep(3)
            said = host.run(f"journalctl -q -o cat --since=@{since} -u vllm-watchdog@{_single(lab)}"
                            f" | grep 'restarting {unit}.service'").stdout.strip()
        assert said, "the watchdog did not restart the replica"
        detected = time.monotonic() - stopped
        _wait_serving(lab, node)
        recovered = time.monotonic() - stopped
    finally:
        loop.stop()
    assert host.check_output("pgrep -f 'VLLM::EngineCore'").split() != engine
    assert loop.sent > 0 and loop.failures == [], loop.failures[:3]
    _record_figure(tmp_path_factory, {
        "fault": "SIGSTOP of the engine process", "replica": _single(lab), "health_while_stopped": health,
        "watchdog_restart_after_s": round(detected, 1), "serving_again_s": round(recovered, 1),
        "watchdog_said": said.splitlines()[0][:300], "other_replica_requests": loop.sent,
        "other_replica_failures": 0})


def test_a_gpu_lost_at_run_time_stops_the_nodes_replicas_until_it_passes(
        lab: Lab, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """gpu_lost injected on lab1 while it serves: the node's GPU watch stops its replica and says why; gpufleet
    gate and deploys/check.py name the node and the rule; once the GPU is back the watch starts the replica
    again. The pipeline replica answers throughout."""
    node, unit = lab.nodes[0], f"vllm@{_single(lab)}"
    host = lab.host(node)
    _wait_serving(lab, node)
    profile = "/etc/gpufleet/nvml-sim-profile"
    host.check_output(f"cp {profile} {profile}.saved")
    faulty = tmp_path / "profile"
    write_sim_profile(faulty, node.profile, ["gpu_lost"], hostname=node.name)
    loop = _load(lab, lab.nodes[1])
    loop.start()
    try:
        injected = time.monotonic()
        host.check_output(f"cat > {profile}.lost <<'EOF'\n{faulty.read_text()}EOF\nmv {profile}.lost {profile}")
        end = time.monotonic() + 180
        while time.monotonic() < end and host.service(unit).is_running:
            time.sleep(2)
        assert not host.service(unit).is_running, f"{unit} still runs with a lost GPU"
        stopped = time.monotonic() - injected
        said = host.check_output("journalctl -q -o cat -u gpufleet-gpu-watch.service | grep 'GPU is lost' | tail -1")
        assert "nvml_errors" in said, said
        gate = _run([str(PYINFRA.parent / "gpufleet"), "gate", INVENTORY], lab.env, 300)
        assert gate.rc != 0 and f"{node.address}: FAIL" in gate.out, gate.output
        assert re.search(r"nvml_errors \(gpu \d\): .*GPU is lost", gate.out), gate.output
        check = lab.pyinfra(INVENTORY, "deploys/check.py")
        assert check.rc != 0 and f"[{node.address}] gate: fail" in check.output, check.output[-4000:]
        assert "GPU is lost" in check.output, check.output[-4000:]
        assert all(lab.host(n).service(f"vllm@{PIPELINE}").is_running for n in lab.nodes[1:])
        restored = time.monotonic()
        host.check_output(f"mv {profile}.saved {profile}")
        _wait_serving(lab, node, timeout=600)  # the watch started it again: no deploy
        back = time.monotonic() - restored
    finally:
        loop.stop()
        host.run(f"test -e {profile}.saved && mv {profile}.saved {profile}")
    assert host.run("test -e /run/gpufleet/gpu-gate-failed").rc != 0
    assert loop.sent > 0 and loop.failures == [], loop.failures[:3]
    _record_figure(tmp_path_factory, {
        "fault": "gpu_lost injected on a serving node", "node": node.name, "replica_stopped_after_s": round(stopped, 1),
        "serving_again_after_the_gpu_came_back_s": round(back, 1), "watch_said": said.strip()[:300],
        "other_replica_requests": loop.sent, "other_replica_failures": 0})


def test_a_deploy_heals_a_replica_whose_follower_systemd_gave_up_on(
        lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> None:
    """lab3's rank fails to start until systemd stops restarting it (``failed`` after its restarts) while lab2's
    waits: one deploy resets and starts it and waits until the replica serves."""
    unit, leader, follower = f"vllm@{PIPELINE}", lab.nodes[1], lab.nodes[2]
    host = lab.host(follower)
    drop_in = f"/run/systemd/system/{unit}.service.d"
    host.check_output(f"mkdir -p {drop_in} && printf '[Service]\\nExecStartPre=/bin/false\\n' > {drop_in}/fail.conf"
                      f" && systemctl daemon-reload && systemctl restart {unit} || true")
    def show(prop: str) -> str:
        return host.run(f"systemctl show -p {prop} --value {unit}").stdout.strip()

    end = time.monotonic() + 240
    while time.monotonic() < end and show("ActiveState") != "failed":
        time.sleep(3)
    assert show("ActiveState") == "failed" and int(show("NRestarts")) >= 4  # systemd gave up on it
    host.check_output(f"rm -r {drop_in} && systemctl daemon-reload")
    started = time.monotonic()
    assert_no_errors(_deploy(lab))
    _wait_serving(lab, leader, timeout=60)  # the deploy waited until the replica served
    healed = time.monotonic() - started
    assert host.service(unit).is_running
    _record_figure(tmp_path_factory, {
        "fault": "the follower's unit failed (systemd gave up restarting it), one deploy", "replica": PIPELINE,
        "serving_again_s": round(healed, 1)})


def test_a_node_lost_halfway_through_a_deploy_is_named_and_a_rerun_finishes(
        lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> None:
    """lab3 loses power while a deploy has work to do on it: the deploy goes on with the other nodes, names
    lab3 and exits non-zero; once lab3 is back, a rerun converges it and the pipeline replica serves again."""
    lost = lab.nodes[2]
    lab.host(lost).check_output("rm /etc/gpufleet/node.env")  # work for the deploy on lab3
    loop = _load(lab, lab.nodes[0])
    loop.start()
    argv = [str(PYINFRA), INVENTORY, DEPLOY, "-y"]
    off = False
    try:
        with subprocess.Popen(argv, cwd=ROOT, env=lab.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) as deploy:
            assert deploy.stdout is not None
            output = []
            for line in deploy.stdout:  # power off lab3 as the deploy starts its first change there
                output.append(line)
                if "Starting operation" in line and "node.env" in line:
                    break
            cut = time.monotonic()
            power_off(lost.name, lab.directory)
            off = True
            output.extend(deploy.stdout)
            rc = deploy.wait(timeout=600)
        reported = time.monotonic() - cut
        text = "".join(output)
        assert rc != 0, text[-6000:]
        assert f"gpufleet: [{lost.address}] lost during the deploy" in text, text[-6000:]
        assert "An internal exception occurred" not in text, text[-6000:]
        errors = {line.split("]", 1)[0].strip(" [") for line in text.splitlines() if "] Error" in line}
        assert errors <= {lost.address}, text[-6000:]  # no other node failed
        lab.power_on(lost)
        off = False
        assert_no_errors(_deploy(lab))
        assert lab.host(lost).file("/etc/gpufleet/node.env").contains(f'^GPUFLEET_NODE="{lost.name}"$')
        _wait_serving(lab, lab.nodes[1], timeout=600)
        recovered = time.monotonic() - cut
    finally:
        loop.stop()
        if off:  # the other tests need lab3
            lab.power_on(lost)
    assert loop.sent > 0 and loop.failures == [], loop.failures[:3]
    _record_figure(tmp_path_factory, {
        "fault": "a node powered off halfway through a deploy, then started and the deploy rerun",
        "node": lost.name, "deploy_ended_after_s": round(reported, 1), "serving_again_s": round(recovered, 1),
        "other_replica_requests": loop.sent, "other_replica_failures": 0})


def _lab_copy(tmp_path: Path, lab_single_extra: str) -> str:
    """The lab inventory and group_vars in a directory of their own, with lab_single.yml changed."""
    (tmp_path / "inventories").mkdir()
    shutil.copy(ROOT / INVENTORY, tmp_path / INVENTORY)
    shutil.copytree(ROOT / "group_vars", tmp_path / "group_vars")
    with (tmp_path / "group_vars" / "lab_single.yml").open("a") as handle:
        handle.write(lab_single_extra)
    return str(tmp_path / INVENTORY)


def test_changing_one_groups_setting_restarts_only_that_groups_replicas(lab: Lab, tmp_path: Path) -> None:
    pipeline = {n.name: main_pid(lab, n, f"vllm@{PIPELINE}") for n in lab.nodes[1:]}
    single = main_pid(lab, lab.nodes[0], f"vllm@{_single(lab)}")
    inventory = _lab_copy(tmp_path, "vllm_extra_args:\n  enforce-eager: true\n  max-num-seqs: 16\n")
    assert_no_errors(_deploy(lab, inventory=inventory))
    assert main_pid(lab, lab.nodes[0], f"vllm@{_single(lab)}") != single
    assert {n.name: main_pid(lab, n, f"vllm@{PIPELINE}") for n in lab.nodes[1:]} == pipeline
    config = lab.host(lab.nodes[0]).file(f"/etc/gpufleet/vllm/{_single(lab)}/config.yaml").content_string
    assert "max-num-seqs: 16" in config
    assert_no_errors(_deploy(lab))  # back to the repository's values (lab1 restarts once more)


def test_a_node_failing_the_gpu_gate_is_not_started_and_is_named(lab: Lab, tmp_path: Path) -> None:
    node, unit = lab.nodes[0], f"vllm@{_single(lab)}"
    host = lab.host(node)
    host.check_output(f"systemctl stop {unit}")
    profile = "/etc/gpufleet/nvml-sim-profile"
    host.check_output(f"cp {profile} {profile}.saved")
    try:
        faulty = tmp_path / "profile"
        write_sim_profile(faulty, node.profile, ["gpu_missing"], hostname=node.name)  # 7 GPUs left
        host.check_output(f"cat > {profile} <<'EOF'\n{faulty.read_text()}EOF")
        done = _deploy(lab)
        assert done.rc != 0
        assert re.search(rf"\[{re.escape(node.address)}\].*GPU health gate failed", done.output), done.output[-4000:]
        assert not host.service(unit).is_running
        # the unit's own gate (ExecStartPre) refuses too
        assert host.run(f"systemctl start {unit}").rc != 0
        assert not host.service(unit).is_running
        for other in lab.nodes[1:]:
            assert lab.host(other).service(f"vllm@{PIPELINE}").is_running
    finally:
        host.check_output(f"mv {profile}.saved {profile}")
        host.run(f"systemctl reset-failed {unit}")
    assert_no_errors(_deploy(lab))
    _wait_serving(lab, node)


def test_a_deploy_interrupted_halfway_converges_on_rerun(lab: Lab) -> None:
    """An install interrupted halfway leaves the working virtualenv in place and serving; the rerun finishes it."""
    node = lab.nodes[0]
    host, unit = lab.host(node), f"vllm@{_single(lab)}"
    marker = f"{LAB_VENV}/.gpufleet-installed"
    working = host.check_output(f"readlink -f {LAB_VENV}").strip()
    host.check_output(f"echo stale > {marker}")  # the next run reinstalls
    # from an empty cache: with uv's cache warm, the install is a few seconds of hardlinks, too quick to interrupt
    host.check_output("rm -rf /var/cache/gpufleet/uv")
    process = subprocess.Popen([str(PYINFRA), INVENTORY, DEPLOY, "-y"], cwd=ROOT, env=lab.env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # the new build's interpreter exists once its virtualenv is made, before any package goes in
    builds = f"/opt/vllm/.build-{LAB_VLLM_VERSION}-*"
    new_build = f"find /opt/vllm -maxdepth 3 -path '{builds}/bin/python' ! -path '{working}/*'"
    end = time.monotonic() + 600
    while time.monotonic() < end and not host.run(new_build).stdout.strip():
        time.sleep(0.5)
    time.sleep(2)  # the installer is now filling the new build, beside the one in use
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    assert host.check_output(f"readlink -f {LAB_VENV}").strip() == working  # never swapped half-built
    assert host.file(marker).content_string.strip() == "stale"
    assert host.run(f"{LAB_VENV}/bin/python -c 'import vllm'").rc == 0  # the working one is intact
    assert host.service(unit).is_running
    assert_no_errors(_deploy(lab))
    rebuilt = host.check_output(f"readlink -f {LAB_VENV}").strip()
    assert rebuilt != working
    # the replaced build stays (until the next install), the half-built one is gone
    assert sorted(host.check_output(f"ls -d {builds}").split()) == sorted([rebuilt, working])
    assert host.file(marker).content_string.strip() != "stale"
    _wait_serving(lab, node)


def test_an_interrupted_restart_is_drift_and_the_next_run_performs_it(lab: Lab) -> None:
    """A restart a deploy decided on and did not perform (its record left on the node) is drift for
    deploys/check.py, and the next deploy performs it and clears the record once the replica serves."""
    node = lab.nodes[0]
    host, replica = lab.host(node), _single(lab)
    pending = f"/etc/gpufleet/vllm/{replica}/restart-pending"
    before = main_pid(lab, node, f"vllm@{replica}")
    host.check_output(f"touch {pending}")  # what a run interrupted between deciding and restarting leaves
    checked = _run([str(PYINFRA), INVENTORY, "deploys/check.py", "-y"], lab.env, 600)
    assert checked.rc != 0
    assert f"[{node.address}] gate: pass; drift: 1 operation(s)" in checked.output, checked.output[-4000:]
    assert f"{replica}: record that it must restart" in checked.output
    assert_no_errors(_deploy(lab))
    assert main_pid(lab, node, f"vllm@{replica}") != before
    assert not host.file(pending).exists
    _wait_serving(lab, node)
    clean = _run([str(PYINFRA), INVENTORY, "deploys/check.py", "-y"], lab.env, 600)
    assert clean.rc == 0, clean.output[-4000:]


def test_ray_units_form_a_cluster_across_two_nodes(lab: Lab) -> None:
    # The CPU build refuses vLLM's Ray executor, so on the lab the Ray replica is staged, not started.
    done = _deploy(lab, "--data", "vllm_distributed_backend=ray", "--data", "vllm_start=false")
    assert_no_errors(done)
    head, worker = lab.nodes[1], lab.nodes[2]
    unit = f"gpufleet-ray-{PIPELINE}"
    assert lab.host(head).service(unit).is_running and lab.host(worker).service(unit).is_running
    status = lab.host(head).check_output(  # Ray asks for its token (tests/lab/test_access.py: refused without)
        f"set -a; . /etc/gpufleet/secrets/{PIPELINE}.ray.env; set +a; RAY_AUTH_MODE=token"
        f" {LAB_VENV}/bin/ray status --address={head.address}:6379")
    active = status.split("Active:")[1].split("Pending:")[0]
    assert active.count(" node_") == 2, status
    for node in (head, worker):
        unit_text = lab.host(node).file(f"/etc/systemd/system/{unit}.service").content_string
        assert f"--node-ip-address={node.address}" in unit_text
        env = lab.host(node).file(f"/etc/gpufleet/ray/{PIPELINE}.env").content_string
        assert 'NCCL_SOCKET_IFNAME="host0"' in env and f'RAY_ADDRESS="{head.address}:6379"' in env
    head_unit = lab.host(head).file(f"/etc/systemd/system/{unit}.service").content_string
    assert "--include-dashboard=false" in head_unit
    listening = lab.host(head).check_output("ss -ltnH")
    assert ":8265 " not in listening and ":6386 " not in listening  # no dashboard
    # vLLM is staged on the head with the Ray executor; the worker node runs no vLLM of its own
    config = yaml.safe_load(lab.host(head).file(f"/etc/gpufleet/vllm/{PIPELINE}/config.yaml").content_string)
    assert config["distributed-executor-backend"] == "ray" and "nnodes" not in config
    assert not lab.host(head).service(f"vllm@{PIPELINE}").is_running
    assert not lab.host(worker).file(f"/etc/gpufleet/vllm/{PIPELINE}").exists
