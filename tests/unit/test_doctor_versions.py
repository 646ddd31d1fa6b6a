"""Doctor's version checks and the hw_counters half of the counters check (issue 39), on facts
shaped like what real nodes report (the real hw_counters listings in tests/fixtures/real/sysfs)."""

from __future__ import annotations

import re

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.doctor.cluster import CLUSTER_CHECKS
from llmgw.doctor.facts import CLUSTER, ClusterFacts, Finding, ModelFacts, NodeFacts, ProfileNeeds
from llmgw.fabric import sysfs
from llmgw.verdict import Status
from llmgw.wire import messages as m
from tests.realfixtures import REAL
from tests.unit.test_doctor_checks import grade, healthy

OK, WARN, CRIT = Status.OK, Status.WARN, Status.CRIT


def node(node_id: str, driver: str = "550.54.15", cuda: str = "12.4", vbios: str = "96.00.74.00.0D",
         fw: str = "28.39.1002", stack: str = "MLNX_OFED 24.10-1.1.4", gpu: str = "NVIDIA H100 80GB HBM3") -> NodeFacts:
    n = healthy(node_id)
    inv = n.inventory
    gpus = [msgspec.structs.replace(g, name=gpu, vbios=vbios) for g in inv.gpus]
    ports = [msgspec.structs.replace(p, hca_type="MT4129", fw_ver=fw) for p in inv.ports]
    n.inventory = msgspec.structs.replace(inv, gpus=gpus, ports=ports, gpu_driver=driver, cuda_driver=cuda,
                                          rdma_stack=stack)
    return n


def run(check: str, *nodes: NodeFacts) -> list[tuple[Status, str, str]]:
    return [(f.status, f.subject, f.finding) for f in CLUSTER_CHECKS[check](ClusterFacts(nodes=list(nodes)))]


def test_the_same_versions_everywhere_is_one_ok_line() -> None:
    [(status, _, text)] = run("driver-versions", node("a"), node("b"), node("c"))
    assert status == OK and "3 nodes with NVIDIA H100 80GB HBM3" in text and "NVIDIA driver 550.54.15" in text
    assert "RDMA stack MLNX_OFED 24.10-1.1.4" in text
    [(status, _, text)] = run("firmware-versions", node("a"), node("b"))
    assert status == OK and "GPU VBIOS 96.00.74.00.0D" in text and "MT4129 firmware 28.39.1002" in text


def test_the_one_node_on_another_driver_is_named_with_the_versions_seen() -> None:
    found = run("driver-versions", node("a"), node("b"), node("c", driver="550.90.07"), node("d"))
    assert [(s, subject) for s, subject, _ in found] == [(WARN, "c")]
    text = found[0][2]
    assert "c runs NVIDIA driver 550.90.07; the other 3 nodes" in text and "550.54.15 ×3, 550.90.07 ×1" in text
    cuda = run("driver-versions", node("a"), node("b", cuda="12.2"), node("c"))
    assert [(s, subject) for s, subject, _ in cuda] == [(WARN, "b")] and "CUDA driver 12.2" in cuda[0][2]
    stack = run("driver-versions", node("a"), node("b"), node("c", stack="in-box, kernel 6.8.0-45-generic"))
    assert [(s, subject) for s, subject, _ in stack] == [(WARN, "c")]


def test_firmware_odd_nodes_vbios_and_hca() -> None:
    found = run("firmware-versions", node("a", fw="28.36.1010"), node("b"), node("c"),
                node("d", vbios="96.00.99.00.01"))
    assert sorted((s, subject) for s, subject, _ in found) == [(WARN, "a"), (WARN, "d")]
    assert any("MT4129 firmware 28.36.1010" in text for _, _, text in found)


def test_no_majority_is_one_warning_for_the_pool() -> None:
    [(status, subject, text)] = run("driver-versions", node("a"), node("b", driver="550.90.07"))
    assert status == WARN and subject == "NVIDIA H100 80GB HBM3" and "no majority" in text
    assert "550.54.15 on a" in text and "550.90.07 on b" in text


def test_only_nodes_with_the_same_gpu_model_and_ready_are_compared() -> None:
    other = node("h200", driver="580.159.04", gpu="NVIDIA H200")
    gone = node("c", driver="535.1")
    gone.state, gone.connected = "lost", False
    [(status, _, _)] = run("driver-versions", node("a"), node("b"), other, gone)
    assert status == OK
    [(status, _, text)] = run("driver-versions", node("a"), other)
    assert status == OK and "nothing to compare" in text


