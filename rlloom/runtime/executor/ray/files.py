"""The driver's files on a cluster: what a run's workers read from the driver's disk (the
model, tokenizer, prompt and preference files, chat template, and the user's reward, tool
and transform code) reaches each node that cannot see it at the same path with the same
content, through Ray's object store; the run directory, where training ranks write their
checkpoint shards, must be shared storage, and a plan that would scatter it is refused.

A node is asked, before any worker starts, which of the driver's paths it sees with the same
fingerprint (size, first and last MiB of every file): a stale copy at the same path is
shipped over like a missing one. Shipped files land in the node's temp dir, named by their
fingerprint, so the ranks of one node unpack them once."""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlloom.config import RunConfig

CHUNK = 1 << 20
CHECK_FILE = ".rlloom-node-check"  # the driver's token in the run directory
# (section, field, kind): every config field naming something a worker reads from disk
INPUTS = [("model", "path", "path"), ("model", "critic_path", "path"),
          ("data", "prompt_file", "path"), ("data", "preference_file", "path"),
          ("data", "eval_file", "path"), ("data", "chat_template", "path"),
          ("data", "transform", "spec"), ("rollout", "tools", "specs"),
          ("reward", "functions", "specs"), ("reward", "model_path", "path")]


def _files(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def fingerprint(path: Path) -> str:
    """Names and sizes of the files at `path` and the first and last MiB of each: cheap on
    a model's shards, and different for a different or half-copied checkpoint."""
    h = hashlib.sha256()
    for f in _files(path):
        size = f.stat().st_size
        h.update(f"{f.relative_to(path) if f != path else f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(CHUNK))
            if size > CHUNK:
                fh.seek(max(CHUNK, size - CHUNK))
                h.update(fh.read())
    return h.hexdigest()[:20]


def _where(value: str, kind: str) -> str:
    return value.rpartition(":")[0] if kind != "path" else value


def input_paths(cfg: RunConfig, model_path: Path) -> list[str]:
    """The driver's paths the run's workers read: the model and every input the config names
    that is a file or directory here (module paths and built-in names are not)."""
    found = [str(model_path)]
    for section, field, kind in INPUTS:
        value = getattr(getattr(cfg, section), field)
        for v in (value or []) if kind == "specs" else [value]:
            where = _where(v, kind) if v else ""
            if where.startswith("/") and Path(where).exists() and where not in found:
                found.append(where)
    return found


def _same(path: Path, fp: str) -> bool:
    """Whether `path` here holds what the driver's does (unreadable counts as not)."""
    try:
        return path.exists() and fingerprint(path) == fp
    except OSError:
        return False


def probe(wanted: dict[str, str], run_dir: str, token: str) -> dict[str, Any]:
    """On a node: which of `wanted` (path -> fingerprint) it lacks, and whether it sees the
    run directory (the driver's token in it)."""
    import ray
    check = Path(run_dir) / CHECK_FILE
    missing = [p for p, fp in wanted.items() if not _same(Path(p), fp)]
    try:
        shared = check.read_text() == token
    except OSError:
        shared = False
    return {"node": ray.util.get_node_ip_address(), "missing": missing, "run_dir": shared}


def pack(path: Path) -> dict[str, bytes]:
    """The files at `path` by relative name ("" for a single file)."""
    if path.is_file():
        return {"": path.read_bytes()}
    return {str(f.relative_to(path)): f.read_bytes() for f in _files(path)}


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in _files(path))


def unpack(driver_path: str, fp: str, ref: Any) -> str:
    """Where the shipped copy of `driver_path` lies on this node, written once per node
    (whole or not at all: a rename of a finished directory)."""
    import ray
    home = Path(tempfile.gettempdir()) / "rlloom-files" / fp
    dest = home / Path(driver_path).name
    if not dest.exists():
        home.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=home, prefix=".part-"))
        files = ray.get(ref)
        for rel, data in files.items():
            out = tmp / "x" / rel if rel else tmp / "x"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)
        try:
            os.rename(tmp / "x", dest)
        except OSError:  # another rank of this node was first
            pass
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dest)


