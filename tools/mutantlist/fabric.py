"""The mutants of the fabric wave and later (code landed since 1 Dec, issue 37): at least one per
rule that decides something. Unit tests first; the e2e tests only where a rule lives in wiring
that only real processes reach (then a catch is reported as "e2e only")."""

from __future__ import annotations

from mutantlist.spec import Mutant

ANALYSIS = ("tests/unit/test_fabric_analysis.py", "tests/unit/test_fabric_real_dumps.py")
SUBNET = ("tests/unit/test_fabric_subnet.py",)
MULTI = ("tests/unit/test_placement_fabric.py", "tests/unit/test_placement_multi.py")
SPREAD = ("tests/unit/test_spread.py",)
FETCH = ("tests/unit/test_weights_fetch.py",)
DRAIN = ("tests/unit/test_drainer.py", "tests/unit/test_moves.py")
VERDICT = ("tests/unit/test_verdict.py", "tests/unit/test_doctor_checks.py")
PERFTEST = ("tests/unit/test_perftest.py",)
DOORS = ("tests/unit/test_api_doors.py",)
RENDER = ("tests/unit/test_ctl_render.py",)
REDIRECTS = ("tests/unit/test_redirects.py",)
SETTLING = ("tests/unit/test_settling.py",)
FEED = ("tests/unit/test_gateway_feed.py",)
AUTHZ = ("tests/unit/test_fleet_authz.py",)

# Every route of the API behind the other door (issue 37: "the doors of every route"). Named
# here, not read from api.py, so a route that moves or changes its door fails the list check.
ROUTES = (
    ("GET", "nodes"), ("GET", "nodes/{node}"), ("GET", "replicas"), ("GET", "replicas/{replica}"), ("GET", "models"),
    ("GET", "endpoints"), ("GET", "fabrics"), ("GET", "fabrics/{fabric}"), ("GET", "fabrics/{fabric}/topology"),
    ("GET", "events"), ("GET", "doctor"), ("GET", "gateways"), ("GET", "replicas/{replica}/logs"),
    ("GET", "nodes/{node}/drain"), ("POST", "reload"), ("DELETE", "nodes/{node}"),
    ("POST", "replicas/{replica}/restart"),
    ("POST", "nodes/{node}/cordon"), ("POST", "nodes/{node}/uncordon"), ("POST", "nodes/{node}/drain"),
    ("POST", "fabric-tests"),
)


def _door(method: str, path: str) -> Mutant:
    door, other = ("VIEWER", "OPERATOR") if method == "GET" else ("OPERATOR", "VIEWER")
    name = "door-" + method.lower() + "-" + path.replace("/", "-").replace("{", "").replace("}",
                                                                                            "") + "-" + other.lower()
    return Mutant(name, "src/llmgw/server/api.py", f'ApiRoute("{method}", "{path}", Door.{door},',
                  f'ApiRoute("{method}", "{path}", Door.{other},', DOORS)