# ---- placement pools -----------------------------------------------------------------------------

H100 = "NVIDIA H100 80GB HBM3"  # memory as nvidia-smi -q's FB Memory Usage Total of an H100 SXM: 81559 MiB


def box(node_id: str, gpus: int = 8, gpu: str = H100, memory_mib: int = 81559, **versions: str) -> NodeFacts:
    n = node(node_id, gpu=gpu, **versions)
    template = n.inventory.gpus[0]
    board = [msgspec.structs.replace(template, index=i, memory_mib=memory_mib) for i in range(gpus)]
    n.inventory = msgspec.structs.replace(n.inventory, gpus=board)
    return n


def pooled(models: list[ModelFacts], *nodes: NodeFacts, check: str = "driver-versions") -> list[Finding]:
    return CLUSTER_CHECKS[check](ClusterFacts(nodes=list(nodes), models=models))


LLAMA = ModelFacts(name="llama-70b", replicas=2, profiles=[ProfileNeeds(gpus=8, gpu_kind="H100")])


def test_one_node_on_another_driver_in_a_models_pool_is_flagged_alone_and_names_the_model() -> None:
    nodes = [box("gpu-01"), box("gpu-02"), box("gpu-03", driver="550.90.07"), box("gpu-04")]
    [odd] = pooled([LLAMA], *nodes)
    assert (odd.status, odd.subject) == (WARN, "gpu-03")
    assert odd.finding.startswith("gpu-03 runs NVIDIA driver 550.90.07; the other 3 nodes in the placement pool "
                                  "of llama-70b run 550.54.15"), odd.finding
    [ok] = pooled([LLAMA], *nodes[:2], nodes[3])
    assert ok.status == OK and "3 nodes in the placement pool of llama-70b: NVIDIA driver 550.54.15" in ok.finding


def test_a_pool_is_the_nodes_a_profile_fits_not_every_node_with_that_gpu() -> None:
    """Two 4-GPU H100 nodes on another driver are no part of an 8-GPU model's pool: they are
    compared with each other (nodes no model can use, by GPU model), not outvoted by the 8-GPU ones."""
    eights = [box("gpu-01"), box("gpu-02"), box("gpu-03")]
    fours = [box("small-01", gpus=4, driver="550.90.07"), box("small-02", gpus=4, driver="550.90.07")]
    [ok] = pooled([LLAMA], *eights, *fours)
    assert ok.status == OK, ok
    assert ("3 nodes in the placement pool of llama-70b" in ok.finding
            and f"2 nodes with {H100}: NVIDIA driver 550.90.07" in ok.finding)
    # With no models the same five are one pool by GPU model: the two are the odd ones.
    odd = pooled([], *eights, *fours)
    assert sorted(f.subject for f in odd) == ["small-01", "small-02"]
    # gpu_memory_mib is a floor: an 80 GB profile leaves out the 40 GB A100s.
    a100 = ModelFacts(name="mixtral", replicas=1,
                      profiles=[ProfileNeeds(gpus=8, gpu_kind="a100", gpu_memory_mib=80000)])
    big = [box(f"a100-{i}", gpu="NVIDIA A100-SXM4-80GB", memory_mib=81920) for i in range(3)]
    small = box("a100-40", gpu="NVIDIA A100-SXM4-80GB", memory_mib=40960, driver="535.161.08")
    [ok] = pooled([a100], *big, small)
    assert ok.status == OK and "3 nodes in the placement pool of mixtral" in ok.finding, ok


def test_models_sharing_a_pool_are_compared_once_and_a_node_is_named_once() -> None:
    chat = ModelFacts(name="chat", replicas=4, profiles=[ProfileNeeds(gpus=1)])  # any GPU: every node here
    nodes = [box("gpu-01"), box("gpu-02", driver="550.90.07"), box("gpu-03")]
    [odd] = pooled([LLAMA, chat], *nodes)
    assert odd.subject == "gpu-02" and "placement pool of chat, llama-70b" in odd.finding, odd.finding
    # A pool over two board models is cut by GPU model: the H200s' newer driver is theirs.
    h200 = [box(f"h200-{i}", gpu="NVIDIA H200", memory_mib=143771, driver="570.124.06") for i in range(2)]
    found = pooled([LLAMA, chat], *nodes, *h200)
    assert [f.subject for f in found] == ["gpu-02"]
    [ok] = pooled([chat], nodes[0], nodes[2], *h200)
    assert "2 nodes in the placement pool of chat (NVIDIA H200): NVIDIA driver 570.124.06" in ok.finding, ok.finding


