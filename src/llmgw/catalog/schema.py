"""Config schema for the server (catalog included) and the agent.

Unknown keys are errors everywhere (`forbid_unknown_fields`): a typo must not pass silently.
"""

from __future__ import annotations

from collections import Counter
from typing import Annotated, Literal

import msgspec

from llmgw.catalog.redirects import allowed_host_problem
from llmgw.catalog.sources import SourceError, SourceKind, classify, sha256_problem
from llmgw.catalog.units import ByteSize, Duration

# The gateway's part of the config is the gateway feed's too (llmgw.wire.gateway carries it):
# defined once, below both (llmgw/gwsettings.py), and re-exported here.
from llmgw.gwsettings import (
    BalancerKind,
    GatewaySettings,
    NonNegative,
    Positive,
    StaticEndpoint,
    TlsPublic,
    check_digests,
)
from llmgw.names import id_problem, model_problem


class _Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """The flags of llmgw.gwsettings.Config, declared here too so that ruff knows this
    module's classes for msgspec Structs (RUF012 does not follow a base from another module)."""


EngineKind = Literal["vllm", "sglang", "command", "sim"]


class Profile(_Config):
    """One way to run a model: engine, GPUs, arguments. A model lists them by preference."""

    name: str = "default"
    engine: EngineKind = "vllm"
    gpus: NonNegative = 1  # per node
    # Nodes one replica spans (a shard per node, all on one usable fabric); gpus: is per node.
    nodes: Positive = 1
    # How a multi-node engine spans its nodes: its own multiprocessing ("native") or Ray (vLLM, sim).
    engine_mode: Literal["native", "ray"] = "native"
    # Substring of the GPU name this profile needs ("H100", "A100-SXM4-80GB"); empty = any.
    gpu_kind: str = ""
    # Minimum memory per GPU in MiB; 0 = any.
    gpu_memory_mib: int = 0
    args: list[str] = []
    env: dict[str, str] = {}
    # argv template for engine "command": {port} {host} {source} {gpus} {model} {tp}
    command: list[str] = []
    health_path: str = "/health"
    start_timeout: Duration = Duration(1200)
    stop_grace: Duration = Duration(5)
    # Weights for this profile instead of the model's source (llmgw.catalog.sources), and the
    # sha256 a fetched URL must have before it is renamed into the model cache.
    source: str = ""
    sha256: str = ""
    # Hosts a redirect from an http(s) source may lead to, besides the source's own host:
    # "cdn.example", "cdn.example:8443" or "*.example" (llmgw.catalog.redirects). Added to the
    # model's list. A source on huggingface.co may go to the Hub's CDN (*.hf.co) without it.
    allow_redirect_hosts: list[str] = []

    def __post_init__(self) -> None:
        problem = id_problem(self.name, "profile name") or sha256_problem(self.sha256)  # it travels in every Start
        problem = problem or next(filter(None, map(allowed_host_problem, self.allow_redirect_hosts)), None)
        if problem:
            raise ValueError(problem)
        if self.engine == "command" and not self.command:
            raise ValueError("engine 'command' needs a command: [argv, ...] template")
        if self.engine_mode == "ray" and self.engine not in ("vllm", "sim"):
            raise ValueError(f"engine_mode ray is for vllm (and the simulated engine), not {self.engine}")
        if self.nodes > 1 and self.gpus == 0:
            raise ValueError("a replica on several nodes needs gpus: (per node) of 1 or more")


class Admission(_Config):
    max_in_flight: NonNegative = 0  # 0 = unlimited
    max_queue: NonNegative = 256
    max_wait: Duration = Duration(30)


class Model(_Config):
    name: str
    source: str = ""  # weights location handed to the engine; defaults to name
    # Hosts a redirect from the source may lead to besides its own (see Profile).
    allow_redirect_hosts: list[str] = []
    replicas: NonNegative = 1
    profiles: list[Profile] = []
    balancer: BalancerKind = "least-outstanding"
    admission: Admission = msgspec.field(default_factory=Admission)

    def __post_init__(self) -> None:
        problem = model_problem(self.name)  # it travels in every Start (llmgw/names.py, wire/ids.py)
        problem = problem or next(filter(None, map(allowed_host_problem, self.allow_redirect_hosts)), None)
        if problem:
            raise ValueError(problem)
        for profile in self.profiles:
            source = profile.source or self.source or self.name
            try:
                kind = classify(source)
            except SourceError as exc:
                raise ValueError(str(exc)) from None
            if profile.sha256 and kind is not SourceKind.URL:
                raise ValueError(f"profile {profile.name!r}: sha256 is checked only for an http(s) source, "
                                 f"not {source!r}")
        names = [p.name for p in self.profiles]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate profile name {dupes[0]!r}")


