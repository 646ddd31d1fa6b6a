"""Fleet protocol messages: msgspec Structs in two tagged unions (agent→server, server→agent).

Unknown fields are ignored so that a newer peer can add fields; an unknown message type
decodes to `Unknown` so the receiver can log it once and go on.
"""

from __future__ import annotations

import msgspec

PROTOCOL = "llmgw.fleet.v1"
CONNECT_PATH = "/llmgw.fleet.v1.Fleet/Connect"
CONTENT_TYPE = "application/connect+json"

# Requests an agent can answer; a server checks these before asking (DESIGN.md).
FEATURE_START = "start"
FEATURE_STOP = "stop"
FEATURE_DRAIN = "drain"
FEATURE_ADOPT = "adopt"
FEATURE_DISCOVER = "discover"
FEATURE_FABRIC_TEST = "fabric-test"
FEATURE_FABRIC_TEST_DURATION = "fabric-test-duration"  # FabricTest.duration (ib_write_bw -D)
FEATURE_FABRIC_TEST_GPUDIRECT = "fabric-test-gpudirect"  # FabricTest.cuda_device (--use_cuda), on a node with GPUs
FEATURE_LOGS = "logs"  # LogTail / LogCredit / LogCancel, answered with LogChunk


class _Base(msgspec.Struct, kw_only=True, omit_defaults=True):
    pass


# ---- inventory -----------------------------------------------------------------------


class Gpu(_Base):
    index: int
    uuid: str = ""
    name: str = ""
    memory_mib: int = 0
    # NVLink: indexes of GPUs this one reaches over NVLink, and the link count to each.
    nvlink: dict[int, int] = {}
    pci_bus_id: str = ""
    health: str = "ok"
    # nvmlDeviceGetVbiosVersion ("96.00.A5.00.1A"); "" from an agent before issue 39 or when NVML cannot say.
    vbios: str = ""


class Port(_Base):
    """One RDMA port as sysfs shows it (/sys/class/infiniband/<device>/ports/<port>)."""

    device: str
    port: int
    link_layer: str = "InfiniBand"  # or "Ethernet" (RoCE)
    state: str = ""  # ACTIVE, DOWN, INIT, ARMED
    phys_state: str = ""  # LinkUp, Polling, Disabled, ...
    rate_gbps: float = 0.0
    width: str = ""  # "4X"
    speed: str = ""  # "HDR"
    lid: int = 0
    sm_lid: int = 0
    gid: str = ""
    gid_type: str = ""  # "IB/RoCE v1" or "RoCE v2" (RoCE ports)
    node_guid: str = ""
    netdev: str = ""
    hca_type: str = ""
    fw_ver: str = ""
    # RoCE: the index of the RoCE v2 GID that holds an IPv4-mapped address (what NCCL_IB_GID_INDEX
    # must be); -1 when there is none (InfiniBand ports, RoCE without an IPv4 address).
    roce_v2_ipv4_gid_index: int = -1
    # The HCA's PCIe link (sysfs device/current_link_speed, current_link_width, max_link_speed,
    # max_link_width): GT/s and lanes, 0 when not read (an older agent, a virtual function, no
    # such file). fabric-test grades a rail against min(link, PCIe) (fabric/linkrate.py).
    pcie_speed_gts: float = 0.0
    pcie_width: int = 0
    pcie_max_speed_gts: float = 0.0
    pcie_max_width: int = 0
    # GPU index → how the HCA reaches it on the PCIe tree, in `nvidia-smi topo -m`'s words (PIX,
    # PXB, PHB, NODE, SYS; agent/gpu_affinity.py): `fabric-test --gpudirect` uses the nearest GPU.
    # Empty from an agent before issue 39, or where sysfs cannot place the GPUs.
    gpu_affinity: dict[int, str] = {}


