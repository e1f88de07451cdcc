"""A stand-in for the connections to the nodes (gpufleet.remote.commands's Remote): files on the nodes, read with one
``head`` per node, as on a node."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from gpufleet.remote.commands import RemoteResult, command_line


class NodeFiles:
    """Files on the nodes, by node and path; a node in ``unreachable`` cannot be connected to."""

    def __init__(self, files: dict[str, dict[str, str]], unreachable: Collection[str] = ()) -> None:
        self.files, self.unreachable = files, set(unreachable)
        self.commands: list[tuple[str, list[str]]] = []
        self.closed = False

    def run(self, host: str, words: Sequence[str], *, timeout_s: float,
            ok_status: Collection[int] = (0,)) -> RemoteResult:
        command_line(words)  # every word plain
        self.commands.append((host, list(words)))
        if host in self.unreachable:
            return RemoteResult(False, "", f"{host}: cannot connect: timed out")
        assert list(words[:3]) == ["env", "LC_ALL=C", "head"], words
        out, err = [], []
        for path in words[words.index("--") + 1:]:
            if path in self.files.get(host, {}):
                out += [f"==> {path} <==", self.files[host][path], ""]
            else:
                err.append(f"head: cannot open '{path}' for reading: No such file or directory")
        return RemoteResult((1 if err else 0) in ok_status, "\n".join(out), "\n".join(err))

    def close(self) -> None:
        self.closed = True