class TlsServer(_Config):
    ca: str = ""
    cert: str = ""
    key: str = ""
    require_identity: bool = True
    # Revoked certificate serials (`llmgw ctl cert revoke` writes DIR/revoked.json); re-read on
    # SIGHUP and `llmgw ctl reload`, checked at every fleet handshake and for operator/viewer
    # certificates on the public port.
    deny_list: str = ""


class FleetSettings(_Config):
    heartbeat_interval: Duration = Duration(5)
    # A node is unreachable after this many intervals without a heartbeat.
    unreachable_after: Positive = 3
    lost_after: Duration = Duration(120)
    register_timeout: Duration = Duration(10)
    max_message: ByteSize = ByteSize(4 * 1024 * 1024)
    # Where the gateway reaches a node's engines: the address the agent advertises
    # (`advertise_host` in its config) or the address its fleet stream comes from ("peer":
    # a node advertising another address is refused). The port is always the shard's own.
    endpoint_host: Literal["advertised", "peer"] = "advertised"
    # The most one node may report; a Register over any is refused with the numbers.
    max_gpus: Positive = 256
    max_ports: Positive = 256
    max_shards: Positive = 1024
    # Heartbeats per second one node may send (bursts of twice that); beyond it they are
    # dropped and counted, and a flood (2 bursts in a row dropped) ends the stream. 0 = no limit.
    max_heartbeat_rate: float = 10.0
    # At most one log line per refusal reason and peer host this often (all are counted).
    refusal_log_interval: Duration = Duration(10)


class ApiSettings(_Config):
    # Bearer tokens that may read and change the fleet (/api/v1 mutations), as "sha256:<hex>".
    operator_tokens: list[str] = []
    # Bearer tokens that may only read: /api/v1 GETs and /metrics (dashboards, scripts).
    viewer_tokens: list[str] = []
    # Who may scrape /metrics: "viewer" (a viewer or operator credential, once any credential
    # is configured) or "open" (anyone who reaches the port).
    metrics: Literal["open", "viewer"] = "viewer"

    def __post_init__(self) -> None:
        check_digests(self.operator_tokens, "operator_tokens")
        check_digests(self.viewer_tokens, "viewer_tokens")


class ReconcileSettings(_Config):
    tick: Duration = Duration(5)
    # After a start, wait this long (or until every node seen before has registered) before
    # placing anything, so engines that agents report are adopted, not placed twice.
    settle: Duration = Duration(10)
    # After a restart (known nodes in state_dir) the wait ends when every known node is back, or
    # at this bound: agents reconnect with up to 30 s of backoff (agent backoff.max) after an
    # outage, and 10 s ended before the last of them was back (issue 41). The longer of this and
    # `settle` applies.
    settle_max: Duration = Duration(60)
    # Nodes a first start (no known nodes in state_dir yet) waits for, up to `settle`: a fleet
    # started together, like `llmgw demo`'s, spreads a model's replicas over all of it instead
    # of placing them on whichever node came first. Later starts wait for the known nodes.
    expect_nodes: list[str] = []
    backoff_initial: Duration = Duration(2)
    backoff_max: Duration = Duration(300)
    port_range: tuple[int, int] = (20000, 29999)

    def __post_init__(self) -> None:
        for i, node_id in enumerate(self.expect_nodes):
            problem = id_problem(node_id, "node id")
            if problem:
                raise ValueError(f"expect_nodes[{i}]: {problem}")


class PlacementSettings(_Config):
    """Spreading as a standing rule (issue 18): when 2 or more replicas of one model share a node
    (`leaves`: one leaf switch, where the fabric map knows the nodes' cables) and another ready,
    uncordoned node could take one, one is moved (successor ready first, then the old one
    drained), one move per model at a time, never while the model is below its desired ready
    count, and at most once per `spread_cooldown` per model so a flapping node causes no churn."""

    # YAML 1.1 reads a bare `off` as false: taken as "off" (`true` names no mode and is refused).
    spread: Literal["nodes", "leaves", "off"] | bool = "nodes"
    spread_cooldown: Duration = Duration(300)

    def __post_init__(self) -> None:
        if self.spread is True:
            raise ValueError("spread: true is not a mode; write nodes, leaves or off")
        if self.spread is False:
            self.spread = "off"

    @property
    def spread_mode(self) -> Literal["nodes", "leaves", "off"]:
        return "off" if isinstance(self.spread, bool) else self.spread