def test_vbios_is_compared_per_board_model_within_a_pool() -> None:
    chat = ModelFacts(name="chat", replicas=4, profiles=[ProfileNeeds(gpus=1)])
    mixed = [box("gpu-01", vbios="96.00.74.00.0D"), box("gpu-02", vbios="96.00.74.00.0D"),
             box("h200-1", gpu="NVIDIA H200", vbios="96.00.A5.00.1A"),
             box("h200-2", gpu="NVIDIA H200", vbios="96.00.A5.00.1A")]
    [ok] = pooled([chat], *mixed, check="firmware-versions")
    assert ok.status == OK, ok


def test_a_profile_without_gpus_or_a_model_without_profiles_has_no_pool() -> None:
    cpu = ModelFacts(name="embed-cpu", replicas=1, profiles=[ProfileNeeds(gpus=0)])
    none = ModelFacts(name="later", replicas=0)
    found = pooled([cpu, none], box("gpu-01"), box("gpu-02", driver="550.90.07"), box("gpu-03"))
    assert [(f.subject, "with NVIDIA H100" in f.finding) for f in found] == [("gpu-02", True)]


# ---- hw_counters -------------------------------------------------------------------------------


def _telegraf_hw() -> dict[str, str]:
    """The real RoCE port's hw_counters/ as the files sysfs would hold (from line protocol)."""
    line = (REAL / "sysfs" / "telegraf-mlx5-bond-roce-hw-counters.txt").read_text().splitlines()[1]
    fields = line.split(" ")[1]
    return {f"hw_counters/{k}": v.rstrip("i") + "\n" for k, v in (kv.split("=") for kv in fields.split(","))}


def _procfs_hw() -> dict[str, str]:
    text = (REAL / "sysfs" / "procfs-fixtures-hfi1-mlx4-mlx5.txt").read_text()
    prefix = "sys/class/infiniband/mlx5_0/ports/1/"
    out = {}
    for line in text.splitlines():
        match = re.match(rf"{re.escape(prefix)}(\S+): (.*)$", line)
        if match:
            out[match[1]] = match[2] + "\n"
    return out


def test_real_hw_counters_parse_apart_from_the_ib_counters() -> None:
    roce = sysfs.parse_port_counters("mlx5_bond_0", 1, {"state": "4: ACTIVE", **_telegraf_hw()})
    assert roce.hw_counters["rx_write_requests"] == 19000 and roce.hw_counters["np_cnp_sent"] == 0
    assert "lifespan" not in roce.hw_counters and roce.counters == {}
    ib = sysfs.parse_port_counters("mlx5_0", 1, _procfs_hw())
    assert ib.hw_counters["req_cqe_error"] == 3481 and ib.hw_counters["packet_seq_err"] == 1
    assert ib.counters["unicast_xmit_packets"] == 10907922116 and "out_of_buffer" not in ib.counters


def _readings(before: dict[str, int], after: dict[str, int], window: float = 10.0) -> NodeFacts:
    base = _telegraf_hw()
    then = sysfs.parse_port_counters("mlx5_0", 1, {"state": "4: ACTIVE", **base,
                                                   **{f"hw_counters/{k}": f"{v}\n" for k, v in before.items()}})
    now = sysfs.parse_port_counters("mlx5_0", 1, {"state": "4: ACTIVE", **base,
                                                  **{f"hw_counters/{k}": f"{v}\n" for k, v in after.items()}})
    inventory = m.Inventory(ports=[m.Port(device="mlx5_0", port=1, link_layer="Ethernet", state="ACTIVE",
                                          netdev="eth0")])
    return healthy(inventory=inventory, ports=[now], ports_before=[then], window=window)


