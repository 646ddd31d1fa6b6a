"""Fleet messages: round trips, unknown fields and types, malformed payloads."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.wire import messages as m

node_ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=20)


def sample_register(node_id: str = "gpu-01") -> m.Register:
    return m.Register(
        node_id=node_id,
        version="0.1.0",
        features=[m.FEATURE_START, m.FEATURE_STOP],
        inventory=m.Inventory(
            hostname=node_id,
            gpus=[m.Gpu(index=i, uuid=f"GPU-{i}", name="NVIDIA H100 80GB HBM3", memory_mib=81559,
                        nvlink={j: 18 for j in range(8) if j != i}) for i in range(8)],
            ports=[m.Port(device=f"mlx5_{i}", port=1, state="ACTIVE", phys_state="LinkUp", rate_gbps=400, width="4X",
                          speed="NDR") for i in range(4)],
        ),
        fabrics=[m.FabricDecl(name="ib-a", devices=["mlx5_0"])],
        shards=[m.ShardReport(spec=m.ShardSpec(shard_id="s1", replica_id="r1", model="llama", profile="tp2",
                                               engine="vllm", gpus=[0, 1], port=20001), state="ready", pid=1234)],
    )


AGENT_SAMPLES = [
    sample_register(),
    m.Heartbeat(seq=7, sent_at=1.5, ports=[m.PortCounters(device="mlx5_0", port=1, symbol_error=3)]),
    m.ShardStatus(shard_id="s1", replica_id="r1", state="failed", exit_code=1, tail=["boom"]),
    m.Progress(shard_id="s1", source="hf://x", done_bytes=10, total_bytes=100),
    m.FabricTestResult(request_id="ft-1-s", phase="ready", ok=True, tcp_port=18515, gid_index=3,
                       notes=["mlx5_4/1: RoCE v2 GID index 3"]),
    m.FabricTestResult(request_id="ft-1-c", output=" #bytes ...\n", error="ib_write_bw exited with status 1",
                       exit_code=1),
]
SERVER_SAMPLES = [
    m.Welcome(server_version="0.1.0", heartbeat_interval=5.0),
    m.Start(spec=m.ShardSpec(shard_id="s1", replica_id="r1", model="x", profile="p", engine="sim")),
    m.Stop(shard_id="s1", grace=3.0),
    m.Drain(shard_id="s1"),
    m.FabricTest(request_id="ft-1-c", role="client", device="mlx5_0", server_host="10.0.0.2", server_port=18515),
    m.FabricTest(request_id="ft-1-p", role="prepare"),
    m.FabricTestCancel(request_id="ft-1-s"),
]


@pytest.mark.parametrize("msg", AGENT_SAMPLES, ids=lambda x: type(x).__name__)
def test_agent_messages_round_trip(msg: msgspec.Struct) -> None:
    assert m.decode_agent_message(m.encode(msg)) == msg


@pytest.mark.parametrize("msg", SERVER_SAMPLES, ids=lambda x: type(x).__name__)
def test_server_messages_round_trip(msg: msgspec.Struct) -> None:
    assert m.decode_server_message(m.encode(msg)) == msg


@given(node_id=node_ids, seq=st.integers(min_value=0, max_value=2**53))
def test_register_and_heartbeat_round_trip_property(node_id: str, seq: int) -> None:
    reg = sample_register(node_id)
    assert m.decode_agent_message(m.encode(reg)) == reg
    hb = m.Heartbeat(seq=seq)
    assert m.decode_agent_message(m.encode(hb)) == hb


def test_unknown_fields_are_ignored() -> None:
    data = json.loads(m.encode(m.Heartbeat(seq=3)))
    data["added_in_v9"] = {"x": 1}
    assert m.decode_agent_message(json.dumps(data).encode()) == m.Heartbeat(seq=3)


def test_unknown_type_is_reported_not_raised() -> None:
    assert m.decode_agent_message(b'{"type": "TopologyReport2", "x": 1}') == m.Unknown(type="TopologyReport2")
    # A server message is unknown to the agent-side decoder and vice versa.
    assert m.decode_server_message(m.encode(m.Heartbeat())) == m.Unknown(type="Heartbeat")


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xff\xfe", b"[1,2]", b'{"no_type": 1}', b'{"type": "Register"}', b'{"type": "Heartbeat", "seq": "x"}',
     b"{" * 10000],
)
def test_malformed_payloads_raise_message_error(payload: bytes) -> None:
    with pytest.raises(m.MessageError):
        m.decode_agent_message(payload)


@given(st.binary(max_size=2000))
def test_arbitrary_payloads_raise_only_message_error(payload: bytes) -> None:
    try:
        m.decode_agent_message(payload)
        m.decode_server_message(payload)
    except m.MessageError:
        pass