class FabricSettings(_Config):
    """The server's fabric map (issue 13): how often one healthy agent per fabric runs each tool."""

    discover_interval: Duration = Duration(300)  # ibnetdiscover
    sm_interval: Duration = Duration(60)  # saquery SMIR through one port per fabric
    # A tool still running then is killed by its agent. 600 s: libibnetdisc (rdma-core 691953d8d,
    # libibnetdisc/internal.h) keeps 2 SMPs on the wire with a 1000 ms timeout and 3 retries, so
    # each port that does not answer adds 2 s to an ibnetdiscover sweep: a few thousand nodes with
    # a hundred dead or hung ports take minutes (the old 60 s killed such sweeps every time).
    tool_timeout: Duration = Duration(600)
    # `ctl fabric-test`: each wait on an agent is a phase whose deadline is fixed when it starts:
    # the rail timeout plus test_grace; getting ib_write_bw ready (installing perftest) up to
    # test_install_wait (an agent's fabric_test.install_timeout, 600 s, and the grace), however
    # often the agent says "progress".
    test_grace: Duration = Duration(10)
    test_install_wait: Duration = Duration(660)


class RemedySettings(_Config):
    """A fleet that heals itself (issue 43): what doctor's node checks find takes GPUs and nodes
    out of service (server/remedy.py decides, server/remedy_service.py carries it out).

    `auto_remediate`: `off` (findings only in `ctl doctor`), `report` (a CRIT GPU is not placeable,
    and what `act` would cordon is an event, nothing else), `act` (cordon and move the affected
    replicas, successor ready first). The default is `report`: an upgrade must not start taking
    nodes out of a fleet whose operators never asked for it; the events show what `act` would do
    before anyone turns it on (Kubernetes' node-problem-detector also only reports until a taint
    controller is added; Slurm's NHC drains only where configured to)."""

    # YAML 1.1 reads a bare `off` as false: taken as "off".
    auto_remediate: Literal["off", "report", "act"] | bool = "report"
    # A finding must hold this many consecutive heartbeats before a node is cordoned: at the
    # default 5 s interval, 15 s; one bad reading (a driver hiccup) cordons nothing.
    hold: Positive = 3
    # A cordoned node (and an unplaceable GPU) returns only after its readings are clear this
    # long: 10 minutes outlasts a flapping link's up-down cycle (minutes) many times over.
    clear_after: Duration = Duration(600)
    # The fleet-wide budget: at most this many nodes auto-cordoned at once, and at most this
    # percentage of the fleet (never below one node); past it findings are only reported, so a
    # flapping switch cannot drain the cluster (draino and the GKE auto-repair limit likewise).
    max_nodes: NonNegative = 2
    max_percent: Annotated[float, msgspec.Meta(ge=0, le=100)] = 10.0
    # Checks whose CRIT findings concern the whole node (every replica there moves); the GPU
    # checks (gpu-health, nvlink) move only the replicas on the GPU. Empty: only a node whose
    # every GPU has a finding counts as node-wide.
    node_checks: list[str] = []

    def __post_init__(self) -> None:
        if self.auto_remediate is True:
            raise ValueError("auto_remediate: true is not a mode; write off, report or act")
        if self.auto_remediate is False:
            self.auto_remediate = "off"

    @property
    def mode(self) -> Literal["off", "report", "act"]:
        return "off" if isinstance(self.auto_remediate, bool) else self.auto_remediate


class EventSettings(_Config):
    # How long the event log (state_dir/events.db) keeps an event; pruned in the background.
    retention: Duration = Duration(14 * 86400)


class ServerConfig(_Config):
    listen: str = "127.0.0.1:8080"
    # Optional operator door: HOST:PORT serving /api/v1/* and /metrics (with public_tls, if
    # set); when set, the public port answers those paths 404 and serves only clients.
    admin_listen: str = ""
    fleet_listen: str = "0.0.0.0:8443"
    state_dir: str = "./llmgw-state"
    tls: TlsServer | None = None
    public_tls: TlsPublic | None = None
    fleet: FleetSettings = msgspec.field(default_factory=FleetSettings)
    reconcile: ReconcileSettings = msgspec.field(default_factory=ReconcileSettings)
    placement: PlacementSettings = msgspec.field(default_factory=PlacementSettings)
    gateway: GatewaySettings = msgspec.field(default_factory=GatewaySettings)
    api: ApiSettings = msgspec.field(default_factory=ApiSettings)
    fabric: FabricSettings = msgspec.field(default_factory=FabricSettings)
    events: EventSettings = msgspec.field(default_factory=EventSettings)
    remedy: RemedySettings = msgspec.field(default_factory=RemedySettings)  # reloadable (SIGHUP, ctl reload)
    models: list[Model] = []
    endpoints: list[StaticEndpoint] = []

    def __post_init__(self) -> None:
        names = Counter(m.name for m in self.models)  # not list.count: 3,000 models took 3 s that way
        dupes = sorted(n for n, count in names.items() if count > 1)
        if dupes:
            raise ValueError(f"duplicate model name {dupes[0]!r}")