class Inventory(_Base):
    hostname: str = ""
    gpus: list[Gpu] = []
    ports: list[Port] = []
    cpus: int = 0
    memory_mib: int = 0
    mgmt_ip: str = ""
    # Where the inventory came from: "nvml", "sim", "none" (no GPU library found).
    gpu_source: str = ""
    # Why there are no GPUs when gpu_source is "none" (shown by `ctl nodes`).
    gpu_note: str = ""
    # The interface holding the agent's advertise_host (its engines' NCCL_SOCKET_IFNAME and
    # GLOO_SOCKET_IFNAME, the address ranks bootstrap on), and how it was found: "address" (it
    # holds it) or "none" (no interface does: multi-node launches are refused on the node). Agents
    # before issue 38 reported the interface of mgmt_ip, or "fallback" (eth0).
    mgmt_interface: str = ""
    mgmt_interface_source: str = ""
    # The NVIDIA driver version NVML reports (the simulated inventory's for a sim node); "" from
    # an agent too old to say, or without NVML (`ctl doctor`'s nvml check).
    gpu_driver: str = ""
    # The CUDA version the driver supports (nvmlSystemGetCudaDriverVersion, 12040 → "12.4") and the
    # RDMA stack: "MLNX_OFED <version>" (/sys/module/mlx5_core/version, which only out-of-tree
    # drivers carry) or "in-box, kernel <release>". "" from an agent before issue 39 (doctor's
    # driver-versions check leaves such a node out rather than call it odd).
    cuda_driver: str = ""
    rdma_stack: str = ""


class FabricDecl(_Base):
    """A fabric an operator declared in the agent config (discovery may add more)."""

    name: str
    kind: str = "infiniband"  # infiniband | roce | ethernet
    devices: list[str] = []


class FabricStatus(_Base, omit_defaults=False):
    """A declared fabric checked against the hardware: usable (advertised) or not, and why.

    `ports` are the usable adapter ports as NCCL_IB_HCA names them (`mlx5_0:1`); `rate_gbps` is
    the slowest of them (a collective runs at its slowest link); `problems` say, one line each,
    why an adapter was left out (missing, no ACTIVE port, wrong link layer).
    """

    name: str
    kind: str = "infiniband"
    devices: list[str] = []
    usable: bool = False
    ports: list[str] = []
    rate_gbps: float = 0.0
    problems: list[str] = []


# ---- shards -----------------------------------------------------------------------------


class ShardSpec(_Base):
    """Everything an agent needs to run (or later describe) one engine process."""

    shard_id: str
    replica_id: str
    model: str
    profile: str
    engine: str  # vllm | sglang | command | sim
    source: str = ""
    rank: int = 0
    world: int = 1
    gpus: list[int] = []
    host: str = "127.0.0.1"
    port: int = 0
    args: list[str] = []
    command: list[str] = []
    env: dict[str, str] = {}
    health_path: str = "/health"
    start_timeout: float = 1200.0
    stop_grace: float = 5.0
    served_name: str = ""
    # The fabric the replica's ranks talk over (multi-node); "" = the node's first usable one.
    fabric: str = ""
    # Multi-node (world > 1): rank 0's address and the port every rank dials (vLLM
    # --master-addr/--master-port, SGLang --dist-init-addr, the Ray head), and how the engine
    # spans nodes: "" (its own multiprocessing) or "ray".
    master_addr: str = ""
    master_port: int = 0
    engine_mode: str = ""
    # For an http(s) source: the fetched file must have this digest before it is used.
    sha256: str = ""
    # For an http(s) source: hosts a redirect may lead to besides the source's own
    # (llmgw.catalog.redirects); an older server sends none, and only the source's host is followed.
    allow_redirect_hosts: list[str] = []
    # The engine's own API key, made by the server for this shard: the engine refuses /v1/*
    # without it, and only the gateway sends it. A secret: never shown by the API or logged.
    api_key: str = ""


class EnvSetting(_Base, omit_defaults=False):
    """One environment variable the agent derived for an engine (NCCL_IB_HCA, ...): its value,
    and whether the profile's `env:` overrode it (then `value` is the profile's)."""

    name: str
    value: str
    derived: str = ""  # what the agent would have set
    overridden: bool = False