def localise(cfg: RunConfig, model_path: str, shipped: dict[str, tuple[str, Any]]
             ) -> tuple[RunConfig, str]:
    """`cfg` and the model path with each shipped driver path replaced by its copy here."""
    here = {p: unpack(p, fp, ref) for p, (fp, ref) in shipped.items()}

    def swap(v: str | None, kind: str) -> str | None:
        if not v:
            return v
        where = _where(v, kind)
        return v.replace(where, here[where], 1) if where in here else v
    sections: dict[str, dict[str, Any]] = {}
    for section, field, kind in INPUTS:
        value = getattr(getattr(cfg, section), field)
        new = ([swap(v, "spec") for v in value] if kind == "specs" else swap(value, kind))
        if new != value:
            sections.setdefault(section, {})[field] = new
    cfg = cfg.model_copy(update={s: getattr(cfg, s).model_copy(update=u)
                                 for s, u in sections.items()})
    return cfg, here.get(model_path, model_path)


def ship(cfg: RunConfig, model_path: Path, run_dir: Path, ranks: dict[str, list[str]],
         shard_writers: set[str]) -> dict[str, dict[str, tuple[str, Any]]]:
    """Node id -> the driver paths it lacks, each as (fingerprint, object ref of its
    files), for the nodes other than the driver's that `ranks` (group -> node id per rank)
    uses; refuses a run directory that a rank of a group in `shard_writers` cannot see."""
    import uuid

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rlloom.config import ConfigError
    driver = ray.get_runtime_context().get_node_id()
    nodes = sorted({n for ids in ranks.values() for n in ids} - {driver})
    if not nodes:
        return {}
    wanted = {p: fingerprint(Path(p)) for p in input_paths(cfg, model_path)}
    token = uuid.uuid4().hex
    check = run_dir / CHECK_FILE
    check.write_text(token)
    try:
        remote = ray.remote(probe)
        reports = dict(zip(nodes, ray.get([remote.options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False),
        ).remote(wanted, str(run_dir), token) for n in nodes])))
    finally:
        check.unlink(missing_ok=True)
    for group in sorted(shard_writers):
        for rank, node in enumerate(ranks[group]):
            if node in reports and not reports[node]["run_dir"]:
                raise ConfigError(
                    f"the run directory {run_dir} is not visible on node "
                    f"{reports[node]['node']}, where rank {rank} of group {group!r} writes and "
                    "reads its checkpoint shards: on a cluster, put run_dir on storage every "
                    "node mounts at the same path (NFS, a mounted bucket, ...), e.g. "
                    "run_dir=/shared/runs/NAME; see docs/cluster.md")
    room = min(n["Resources"].get("object_store_memory", 0) for n in ray.nodes()
               if n["NodeID"] in nodes or n["NodeID"] == driver)
    refs: dict[str, tuple[str, Any]] = {}
    out: dict[str, dict[str, tuple[str, Any]]] = {}
    for node, report in reports.items():
        for p in report["missing"]:
            if p not in refs:
                nbytes = size(Path(p))
                if nbytes > room / 2:
                    raise ConfigError(
                        f"{p} ({nbytes / 2**30:.1f} GiB) is not on node {report['node']} and "
                        f"is too large to ship through Ray's object store ({room / 2**30:.1f} "
                        "GiB): put it on storage every node mounts at the same path")
                refs[p] = (wanted[p], ray.put(pack(Path(p))))
            out.setdefault(node, {})[p] = refs[p]
        if report["missing"]:
            print(f"node {report['node']} lacks {len(report['missing'])} of the driver's "
                  f"inputs; shipped through the object store: {', '.join(report['missing'])}")
    return out
