"""A Ray cluster of several "machines" on this one: each node is a network namespace with its
own IP on a virtual bridge and its own mount namespace, started with `ray start` as a user
would. What every node mounts alike is `shared` (at /mnt, the cluster's shared storage); what
the driver keeps to itself (`private`: its model cache, its other files) is hidden from the
other nodes by an empty tmpfs, and each node has its own temp dir and /dev/shm. The head runs
no workers (`--num-cpus 0`), as on a login node: the driver runs there.

Run as a script it brings up a head and NODES worker nodes of 2 CPUs, runs a command on the
head as the driver (HEAD in it stands for the cluster's address), and takes it all down:
    python tests/cluster/netns.py 2 rlloom train ... run_dir=/mnt/r1 --ray-address HEAD
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARED_AT = "/mnt"  # where every node sees the shared storage


class NamespaceError(RuntimeError):
    """This machine cannot make namespaces (not root, no `ip`, or a sandbox forbids it)."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise NamespaceError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


def _free_subnet() -> int:
    """A 10.231.K.0/24 no interface here uses."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    for k in [(os.getpid() + i) % 250 + 1 for i in range(250)]:
        if f"10.231.{k}." not in used:
            return k
    raise NamespaceError("no free 10.231.K.0/24 subnet")


class NamespaceCluster:
    """`nodes` worker nodes of `cpus` CPUs each and a head, in namespaces named rl<tag>-*."""

    def __init__(self, root: Path, private: Path, nodes: int = 2, cpus: int = 2,
                 env: dict[str, str] | None = None) -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
            raise NamespaceError("needs root, `ip` (iproute2) and `unshare` (util-linux)")
        self.root, self.private, self.cpus = root, private, cpus
        self.shared = root / "shared"
        self.shared.mkdir(parents=True, exist_ok=True)
        self.tag = f"{os.getpid() % 100000}"
        self.subnet = _free_subnet()
        self.bridge = f"rlb{self.tag}"
        self.names = ["head"] + [f"node{i}" for i in range(1, nodes + 1)]
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", **(env or {})}
        self.procs: dict[str, subprocess.Popen] = {}
        self._made: list[str] = []

    # -- addresses ---------------------------------------------------------------------------
    def ip(self, node: str) -> str:
        return f"10.231.{self.subnet}.{2 + self.names.index(node)}"

    @property
    def address(self) -> str:
        return f"{self.ip('head')}:6379"

    def netns(self, node: str) -> str:
        return f"rl{self.tag}-{node}"

    def temp(self, node: str) -> Path:
        """The node's own temp dir (Ray's files, TMPDIR): short, for Ray's socket paths."""
        return Path(f"/tmp/rl{self.tag}-{node}")

    # -- life --------------------------------------------------------------------------------
    def up(self, timeout_s: float = 60) -> NamespaceCluster:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append("bridge")
            _ip("addr", "add", f"10.231.{self.subnet}.1/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for node in self.names:
                ns, veth = self.netns(node), f"v{self.tag}{node[-1]}"
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{self.ip(node)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            for node in self.names:
                self.start(node)
                if node == "head":
                    self._wait_for_nodes(1, timeout_s)
            self._wait_for_nodes(len(self.names), timeout_s)
        except BaseException:
            self.down()
            raise
        return self

    def start(self, node: str) -> None:
        """`ray start` on `node` (again, after `kill`), blocking in the background."""
        head = node == "head"
        temp = self.temp(node)
        shutil.rmtree(temp, ignore_errors=True)
        (temp / "tmp").mkdir(parents=True)
        argv = ["ray", "start", "--block", "--disable-usage-stats",
                f"--node-ip-address={self.ip(node)}", f"--temp-dir={temp}",
                f"--num-cpus={0 if head else self.cpus}"]
        argv += (["--head", "--port=6379", "--include-dashboard=false"] if head
                 else [f"--address={self.address}"])
        log = open(self.root / f"{node}.log", "ab")
        self.procs[node] = self.popen(node, argv, stdout=log, stderr=subprocess.STDOUT)

    def popen(self, node: str, argv: list[str], env: dict[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """`argv` on `node`: in its network namespace, and in a mount namespace of its own
        where /mnt is the shared storage, /dev/shm is its own, and (on a worker node) the
        driver's private files are hidden."""
        hide = "" if node == "head" else f" && mount -t tmpfs tmpfs {self.private}"
        setup = (f"mount --bind {self.shared} {SHARED_AT} && mount -t tmpfs tmpfs /dev/shm"
                 f"{hide} && exec \"$@\"")
        bin_dir = str(Path(sys.executable).parent)
        full = {**self.env, **(env or {}), "TMPDIR": str(self.temp(node) / "tmp"),
                "PATH": f"{bin_dir}:{self.env.get('PATH', '')}"}
        return subprocess.Popen(
            ["ip", "netns", "exec", self.netns(node), "unshare", "--mount",
             "--propagation", "private", "--", "sh", "-c", setup, "sh", *argv],
            env=full, start_new_session=True, **kwargs)

    def run(self, node: str, argv: list[str], timeout_s: float,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        proc = self.popen(node, argv, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            out += f"\n[killed after {timeout_s:g}s]"
        return subprocess.CompletedProcess(argv, proc.returncode, out)

    def pids(self, node: str) -> list[int]:
        done = subprocess.run(["ip", "netns", "pids", self.netns(node)], capture_output=True,
                              text=True)
        return [int(p) for p in done.stdout.split()]

    def kill(self, node: str) -> None:
        """Every process of `node` at once (SIGKILL): the machine is lost."""
        for pid in self.pids(node):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc = self.procs.pop(node, None)
        if proc is not None:
            proc.wait()

    def down(self) -> None:
        for node in self.names:
            if self.netns(node) in self._made:
                self.kill(node)
        for name in reversed(self._made):
            if name == "bridge":
                subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            else:
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made.clear()
        for node in self.names:
            shutil.rmtree(self.temp(node), ignore_errors=True)

    def _wait_for_nodes(self, count: int, timeout_s: float) -> None:
        """Until `count` nodes are alive in the cluster (asked from the head)."""
        probe = ["python", "-c", "import ray; ray.init(address='auto', log_to_driver=False); "
                 "print(sum(n['Alive'] for n in ray.nodes()))"]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done = self.run("head", probe, timeout_s=30,
                            env={"RAY_ADDRESS": self.address})
            lines = done.stdout.strip().splitlines()
            if done.returncode == 0 and lines and lines[-1].isdigit() and int(lines[-1]) >= count:
                return
            time.sleep(1)
        logs = "\n".join((self.root / f"{n}.log").read_text()[-800:] for n in self.names
                         if (self.root / f"{n}.log").exists())
        raise NamespaceError(f"{count} Ray nodes did not come up within {timeout_s:g}s:\n{logs}")


if __name__ == "__main__":
    root = Path(tempfile.mkdtemp(prefix="rlns-"))
    (root / "private").mkdir()
    nodes, command = int(sys.argv[1]), sys.argv[2:]
    cluster = NamespaceCluster(root, root / "private", nodes=nodes).up()
    print(f"Ray cluster at {cluster.address}: "
          + ", ".join(f"{n} {cluster.ip(n)}" for n in cluster.names)
          + f"; shared storage at {SHARED_AT}; the driver's cache {root / 'private' / 'cache'} "
          "is on the head only", flush=True)
    try:
        if command:  # run on the head, as the driver; HEAD in it stands for the address
            argv = [a.replace("HEAD", cluster.address) for a in command]
            proc = cluster.popen("head", argv, env={
                "RLLOOM_CACHE": str(root / "private" / "cache")})
            sys.exit(proc.wait())
        input("Enter takes it down.")
    finally:
        cluster.down()
        shutil.rmtree(root, ignore_errors=True)