class ShardReport(_Base):
    """A shard as the agent knows it, sent in full with every Register (adoption)."""

    spec: ShardSpec
    state: str = "starting"
    pid: int = 0
    started_at: float = 0.0  # wall-clock time the engine was launched
    endpoint: str = ""
    exit_code: int | None = None
    reason: str = ""
    tail: list[str] = []
    launch_env: list[EnvSetting] = []


# ---- agent → server ---------------------------------------------------------------------


class Register(_Base, tag="Register", tag_field="type"):
    node_id: str
    version: str
    features: list[str] = []
    inventory: Inventory = msgspec.field(default_factory=Inventory)
    # The usable fabrics only (declared, and checked against the hardware); fabric_status has
    # every declared one with the reason it is or is not usable.
    fabrics: list[FabricDecl] = []
    fabric_status: list[FabricStatus] = []
    shards: list[ShardReport] = []
    cert_not_after: float = 0.0
    # The address the node's engines are reached on (its agent's `advertise_host`); the server
    # decides whether to use it or the stream's peer address (`fleet.endpoint_host`).
    advertise_host: str = ""


class PortCounters(_Base):
    device: str
    port: int
    state: str = ""
    phys_state: str = ""
    rate_gbps: float = 0.0
    # None: the port cannot read this counter ("N/A (no PMA)"), which is not the same as 0.
    symbol_error: int | None = None
    link_downed: int | None = None
    port_rcv_errors: int | None = None
    # Every counter under counters/ and counters_ext/ by file name (port_xmit_data,
    # port_rcv_packets, port_xmit_data_64, ...); None: "N/A (no PMA)".
    counters: dict[str, int | None] = {}
    # Every counter under hw_counters/ (mlx5's out_of_buffer, packet_seq_err, np_cnp_sent, ...);
    # empty from an agent before issue 39 or a port without them.
    hw_counters: dict[str, int | None] = {}


class GpuHealth(_Base):
    index: int
    health: str = "ok"
    temperature_c: int = 0
    utilization_pct: int = 0
    memory_used_mib: int = 0
    power_w: float | None = None  # board power draw (nvmlDeviceGetPowerUsage, mW → W); None: not read
    # For `ctl doctor` (issue 14); None: not read (an older agent, or NVML cannot say on this GPU).
    ecc_uncorrected: int | None = None  # volatile uncorrected ECC errors since the driver loaded
    nvlink_down: int | None = None  # NVLink links the GPU has that are not up
    xid: int | None = None  # the last Xid event seen (0: none)
    # Issue 39's checks, read as `nvidia-smi -q` shows them; None: not read, as above.
    board_read: bool = False  # the agent reads these (False: older than issue 39, doctor says unknown)
    remap_pending: bool | None = None  # nvmlDeviceGetRemappedRows: a row remap waits for a GPU reset
    remap_failed: bool | None = None  # a remap failed: the bank had no spare row left
    remapped_uncorrectable: int | None = None  # rows remapped for uncorrectable errors
    retired_pages: int | None = None  # dynamic page retirement (boards before row remapping)
    retired_pending: bool | None = None  # a retired page waits for the driver to reload
    clock_events: list[str] | None = None  # active clock event reasons (CLOCK_EVENTS' names)
    slowdown_c: int | None = None  # the card's own slowdown temperature
    shutdown_c: int | None = None  # and its shutdown temperature
    pcie_gen: int | None = None  # the PCIe link now, and the most it can train at in this slot
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    persistence: bool | None = None  # persistence mode
    ecc_enabled: bool | None = None  # ECC mode now, and after the next reset
    ecc_pending: bool | None = None
    # The NVSwitch fabric as NVML's GPU fabric info sees it (Hopper and later, driver 530+; None
    # where the driver cannot say): FABRIC_STATES' name, and NVML's return code for the setup.
    fabric_state: str | None = None
    fabric_status: int | None = None


# GpuHealth.fabric_state: nvmlGpuFabricState_t (NVML_GPU_FABRIC_STATE_*), value → name.
FABRIC_STATES: dict[int, str] = {0: "not_supported", 1: "not_started", 2: "in_progress", 3: "completed"}