class TlsClient(_Config):
    ca: str = ""
    cert: str = ""
    key: str = ""


class Backoff(_Config):
    initial: Duration = Duration(0.5)
    max: Duration = Duration(30)


class Discovery(_Config):
    sysfs_root: str = "/sys"
    # "nvml" (the real GPUs) or the path of a simulated inventory written by `llmgw sim node`.
    gpus: str = "nvml"
    # Where ibnetdiscover and saquery are looked for before PATH (`llmgw sim node --fabric`
    # writes stand-ins there); without both the agent does not offer fabric discovery.
    tools_dir: str = ""


class FabricTestSettings(_Config):
    """`ctl fabric-test` on this node: ib_write_bw is looked for in discovery.tools_dir, then PATH."""

    # Install perftest the first time a test needs ib_write_bw and it is missing, with apt-get or
    # dnf as /etc/os-release says (found on PATH; the agent must be allowed to install packages).
    install: bool = True
    os_release: str = "/etc/os-release"
    install_timeout: Duration = Duration(600)


class FabricDecl(_Config):
    name: str
    kind: Literal["infiniband", "roce", "ethernet"] = "infiniband"
    devices: list[str] = []  # the agent sends them as wire FabricDecls (fabric/declared.py's from_config)


class EngineHealth(_Config):
    """How the agent keeps checking an engine that is ready: `failures` health checks in a row
    that fail or get no answer within `timeout` report it `unhealthy` (with since when); one
    that passes reports it ready again."""

    interval: Duration = Duration(5)
    timeout: Duration = Duration(2)
    failures: Positive = 3


class EngineAllow(_Config):
    """What this agent runs, whatever the server asks (the server is not trusted to be root on
    every node). A Start outside it is a failed shard with the reason; nothing is launched."""

    # Engines it runs. `command` runs any argv the server sends, so it is off unless listed.
    engines: list[EngineKind] = msgspec.field(default_factory=lambda: ["vllm", "sglang", "sim"])
    # What an engine's argv[0] may be (the command engine's, and vllm's and sglang's own, as
    # resolved here; a Ray-mode replica also needs `ray` listed): a bare name, looked up on the
    # agent's own PATH (a profile cannot change PATH), or an absolute path (the same file, symlinks
    # resolved); shell-style wildcards allowed ("/opt/engines/*"). The simulated engine (this
    # agent's own Python) is always allowed.
    executables: list[str] = msgspec.field(default_factory=lambda: ["vllm", "python3"])
    # Environment keys a profile may not set: they change what runs (the dynamic loader, the
    # search path, the interpreter). Wildcards allowed.
    refuse_env: list[str] = msgspec.field(default_factory=lambda: ["PATH", "LD_*", "PYTHON*"])
    # Keys allowed even though refuse_env matches them.
    env: list[str] = msgspec.field(default_factory=lambda: ["PYTHONUNBUFFERED"])


class AgentConfig(_Config):
    server: str = ""  # https://control:8443 (or http:// with --insecure)
    node_id: str = ""  # default: the host name
    tls: TlsClient | None = None
    fabrics: list[FabricDecl] = []
    work_dir: str = "./llmgw-agent"
    # Where weights fetched from http(s) sources are kept (empty: WORK_DIR/models); a file
    # already there is used as is, nothing is fetched.
    model_cache: str = ""
    heartbeat_interval: Duration = Duration(5)
    # Every this many heartbeats the agent lists every shard it runs, so that the server's view
    # heals from a lost or misapplied status without a reconnect (0: never). 6 × 5 s: a
    # divergence lives at most half a minute, for a few kB per node per 30 s.
    resync_every: NonNegative = 6
    backoff: Backoff = msgspec.field(default_factory=Backoff)
    discovery: Discovery = msgspec.field(default_factory=Discovery)
    allow: EngineAllow = msgspec.field(default_factory=EngineAllow)
    # The address the gateway reaches engines on (the node's management address).
    advertise_host: str = "127.0.0.1"
    # Where engines listen; empty: advertise_host. Never every interface unless set so
    # (0.0.0.0 is allowed, with a warning at start): an engine's port is not the gateway's.
    bind_host: str = ""
    engine_health: EngineHealth = msgspec.field(default_factory=EngineHealth)
    fabric_test: FabricTestSettings = msgspec.field(default_factory=FabricTestSettings)
