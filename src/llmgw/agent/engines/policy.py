"""What this agent runs, whatever the server asks: its own allowlist (`allow:` in the agent
config). Without it a compromised control plane is root on every node: a profile's `env`
could set `LD_PRELOAD` or `PATH`, and the `command` engine runs any argv.

Checked before anything is launched; a refusal is a LaunchError (a failed shard) that names
the rule and the config key that would allow it.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import sys
from collections.abc import Mapping, Sequence

from llmgw.agent.engines.base import LaunchError
from llmgw.catalog.schema import EngineAllow


def check_engine(engine: str, allow: EngineAllow) -> None:
    if engine not in allow.engines:
        raise LaunchError(
            f"engine {engine!r} is not allowed on this node (its agent config's allow.engines: "
            f"{', '.join(allow.engines) or 'none'})"
        )


def check_env(env: Mapping[str, str], allow: EngineAllow) -> None:
    refused = sorted(key for key in env if env_refused(key, allow))
    if refused:
        raise LaunchError(
            f"profile env sets {', '.join(refused)}, which this node refuses (allow.refuse_env: "
            f"{', '.join(allow.refuse_env)}; a key listed in allow.env is let through)"
        )


def env_refused(key: str, allow: EngineAllow) -> bool:
    if key in allow.env:
        return False
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in allow.refuse_env)


def check_executable(engine: str, argv0: str, allow: EngineAllow) -> None:
    """argv[0] must be on allow.executables. The simulated engine runs this agent's own
    Python with fixed arguments, so it needs no entry."""
    if engine == "sim" and argv0 == sys.executable:
        return
    if not executable_allowed(argv0, allow.executables):
        raise LaunchError(
            f"{engine}: executable {argv0!r} is not allowed on this node (its agent config's allow.executables: "
            f"{', '.join(allow.executables) or 'none'})"
        )


def executable_allowed(argv0: str, allowed: Sequence[str]) -> bool:
    """A bare name matches bare-name entries (it is looked up on the agent's own PATH, which
    no profile can change). An absolute path matches a path entry (or pattern) as written,
    `..` folded, or by the file both resolve to; a bare-name entry allows the file that name
    resolves to here. A relative path (resolved against the work dir) matches nothing."""
    if os.sep not in argv0:
        return any(os.sep not in entry and fnmatch.fnmatchcase(argv0, entry) for entry in allowed)
    if not os.path.isabs(argv0):
        return False
    written = os.path.normpath(argv0)
    target = os.path.realpath(argv0)
    for entry in allowed:
        if os.sep in entry:
            if fnmatch.fnmatchcase(written, entry) or fnmatch.fnmatchcase(target, entry):
                return True
            if os.path.realpath(entry) == target:
                return True
        else:
            found = shutil.which(entry)
            if found is not None and os.path.realpath(found) == target:
                return True
    return False