# GpuHealth.clock_events: NVML's clock event reasons (nvmlClocksEventReason*, named as
# `nvidia-smi -q` prints them under "Clocks Event Reasons"), bit → name.
CLOCK_EVENTS: dict[int, str] = {
    0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
    0x100: "display_clocks",
}


# HostFacts.memlock_bytes of an unlimited RLIMIT_MEMLOCK.
MEMLOCK_UNLIMITED = -1


class HostFacts(_Base):
    """Facts about the agent's host that `ctl doctor` grades (issue 14). Every field is optional:
    None means not read, which doctor reports as `unknown` with the reason."""

    # The agent's RLIMIT_MEMLOCK (soft), inherited by its engines: RDMA registration pins memory,
    # so it must be unlimited on a node with RDMA adapters. MEMLOCK_UNLIMITED for unlimited.
    memlock_bytes: int | None = None
    # The adapters are a simulation's (`llmgw sim node`'s sysfs tree): nothing is pinned.
    rdma_simulated: bool = False
    model_cache: str = ""  # the directory weights are fetched into
    cache_free_bytes: int | None = None  # free to the agent's user on the model cache's file system
    cache_total_bytes: int | None = None
    # GPUDirect RDMA (issue 39): the peer-memory modules loaded (/sys/module/nvidia_peermem or the
    # older nv_peer_mem), and whether the NVIDIA driver is the open kernel module flavour, which
    # offers dma-buf instead; None: not read (an older agent, or no NVIDIA driver to ask).
    gpu_rdma_modules: list[str] | None = None
    nvidia_open: bool | None = None
    # NVSwitch boards (issue 39): NVSwitch PCI devices (NVIDIA, class 0x068000), and whether an
    # nv-fabricmanager process runs (/proc); None: not read (an older agent, or no /sys, /proc).
    nvswitches: int | None = None
    fabric_manager: bool | None = None


class Heartbeat(_Base, tag="Heartbeat", tag_field="type"):
    seq: int = 0
    sent_at: float = 0.0
    ports: list[PortCounters] = []
    gpus: list[GpuHealth] = []
    # Every shard the agent runs, in full as in Register, on every `resync_every`-th heartbeat
    # (None: not on this one; an older agent never sends it). The server compares it with what
    # it believes, so a divergence heals without a reconnect (level-triggered resync).
    shards: list[ShardReport] | None = None
    # The host facts doctor grades (None: an older agent); `sent_at` is the agent's wall clock,
    # which the server compares with its own (clock skew).
    host: HostFacts | None = None


class ShardStatus(_Base, tag="ShardStatus", tag_field="type"):
    shard_id: str
    replica_id: str
    state: str
    pid: int = 0
    exit_code: int | None = None
    reason: str = ""
    tail: list[str] = []
    endpoint: str = ""
    launch_env: list[EnvSetting] = []


class Fabrics(_Base, tag="Fabrics", tag_field="type"):
    """The usable fabrics changed at runtime (a cable pulled, a subnet manager gone): the
    server replaces the node's fabrics with these. Sent once per change."""

    fabrics: list[FabricDecl] = []
    fabric_status: list[FabricStatus] = []


class Progress(_Base, tag="Progress", tag_field="type"):
    """A download a starting shard waits on (issue 12): its own message, not a ShardStatus, so
    bytes arriving never look like a state change. At most once a second per source."""

    shard_id: str
    source: str
    done_bytes: int = 0
    total_bytes: int | None = None  # None: the server sent no length ("so far")
    rate: float = 0.0  # bytes per second over the last report interval
    # Bytes this agent has received over the network for this source since it started (resumed
    # bytes already on disk are not in it): the server counts llmgw_weights_bytes_total from it.
    fetched: int = 0
    # Set once, on the report of a download that failed for good: the metric's reason label.
    failure: str = ""


