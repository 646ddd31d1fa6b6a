"""Doctor's version checks (issue 39): driver, CUDA, RDMA stack, GPU VBIOS and HCA firmware that
differ across nodes that run the same jobs.

A collective that works on 7 nodes and hangs on the 8th is, as often as not, the 8th node on
another driver, another MLNX_OFED or another HCA firmware: NCCL's own docs ask for the same
versions on every rank. The nodes compared are the ready ones of one model's placement pool:
those any of its profiles could be placed on (enough GPUs of its gpu_kind with its
gpu_memory_mib, the static half of placement/single.py's rule; the free and healthy GPUs come
and go), cut by GPU model. Models with the same pool are compared once, named together. Nodes
no model can use, and every node when the catalog has no models, are compared by GPU model.
HCA firmware per HCA type within that, VBIOS per GPU
model. The version most nodes run is the pool's; a node on another is WARN, named, with the pool
and the versions seen. With no majority (one node each on two versions) there is no telling
which is odd, and the pool gets one WARN naming both. A node whose agent does not report a
version (older than issue 39) is left out of that comparison and named in the ok line.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from llmgw.doctor.facts import CLUSTER, ClusterFacts, Finding, NodeFacts, ProfileNeeds
from llmgw.verdict import Status

Getter = Callable[[NodeFacts], str]

DRIVER_ACTION = ("drain {node}, then install the pool's {what} ({version}) there and reboot; every rank of a "
                 "job needs the same (`nvidia-smi`, `ofed_info -s` or `uname -r` on both to compare)")
FIRMWARE_ACTION = ("drain {node}, then flash the pool's {what} ({version}) (HCAs: `mlxfwmanager --query`, then "
                   "`mlxfwmanager -u`; GPUs: NVIDIA's firmware update package for the board) and reboot")


def _pool(n: NodeFacts) -> str:
    names = sorted({g.name for g in n.inventory.gpus if g.name})
    return ", ".join(names) if names else "no GPUs"


def _vbios(gpu: str) -> Getter:
    """The VBIOS of the node's GPUs named `gpu` (each board model has its own: an H100's and an
    H200's are never the same, so a pool that holds both compares each model's apart)."""
    def get(n: NodeFacts) -> str:
        return ", ".join(sorted({g.vbios for g in n.inventory.gpus if g.vbios and g.name == gpu}))
    return get


def _has_gpu(gpu: str) -> Callable[[NodeFacts], bool]:
    return lambda n: any(g.name == gpu for g in n.inventory.gpus)


def _hca_fw(hca_type: str) -> Getter:
    def get(n: NodeFacts) -> str:
        return ", ".join(sorted({p.fw_ver for p in n.inventory.ports if p.hca_type == hca_type and p.fw_ver}))
    return get


def _has_hca(hca_type: str) -> Callable[[NodeFacts], bool]:
    return lambda n: any(p.hca_type == hca_type for p in n.inventory.ports)


def _suits(n: NodeFacts, need: ProfileNeeds) -> bool:
    """The node has the GPUs the profile asks for (placement/single.py: gpu_kind a case-blind
    substring of the GPU's name, gpu_memory_mib a floor), whatever is running there now."""
    kind = need.gpu_kind.lower()
    fit = [g for g in n.inventory.gpus if (not kind or kind in g.name.lower()) and g.memory_mib >= need.gpu_memory_mib]
    return need.gpus > 0 and len(fit) >= need.gpus


def _pools(facts: ClusterFacts) -> dict[str, list[NodeFacts]]:
    """Pool label (what follows "nodes" in a finding) → its ready nodes. A model's pool is cut by
    GPU model too: each board model has its own VBIOS and its own oldest supported driver (an
    H200 node may need a newer one than the H100s run), so a pool that mixed them would call a
    whole board model odd rather than the one node that is."""
    ready = [n for n in sorted(facts.nodes, key=lambda n: n.id) if n.connected and n.state == "ready"]
    by_members: dict[tuple[str, ...], tuple[list[str], str]] = {}
    for model in sorted(facts.models, key=lambda mf: mf.name):
        split: dict[str, list[str]] = {}
        for n in ready:
            if any(_suits(n, need) for need in model.profiles):
                split.setdefault(_pool(n), []).append(n.id)
        for gpu, ids in split.items():
            named, _ = by_members.setdefault(tuple(ids), ([], f" ({gpu})" if len(split) > 1 else ""))
            named.append(model.name)
    out: dict[str, list[NodeFacts]] = {}
    pooled: set[str] = set()
    by_id = {n.id: n for n in ready}
    for members, (models, gpu) in by_members.items():
        out[f"in the placement pool of {', '.join(models)}{gpu}"] = [by_id[i] for i in members]
        pooled.update(members)
    for n in ready:
        if n.id not in pooled:
            out.setdefault(f"with {_pool(n)}", []).append(n)
    return out


def _subject(label: str) -> str:
    return label.removeprefix("with ").removeprefix("in the placement pool of ")


def _compare(check: str, pool: str, nodes: list[NodeFacts], what: str, get: Getter, action: str,
             applies: Callable[[NodeFacts], bool]) -> tuple[list[Finding], str, list[str]]:
    """(findings for the odd nodes, the pool's version or "", the nodes that do not say)."""
    mine = [n for n in nodes if applies(n)]
    seen = {n.id: get(n) for n in mine}
    silent = [node for node, version in seen.items() if not version]
    versions = {node: version for node, version in seen.items() if version}
    if len(versions) < 2:
        return [], next(iter(versions.values()), ""), silent
    counts = Counter(versions.values()).most_common()
    listed = ", ".join(f"{version} ×{count}" for version, count in counts)
    if len(counts) == 1:
        return [], counts[0][0], silent
    if counts[0][1] == counts[1][1]:
        spread = "; ".join(f"{version} on {', '.join(sorted(k for k, v in versions.items() if v == version))}"
                           for version, _ in counts)
        return [Finding(node=CLUSTER, check=check, status=Status.WARN, subject=_subject(pool),
                        finding=f"{what} differs across the {len(versions)} nodes {pool}, no majority: {spread}",
                        action=f"bring them to one {what}: drain the nodes on the older one, upgrade, "
                               "reboot")], "", silent
    top = counts[0][0]
    odd = [Finding(node=CLUSTER, check=check, status=Status.WARN, subject=node,
                   finding=f"{node} runs {what} {version}; the other {counts[0][1]} nodes {pool} run {top} "
                           f"(seen: {listed})",
                   action=action.format(node=node, what=what, version=top))
           for node, version in sorted(versions.items()) if version != top]
    return odd, top, silent


def _grade(check: str, facts: ClusterFacts,
           parts: Callable[[list[NodeFacts]], list[tuple[str, Getter, str, Callable[[NodeFacts], bool]]]]
           ) -> list[Finding]:
    pools = _pools(facts)
    out: list[Finding] = []
    same: list[str] = []
    silent: dict[str, set[str]] = {}
    named: set[tuple[str, str]] = set()
    compared = 0
    for pool, nodes in pools.items():
        if len(nodes) < 2:
            continue
        compared += 1
        agreed = []
        for what, get, action, applies in parts(nodes):
            odd, top, quiet = _compare(check, pool, nodes, what, get, action, applies)
            for finding in odd:  # a node odd in two models' overlapping pools is named once
                if (finding.subject, what) not in named:
                    named.add((finding.subject, what))
                    out.append(finding)
            if quiet:
                silent.setdefault(what, set()).update(quiet)
            if top and not odd:
                agreed.append(f"{what} {top}")
        if agreed:
            same.append(f"{len(nodes)} nodes {pool}: {', '.join(agreed)}")
    if out:
        return out
    if not compared:
        return [Finding(node=CLUSTER, check=check, status=Status.OK,
                        finding="no two ready nodes in one placement pool or with the same GPU model: "
                                "nothing to compare")]
    note = "".join(f"; {what} not reported by {', '.join(sorted(nodes))}" for what, nodes in silent.items())
    note += " (agents older than this server?)" if silent else ""
    return [Finding(node=CLUSTER, check=check, status=Status.OK,
                    finding=("the same on " + "; ".join(same) if same else "no versions reported") + note)]


def _has_gpus(n: NodeFacts) -> bool:
    return bool(n.inventory.gpus)


def _has_ports(n: NodeFacts) -> bool:
    return bool(n.inventory.ports)


def check_driver_versions(facts: ClusterFacts) -> list[Finding]:
    return _grade("driver-versions", facts, lambda nodes: [
        ("NVIDIA driver", lambda n: n.inventory.gpu_driver, DRIVER_ACTION, _has_gpus),
        ("CUDA driver", lambda n: n.inventory.cuda_driver, DRIVER_ACTION, _has_gpus),
        ("RDMA stack", lambda n: n.inventory.rdma_stack, DRIVER_ACTION, _has_ports),
    ])


def check_firmware_versions(facts: ClusterFacts) -> list[Finding]:
    def parts(nodes: list[NodeFacts]) -> list[tuple[str, Getter, str, Callable[[NodeFacts], bool]]]:
        kinds = sorted({p.hca_type for n in nodes for p in n.inventory.ports if p.hca_type})
        hcas: list[tuple[str, Getter, str, Callable[[NodeFacts], bool]]] = [
            (f"{kind} firmware", _hca_fw(kind), FIRMWARE_ACTION, _has_hca(kind)) for kind in kinds]
        models = sorted({g.name for n in nodes for g in n.inventory.gpus})
        boards: list[tuple[str, Getter, str, Callable[[NodeFacts], bool]]] = [
            ("GPU VBIOS" if len(models) == 1 else f"{gpu} VBIOS", _vbios(gpu), FIRMWARE_ACTION, _has_gpu(gpu))
            for gpu in models]
        return [*boards, *hcas]
    return _grade("firmware-versions", facts, parts)
