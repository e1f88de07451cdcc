"""Environment variables ``vllm_env`` may not set, and why: each loads code into vLLM's and Ray's processes,
changes how they connect or whom they trust, or opens endpoints of vLLM's API that gpufleet keeps shut.

The names come from the documentation of the dynamic loader (``ld.so(8)``), Python (``python(1)``: the variables
that add to the import path, run a file or import a module at start), CUDA (the injection library that CUPTI
tools use), NCCL (its plugin variables and ``NCCL_NET``), glibc and OpenSSL's trust store variables, the proxy
variables that ``requests``/``huggingface_hub`` honour, torch.distributed's rendezvous, and vLLM's ``envs.py``.
"""

from __future__ import annotations

import re

LOADS_CODE = re.compile(
    r"^(LD_\w+|PATH|BASH_ENV|ENV"
    r"|PYTHONPATH|PYTHONHOME|PYTHONSTARTUP|PYTHONUSERBASE|PYTHONINSPECT|PYTHONWARNINGS|PYTHONBREAKPOINT"
    r"|PYTHONEXECUTABLE|PYTHONPLATLIBDIR"
    r"|CUDA_INJECTION(32|64)_PATH"
    r"|NCCL_(NET|TUNER|PROFILER|ENV)_PLUGIN"
    r"|VLLM_PLUGINS|VLLM_ALLOW_INSECURE_SERIALIZATION|VLLM_LOGGING_CONFIG_PATH)$"
)
"""Load other code than the unit names: a library, a start-up file, a module named in the value (a warning filter's
category and ``PYTHONBREAKPOINT`` are imported), a plugin, a pickled object, or a logging configuration whose
handlers are classes."""

CHANGES_TRANSPORT = re.compile(
    r"^(NCCL_NET|NCCL_SOCKET_FAMILY|NCCL_COMM_ID|NCCL_HOSTID"
    r"|MASTER_ADDR|MASTER_PORT|VLLM_DP_MASTER_IP|VLLM_DP_MASTER_PORT|VLLM_RPC_BASE_PATH"
    r"|RAY_AUTH_MODE|RAY_NODE_IP_ADDRESS|RAY_TLS_\w+|RAY_USE_TLS"
    r"|HF_ENDPOINT|VLLM_USE_MODELSCOPE"
    r"|(HTTP|HTTPS|ALL|NO|FTP)_PROXY|(http|https|all|no|ftp)_proxy"
    r"|SSL_CERT_FILE|SSL_CERT_DIR|REQUESTS_CA_BUNDLE|CURL_CA_BUNDLE|GRPC_DEFAULT_SSL_ROOTS_FILE_PATH)$"
)
"""Change which network, peer, hub or proxy the processes talk to, or which certificates they trust (gpufleet sets the
interface, the rendezvous, Ray's token and its filters itself)."""

OPENS_API = re.compile(
    r"^(VLLM_SERVER_DEV_MODE|VLLM_ALLOW_RUNTIME_LORA_UPDATING|VLLM_TORCH_PROFILER_DIR|VLLM_TORCH_CUDA_PROFILE)$"
)
"""Open endpoints of vLLM's API beyond serving (``/reset_prefix_cache``, ``/sleep``, ``/collective_rpc``, loading
adapters from a path, ``/start_profile``)."""


def refusal(name: str) -> str | None:
    """Why ``vllm_env`` may not set ``name`` (``expected …, found …``); None when it may."""
    if LOADS_CODE.match(name):
        return (f"expected a variable that does not choose which code runs, found {name}"
                " (the unit names its programs and libraries itself)")
    if CHANGES_TRANSPORT.match(name):
        return (f"expected a variable that does not change how the processes connect or whom they trust, found"
                f" {name} (gpufleet sets the network, the rendezvous and Ray's token itself)")
    if OPENS_API.match(name):
        return (f"expected a variable that does not open more of vLLM's API, found {name}"
                " (development and profiling endpoints stay shut on a fleet)")
    return None