FABRIC: tuple[Mutant, ...] = (
    # -- fabric analysis: tiers, degraded cables, rails; subnet managers ------------------------
    Mutant(
        "fabric-tier-one-up",
        "src/llmgw/fabric/analysis.py",
        'return TIER_NAMES[level] if level < len(TIER_NAMES) else "core"',
        'return TIER_NAMES[level + 1] if level + 1 < len(TIER_NAMES) else "core"',
        ANALYSIS,
    ),
    Mutant(
        "fabric-narrow-cable-not-degraded",
        "src/llmgw/fabric/analysis.py",
        "if width and width_norm and width < width_norm:",
        "if False:",
        ANALYSIS,
    ),
    Mutant(
        "fabric-slow-cable-not-degraded",
        "src/llmgw/fabric/analysis.py",
        "if speed is not None and speed_norm is not None and speed < speed_norm:",
        "if False:",
        ANALYSIS,
    ),
    Mutant(
        "fabric-parallel-links-not-compared",
        "src/llmgw/fabric/analysis.py",
        "if id(link) not in found and _rank(link) < _rank(best):",
        "if False:",
        ANALYSIS,
    ),
    Mutant(
        "fabric-kind-norm-from-too-few-links",
        "src/llmgw/fabric/analysis.py",
        "w = _norm(widths[kind]) if len(widths[kind]) >= MIN_NORM else fabric_width",
        "w = _norm(widths[kind]) if len(widths[kind]) >= 1 else fabric_width",
        ANALYSIS,
    ),
    Mutant(
        "fabric-leaf-rail-least-common",
        "src/llmgw/fabric/analysis.py",
        "leaf_rail = {leaf: min(r for r, c in counts.items() if c == max(counts.values()))",
        "leaf_rail = {leaf: min(r for r, c in counts.items() if c == min(counts.values()))",
        ANALYSIS,
    ),
    Mutant(
        "fabric-rails-without-a-fit",
        "src/llmgw/fabric/analysis.py",
        "if len(matched) <= RAIL_FIT * len(entries) or len(set(leaf_rail.values())) < 2:",
        "if len(set(leaf_rail.values())) < 2:",
        ANALYSIS,
    ),
    Mutant(
        "subnet-sms-of-one-port-not-joined",
        "src/llmgw/fabric/subnet.py",
        "        for guid in guids[1:]:\n            parent[find(guid)] = find(guids[0])\n    # A GUID",
        "        pass\n    # A GUID",
        SUBNET,
    ),
    Mutant(
        "subnet-failover-renames-the-fabric",
        "src/llmgw/fabric/subnet.py",
        "name = min(names) if names else min(group)",
        "name = min(group)",
        SUBNET,
    ),
    # -- multi-node placement across the fabric ---------------------------------------------
    Mutant(
        "placement-spine-smaller-leaf-first",  # issue 37's first miss: 2+2 instead of 3+1
        "src/llmgw/placement/multi.py",
        "return (bool(c.short), not c.levels, -below.get(sub, 0), lowest.get(sub, c.entry[0]), c.entry[0])",
        "return (bool(c.short), not c.levels, below.get(sub, 0), lowest.get(sub, c.entry[0]), c.entry[0])",
        MULTI,
    ),
    Mutant(
        "placement-short-cable-not-last-in-a-leaf",
        "src/llmgw/placement/multi.py",
        "return sorted(members, key=lambda c: (bool(c.short), c.entry[0]))[:count]",
        "return sorted(members, key=lambda c: c.entry[0])[:count]",
        MULTI,
    ),
    Mutant(
        "placement-short-cables-not-counted",
        "src/llmgw/placement/multi.py",
        "score = (sum(1 for c in chosen if c.short), tier, sum(c.entry[0][0] for c in chosen),",
        "score = (0, tier, sum(c.entry[0][0] for c in chosen),",
        MULTI,
    ),
    Mutant(
        "placement-higher-tier-first",
        "src/llmgw/placement/multi.py",
        "for tier in range(depth + 1):  # tier == depth",
        "for tier in reversed(range(depth + 1)):  # tier == depth",
        MULTI,
    ),
    Mutant(
        "placement-master-without-an-address",
        "src/llmgw/placement/multi.py",
        "if free is not None and node.address:",
        "if free is not None:",
        MULTI,
    ),
    # -- spread ------------------------------------------------------------------------------
    Mutant(
        "spread-ping-pong",
        "src/llmgw/placement/spread.py",
        "counts[domain_of(n, n.node_id, mode)] + 2 <= top",
        "counts[domain_of(n, n.node_id, mode)] + 1 <= top",
        SPREAD,
    ),
    Mutant(
        "spread-no-cooldown",
        "src/llmgw/placement/spread.py",
        "return model.last_move_at is None or now - model.last_move_at >= cooldown",
        "return True",
        SPREAD,
    ),
    Mutant(
        "spread-deepens-an-outage",
        "src/llmgw/placement/spread.py",
        "if sum(1 for r in model.replicas if r.ready) < model.desired:",
        "if False:",
        SPREAD,
    ),
    Mutant(
        "spread-two-moves-of-a-model",
        "src/llmgw/placement/spread.py",
        "if model.moving or model.desired < 2:",
        "if model.desired < 2:",
        SPREAD,
    ),
    # -- weights: fetch, resume, single flight, progress -------------------------------------
    Mutant(
        "fetch-rename-before-sha256",  # issue 37's second miss: a bad file under the model's name
        "src/llmgw/agent/fetch.py",
        "    if digest is not None and digest.hexdigest() != sha256.lower():\n"
        "        _discard(entry, partial, meta)\n"
        "        raise FetchError(Reason.CHECKSUM,",
        "    entry.publish(partial.name, target.name)\n"
        "    partial = target  # what a mismatch removes is now the file under the model's name\n"
        "    if digest is not None and digest.hexdigest() != sha256.lower():\n"
        "        _discard(entry, partial, meta)\n"
        "        raise FetchError(Reason.CHECKSUM,",
        ("tests/unit/test_weights_verify.py",),
    ),
    Mutant(
        "fetch-resume-starts-over",
        "src/llmgw/agent/fetch.py",
        "if offset > 0 and record is not None:",
        "if False:",
        FETCH,
    ),
    Mutant(
        "fetch-200-appends-to-the-partial-file",
        "src/llmgw/agent/fetch.py",
        "offset = 0  # the whole file: the server ignored Range",
        "pass  # the whole file: the server ignored Range",
        FETCH,
    ),
    Mutant(
        "weights-two-downloads-of-one-file",
        "src/llmgw/agent/weights.py",
        "key = (plan.url, plan.sha256)",
        "key = (plan.url, plan.sha256, trio.current_time())  # a key of each shard's own",
        FETCH,
    ),
    Mutant(
        "progress-not-cleared-on-a-state-change",  # issue 37's third miss (the hollow assert)
        "src/llmgw/server/control.py",
        "self.weights.clear(msg.shard_id)  # a real state change",
        "pass  # a real state change",
        ("tests/unit/test_weights_board.py",),
    ),
    # -- drain -------------------------------------------------------------------------------
    Mutant(
        "drain-two-moves-at-a-time",
        "src/llmgw/server/drain.py",
        "if any(mv is not None and mv.state not in MOVE_ENDED for mv in moves):\n        return None",
        "if False:\n        return None",
        DRAIN,
    ),
    Mutant(
        "drain-before-the-gateway-let-go",
        "src/llmgw/server/moves.py",
        "replica.out_of_rotation = replica.state != ReplicaState.READY  # never in rotation",
        "replica.out_of_rotation = True  # never in rotation",
        DRAIN,
    ),
    Mutant(
        "drain-cuts-requests-in-flight",
        "src/llmgw/server/moves.py",
        "self.stop_replica(replica, now, replica.reason, drain=True)",
        "self.stop_replica(replica, now, replica.reason, drain=False)",
        DRAIN,
    ),
    # -- doctor's severity and exit codes --------------------------------------------------------
    Mutant(
        "verdict-warn-outranks-crit",
        "src/llmgw/verdict.py",
        "Status.WARN: 2, Status.CRIT: 3}",
        "Status.WARN: 3, Status.CRIT: 2}",
        VERDICT,
    ),
    Mutant(
        "verdict-unknown-outranks-warn",
        "src/llmgw/verdict.py",
        "Status.UNKNOWN: 1, Status.WARN: 2,",
        "Status.UNKNOWN: 2, Status.WARN: 1,",
        VERDICT,
    ),
    Mutant(
        "verdict-crit-exits-1",
        "src/llmgw/verdict.py",
        "Status.WARN: EXIT_WARN, Status.CRIT: EXIT_CRIT}",
        "Status.WARN: EXIT_WARN, Status.CRIT: EXIT_WARN}",
        VERDICT,
    ),
    Mutant(
        "ctl-doctor-exits-0",
        "src/llmgw/cli/doctor.py",
        'sys.exit(int(data["exit_code"]))',
        "sys.exit(0)",
        (),
        ("tests/e2e/test_doctor.py::test_doctor_local_reads_a_simulated_node_as_its_agent_would",),
    ),
    # -- perftest read by heading ------------------------------------------------------------------
    Mutant(
        "perftest-first-bw-column",
        "src/llmgw/fabric/perftest.py",
        'average_at = _column(columns, "bw average")',
        'average_at = _column(columns, "bw")',
        PERFTEST,
    ),
    Mutant(
        "perftest-iterations-by-position",
        "src/llmgw/fabric/perftest.py",
        'iters_at = _column(columns, "#iterations")',
        "iters_at = 1",
        PERFTEST,
    ),
    # -- the doors of the API --------------------------------------------------------------------
    Mutant(
        "door-of-the-route-not-checked",
        "src/llmgw/server/api.py",
        "door = found[0].door if found else",
        "door = Door.VIEWER if found else",
        DOORS,
        ("tests/e2e/test_doors.py::test_every_route_stands_behind_its_door",),
    ),
    # -- ctl's rendering of what peers send ---------------------------------------------------------
    Mutant(
        "ctl-json-unescaped",
        "src/llmgw/cli/render.py",
        "sys.stdout.write(json_text(encoded))",
        "sys.stdout.write(encoded)",
        RENDER,
    ),
    Mutant(
        "ctl-table-cell-as-markup",
        "src/llmgw/cli/render.py",
        "    return text(cell)\n",
        "    return str(cell)\n",
        RENDER,
    ),
    # -- control-plane wiring, ownership, the gateway feed, redirects, settling -------------------
    Mutant(
        "register-with-nothing-not-compared",  # the seed's lesson: the caller never called it
        "src/llmgw/server/control.py",
        "        self._refused(self.reconciler.on_register(node_id, msg.shards,",
        "        if msg.shards:\n            self._refused(self.reconciler.on_register(node_id, msg.shards,",
        ("tests/unit/test_fleet_register.py",),
    ),
    Mutant(
        "node-speaks-for-another-nodes-shard",
        "src/llmgw/server/observe.py",
        "        if shard.node == node_id:\n            return None\n        return Refusal(",
        "        if True:\n            return None\n        return Refusal(",
        AUTHZ,
    ),
    Mutant(
        "gateway-feed-any-family",
        "src/llmgw/server/gwfeed.py",
        "if allowed is None or allowed[0] != family.type:",
        "if allowed is None:",
        FEED,
    ),
    Mutant(
        "redirect-domain-suffix-without-a-dot",
        "src/llmgw/catalog/redirects.py",
        "return host.endswith(name[1:]) and len(host) > len(name) - 1",
        "return host.endswith(name[2:])",
        REDIRECTS,
    ),
    Mutant(
        "redirect-to-any-scheme",
        "src/llmgw/catalog/redirects.py",
        "if target.scheme not in DEFAULT_PORTS:",
        "if False:",
        REDIRECTS,
    ),
    Mutant(
        "settle-ends-before-every-known-node-is-back",
        "src/llmgw/server/settling.py",
        "if self.awaited and not self.awaited - connected:",
        "if self.awaited and len(self.awaited - connected) <= 1:",
        SETTLING,
    ),
    Mutant(
        "settle-restart-bound-is-settle",
        "src/llmgw/server/settling.py",
        "self.bound = max(settle, settle_max) if self.rejoining else settle",
        "self.bound = settle",
        SETTLING,
    ),
    Mutant(
        "server-drains-never-move",  # the composition root: the drainer looks after every pass
        "src/llmgw/server/app.py",
        "self.event_feeds.after_pass,\n                          self.drainer.after_pass),",
        "self.event_feeds.after_pass),",
        ("tests/unit/test_composition_passes.py",),
    ),
    *(_door(method, path) for method, path in ROUTES),
)