def test_hw_counters_healthy_warn_and_crit_as_rates() -> None:
    # Healthy: the real port's totals (19000 writes, CQE errors from teardowns) rising or not.
    quiet = grade("counters", _readings({"rx_write_requests": 19000, "req_cqe_error": 5},
                                        {"rx_write_requests": 99000, "req_cqe_error": 9, "np_cnp_sent": 40}))
    assert [f.status for f in quiet] == [OK]
    # Loss: packet_seq_err +120 in 10 s is 12/s: WARN, with the rate and what to look at.
    [loss] = grade("counters", _readings({"packet_seq_err": 7}, {"packet_seq_err": 127}))
    assert loss.status == WARN and "packet_seq_err +120 (12/s)" in loss.finding and "in 10s" in loss.finding
    assert "mlnx_qos -i eth0" in loss.action and loss.subject == "mlx5_0/1"
    [rx] = grade("counters", _readings({"out_of_buffer": 0}, {"out_of_buffer": 4}))
    assert rx.status == WARN and "out_of_buffer +4 (0.4/s)" in rx.finding and "receive WQEs" in rx.action
    # Heavy loss, or a QP that went to error: CRIT.
    [heavy] = grade("counters", _readings({"out_of_sequence": 0}, {"out_of_sequence": 50_000}))
    assert heavy.status == CRIT and "(5,000/s)" in heavy.finding
    [broke] = grade("counters", _readings({"req_transport_retries_exceeded": 0}, {"req_transport_retries_exceeded": 1}))
    assert broke.status == CRIT and "went to error" in broke.action


def test_a_counter_that_went_back_is_a_driver_reload_not_a_rise() -> None:
    assert [f.status for f in grade("counters", _readings({"packet_seq_err": 500}, {"packet_seq_err": 3}))] == [OK]


def test_cluster_findings_stay_under_the_cluster_group() -> None:
    found = CLUSTER_CHECKS["driver-versions"](ClusterFacts(nodes=[node("a"), node("b"), node("c", driver="1")]))
    assert all(f.node == CLUSTER and f.check == "driver-versions" for f in found)


_version = st.sampled_from(["", "550.54.15", "550.90.07", "12.4", "a, b"])
_counts = st.dictionaries(st.sampled_from(["packet_seq_err", "out_of_buffer", "req_transport_retries_exceeded",
                                           "np_cnp_sent", "x"]), st.none() | st.integers(0, 2**64))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(_version, _version, _version, _version, st.sampled_from(["H100", "H200", ""]),
                          st.booleans()), max_size=6))
def test_arbitrary_versions_never_raise_and_name_only_ready_nodes(
    rows: list[tuple[str, str, str, str, str, bool]]
) -> None:
    nodes = []
    for i, (driver, cuda, vbios, fw, gpu, ready) in enumerate(rows):
        n = node(f"n{i}", driver=driver, cuda=cuda, vbios=vbios, fw=fw, stack=driver, gpu=gpu)
        n.state = "ready" if ready else "lost"
        nodes.append(n)
    facts = ClusterFacts(nodes=nodes)
    ready = {n.id for n in nodes if n.state == "ready"}
    for check in ("driver-versions", "firmware-versions"):
        found = CLUSTER_CHECKS[check](facts)
        assert found and all(f.status in (OK, WARN) for f in found)
        assert all(f.subject in ready or f.status == OK or "no majority" in f.finding for f in found)


@settings(max_examples=80, deadline=None)
@given(_counts, _counts, st.floats(0, 1e4))
def test_arbitrary_hw_counters_never_raise(before: dict[str, int | None], after: dict[str, int | None],
                                           window: float) -> None:
    then = m.PortCounters(device="mlx5_0", port=1, hw_counters=before)
    now = m.PortCounters(device="mlx5_0", port=1, hw_counters=after)
    found = grade("counters", healthy(ports=[now], ports_before=[then], window=window))
    assert found and all(f.status in (OK, WARN, CRIT) for f in found)


def test_loss_on_infiniband_is_not_blamed_on_pfc() -> None:
    n = _readings({"packet_seq_err": 0}, {"packet_seq_err": 30})
    n.inventory = m.Inventory(ports=[m.Port(device="mlx5_0", port=1, link_layer="InfiniBand", state="ACTIVE")])
    [f] = grade("counters", n)
    assert f.status == WARN and "ibqueryerrors" in f.action and "mlnx_qos" not in f.action
    assert "(packet_seq_err: sequence-error NAKs received)" in f.action


def test_cuda_and_vbios_read_as_the_real_nvidia_smi_prints_them() -> None:
    from llmgw.agent.versions import cuda_text

    text = (REAL / "nvidia-smi-q" / "llmgw-device-1xh200-vm.txt").read_text()
    cuda = re.search(r"CUDA Version\s+: (\S+)", text)
    vbios = re.search(r"VBIOS Version\s+: (\S+)", text)
    assert cuda and vbios
    assert cuda_text(13000) == cuda[1] == "13.0" and cuda_text(12040) == "12.4" and cuda_text(0) == ""
    from llmgw.sim.node_faults import SIM_VBIOS
    assert vbios[1] == SIM_VBIOS  # the simulated node's VBIOS has the real one's shape
