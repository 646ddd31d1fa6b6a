"""Doctor's version checks (issue 39): driver, CUDA, RDMA stack, GPU VBIOS and HCA firmware that
differ across nodes that run the same jobs.

A collective that works on 7 nodes and hangs on the 8th is, as often as not, the 8th node on
another driver, another MLNX_OFED or another HCA firmware: NCCL's own docs ask for the same
versions on every rank. The nodes compared are the ready ones with the same GPU model (the pool
placement draws a model's replicas from: a multi-node replica never mixes GPU models), HCA
firmware per HCA type within that. The version most nodes run is the pool's; a node on another
is WARN, named, with the versions seen. With no majority (one node each on two versions) there
is no telling which is odd, and the pool gets one WARN naming both. A node whose agent does not
report a version (older than issue 39) is left out of that comparison and named in the ok line.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from llmgw.doctor.facts import CLUSTER, ClusterFacts, Finding, NodeFacts
from llmgw.verdict import Status

Getter = Callable[[NodeFacts], str]

DRIVER_ACTION = ("drain {node}, then install the pool's {what} ({version}) there and reboot; every rank of a "
                 "job needs the same (`nvidia-smi`, `ofed_info -s` or `uname -r` on both to compare)")
FIRMWARE_ACTION = ("drain {node}, then flash the pool's {what} ({version}) (HCAs: `mlxfwmanager --query`, then "
                   "`mlxfwmanager -u`; GPUs: NVIDIA's firmware update package for the board) and reboot")


def _pool(n: NodeFacts) -> str:
    names = sorted({g.name for g in n.inventory.gpus if g.name})
    return ", ".join(names) if names else "no GPUs"


def _vbios(n: NodeFacts) -> str:
    return ", ".join(sorted({g.vbios for g in n.inventory.gpus if g.vbios}))


def _hca_fw(hca_type: str) -> Getter:
    def get(n: NodeFacts) -> str:
        return ", ".join(sorted({p.fw_ver for p in n.inventory.ports if p.hca_type == hca_type and p.fw_ver}))
    return get


def _has_hca(hca_type: str) -> Callable[[NodeFacts], bool]:
    return lambda n: any(p.hca_type == hca_type for p in n.inventory.ports)


def _pools(facts: ClusterFacts) -> dict[str, list[NodeFacts]]:
    out: dict[str, list[NodeFacts]] = {}
    for n in sorted(facts.nodes, key=lambda n: n.id):
        if n.connected and n.state == "ready":
            out.setdefault(_pool(n), []).append(n)
    return out


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
        return [Finding(node=CLUSTER, check=check, status=Status.WARN, subject=pool,
                        finding=f"{what} differs across the {len(versions)} nodes with {pool}, no majority: {spread}",
                        action=f"bring them to one {what}: drain the nodes on the older one, upgrade, reboot")], "", silent
    top = counts[0][0]
    odd = [Finding(node=CLUSTER, check=check, status=Status.WARN, subject=node,
                   finding=f"{node} runs {what} {version}; the other {counts[0][1]} nodes with {pool} run {top} "
                           f"(seen: {listed})",
                   action=action.format(node=node, what=what, version=top))
           for node, version in sorted(versions.items()) if version != top]
    return odd, top, silent


def _grade(check: str, facts: ClusterFacts,
           parts: Callable[[list[NodeFacts]], list[tuple[str, Getter, str, Callable[[NodeFacts], bool]]]]) -> list[Finding]:
    pools = _pools(facts)
    out: list[Finding] = []
    same: list[str] = []
    silent: dict[str, set[str]] = {}
    compared = 0
    for pool, nodes in pools.items():
        if len(nodes) < 2:
            continue
        compared += 1
        agreed = []
        for what, get, action, applies in parts(nodes):
            odd, top, quiet = _compare(check, pool, nodes, what, get, action, applies)
            out.extend(odd)
            if quiet:
                silent.setdefault(what, set()).update(quiet)
            if top and not odd:
                agreed.append(f"{what} {top}")
        if agreed:
            same.append(f"{len(nodes)} nodes with {pool}: {', '.join(agreed)}")
    if out:
        return out
    if not compared:
        return [Finding(node=CLUSTER, check=check, status=Status.OK,
                        finding="no two ready nodes with the same GPU model: nothing to compare")]
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
        return [("GPU VBIOS", _vbios, FIRMWARE_ACTION, _has_gpus), *hcas]
    return _grade("firmware-versions", facts, parts)