class DiscoverResult(_Base, tag="DiscoverResult", tag_field="type"):
    """What a fabric tool printed, for the `Discover` with the same request_id. The server parses
    it (a format the parser has not met is a server upgrade, not one of every node)."""

    request_id: str
    tool: str  # DISCOVER_TOOLS
    device: str = ""
    port: int = 0
    ok: bool = False
    exit_code: int | None = None
    duration: float = 0.0
    size: int = 0  # bytes the tool printed (before compression and the cap)
    encoding: str = ""  # "" (text as UTF-8) or "zlib"
    data: bytes = b""
    truncated: bool = False  # the output passed the agent's cap and was cut
    error: str = ""  # why not ok: not installed, timed out and killed, exit status and stderr's tail



class LogChunk(_Base, tag="LogChunk", tag_field="type"):
    """Engine log lines for one `LogTail` request; each chunk uses one credit. `eof`: nothing more
    comes for this request (the engine's log ended, or `error`). No shard id: the server routes a
    chunk by its request id, and only from the node it asked (server/logs.py)."""

    request_id: str
    lines: list[str] = []
    eof: bool = False
    error: str = ""


# The phases of a FabricTestResult: "progress" (a note on the way: installing perftest), "ready"
# (the server side listens on tcp_port; the client may start), "done" (the run ended, ok or not).
FABRIC_TEST_PHASES = ("progress", "ready", "done")


class FabricTestResult(_Base, tag="FabricTestResult", tag_field="type"):
    """One side of an ib_write_bw run, for the `FabricTest` with the same request_id. The raw
    output travels, never parsed here (the server parses: llmgw.fabric.perftest)."""

    request_id: str
    phase: str = "done"  # FABRIC_TEST_PHASES
    ok: bool = False
    tcp_port: int = 0  # ready: where the server side listens for the client
    gid_index: int = -1  # RoCE: the RoCE v2 GID index this side chose (-x); -1 on InfiniBand
    exit_code: int | None = None
    duration: float = 0.0
    output: str = ""  # what ib_write_bw printed (stdout then stderr's tail), capped
    error: str = ""  # why not ok: not installed and could not install, timed out and killed, exit status
    notes: list[str] = []  # what the operator should hear: "installed perftest with apt-get (41 s)"


AgentMessage = Register | Heartbeat | ShardStatus | Progress | Fabrics | DiscoverResult | LogChunk | FabricTestResult


# ---- server → agent ---------------------------------------------------------------------


class Welcome(_Base, tag="Welcome", tag_field="type"):
    """First server message: the heartbeat interval the server judges liveness by, and the largest
    message it reads (fleet.max_message; 0 from a server too old to say): a bigger one ends the
    stream, so the agent cuts what it sends (a fabric tool's output) to fit."""

    server_version: str
    heartbeat_interval: float
    max_message: int = 0


class Start(_Base, tag="Start", tag_field="type"):
    spec: ShardSpec


class Stop(_Base, tag="Stop", tag_field="type"):
    shard_id: str
    grace: float = 5.0
    reason: str = ""


class Drain(_Base, tag="Drain", tag_field="type"):
    """Retire a shard whose endpoint the gateway has already taken out of rotation: the engine
    gets SIGTERM and up to `grace` seconds to finish the requests it runs (vLLM finishes running
    requests on SIGTERM), then SIGKILL. Needs FEATURE_DRAIN; an older agent gets Stop."""

    shard_id: str
    reason: str = ""
    grace: float = 5.0


# The fabric tools a Discover may name, and the command each runs (the agent builds the argv).
TOOL_IBNETDISCOVER = "ibnetdiscover"
TOOL_SMIR = "saquery-smir"
DISCOVER_TOOLS = (TOOL_IBNETDISCOVER, TOOL_SMIR)


class Discover(_Base, tag="Discover", tag_field="type"):
    """Run a fabric tool through one local port and send back its raw output (needs FEATURE_DISCOVER)."""

    request_id: str
    tool: str  # DISCOVER_TOOLS
    device: str = ""  # "mlx5_0": the port to query through (-C/-P); "" lets the tool choose
    port: int = 1
    timeout: float = 60.0



