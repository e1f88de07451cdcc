"""The lab nodes' kernel log (a LAB DOUBLE): a file the node watch reads in place of ``/dev/kmsg``, since no container
has a kernel log of its own (``node_kernel_log`` in inventories/lab/group_vars/lab.yml). The lab writes into it the
lines NVIDIA's driver writes when a GPU reports an Xid."""

from __future__ import annotations

import shlex

KERNEL_LOG = "/var/log/gpufleet-lab/kmsg"


def xid_line(pci_bus_id: str, code: int, text: str, pid: int = 4242, process: str = "python3") -> str:
    """An Xid line as the driver writes it: ``NVRM: Xid (PCI:0000:3b:00): 79, pid=..., name=..., text``, from the
    GPU's NVML bus id (``00000000:3B:00.0``)."""
    domain, bus, device = pci_bus_id.lower().split(".")[0].split(":")
    return f"NVRM: Xid (PCI:{domain[-4:]}:{bus}:{device}): {code}, pid={pid}, name={process}, {text}"


def append_command(line: str, path: str = KERNEL_LOG) -> str:
    """The shell command that appends ``line`` to a node's kernel log, as the kernel appends a record."""
    folder = path.rsplit("/", 1)[0]
    return f"mkdir -p {shlex.quote(folder)} && printf '%s\\n' {shlex.quote(line)} >> {shlex.quote(path)}"