class LogTail(_Base, tag="LogTail", tag_field="type"):
    """Send the last `tail` lines of a shard's engine log and, with `follow`, new lines as they
    are written. Credit-based backpressure: the agent sends at most `credit` chunks ahead of the
    `LogCredit`s it has received, so a slow reader at the far end holds the agent's reading,
    not its memory."""

    request_id: str
    shard_id: str
    tail: int = 200
    follow: bool = False
    credit: int = 4


class LogCredit(_Base, tag="LogCredit", tag_field="type"):
    request_id: str
    credit: int = 1


class LogCancel(_Base, tag="LogCancel", tag_field="type"):
    request_id: str


# "prepare": only make sure ib_write_bw is there (install perftest if need be), before any rail runs.
FABRIC_TEST_ROLES = ("server", "client", "prepare")


class FabricTest(_Base, tag="FabricTest", tag_field="type"):
    """Run one side of `ib_write_bw` through one local port (needs FEATURE_FABRIC_TEST): the
    server side answers "ready" with its TCP port once it listens, the client side dials
    server_host:server_port; both answer "done" with what perftest printed. The agent chooses
    the RoCE v2 GID index itself and kills a run (its process group) past `timeout`."""

    request_id: str
    role: str  # FABRIC_TEST_ROLES
    device: str = ""  # "mlx5_0" ("" for prepare)
    port: int = 1
    server_host: str = ""  # client: the server side's address
    server_port: int = 0  # client: the TCP port the server side said it listens on
    size: int = 65536  # bytes per message (-s); both sides must agree
    iterations: int = 5000  # -n, when duration is 0
    timeout: float = 60.0
    # Seconds to run (-D) instead of a count of iterations; 0 (an older server): -n iterations.
    # Sent only to agents listing FEATURE_FABRIC_TEST_DURATION.
    duration: int = 0
    # GPUDirect RDMA: the CUDA device whose memory holds the buffers (--use_cuda=N); -1: host memory.
    # Sent only to agents listing FEATURE_FABRIC_TEST_GPUDIRECT.
    cuda_device: int = -1


class FabricTestCancel(_Base, tag="FabricTestCancel", tag_field="type"):
    """Stop a FabricTest still running (its partner failed): killed, answered "done" with an error."""

    request_id: str


ServerMessage = (Welcome | Start | Stop | Drain | Discover | LogTail | LogCredit | LogCancel | FabricTest
                 | FabricTestCancel)


class Unknown(msgspec.Struct, frozen=True):
    """A message whose type this side does not know (a newer peer)."""

    type: str


class MessageError(ValueError):
    """A payload that is not a valid message (fatal to the stream)."""


class _TypeOnly(msgspec.Struct):
    type: str


_type_only = msgspec.json.Decoder(_TypeOnly)
_encoder = msgspec.json.Encoder()
_agent_decoder = msgspec.json.Decoder(AgentMessage)
_server_decoder = msgspec.json.Decoder(ServerMessage)
AGENT_TYPES: frozenset[str] = frozenset(t.__struct_config__.tag for t in AgentMessage.__args__)
SERVER_TYPES: frozenset[str] = frozenset(t.__struct_config__.tag for t in ServerMessage.__args__)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_tagged(payload: bytes, decoder: msgspec.json.Decoder, tags: frozenset[str]):
    try:
        return decoder.decode(payload)
    except msgspec.DecodeError as exc:
        try:
            kind = _type_only.decode(payload).type
        except msgspec.DecodeError:
            raise MessageError(f"malformed message: {exc}") from None
        if kind not in tags:
            return Unknown(type=kind)
        raise MessageError(f"malformed {kind} message: {exc}") from None


def decode_agent_message(payload: bytes) -> AgentMessage | Unknown:
    return decode_tagged(payload, _agent_decoder, AGENT_TYPES)


def decode_server_message(payload: bytes) -> ServerMessage | Unknown:
    return decode_tagged(payload, _server_decoder, SERVER_TYPES)


def message_type(msg: msgspec.Struct) -> str:
    if isinstance(msg, Unknown):
        return msg.type
    tag = msg.__struct_config__.tag
    return str(tag) if tag is not None else type(msg).__name__
