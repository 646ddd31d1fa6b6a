"""The modules a plain gateway request runs through, compiled to C with mypyc by a regular
install (setup.py): the wheel `make test` builds, installs and runs the suite and benches on.

Compiled, the gateway serves about twice the requests per core (issue 17: 74-84 -> 35-42 µs
of CPU a request, bench-gateway's setup). An editable install, or one without a C compiler,
runs these same modules as Python: slower, never different. This file imports nothing: setup.py
reads it before anything is installed.
"""

# Tried and left out: llmgw.web.relayhub, the streamed-token loop. Compiled, it read 35.0 -> 34.4
# µs of gateway CPU a relayed chunk (3 Dec, 200 streams x 200 tokens, 6 rounds interleaved A/B):
# a chunk's cost is its read, write and trio's wait, which compiling does not touch.
COMPILED = (
    "llmgw.web.http1",
    "llmgw.web.reactor",
    "llmgw.web.fastserve",
    "llmgw.web.fastclient",
    "llmgw.server.metrics",
    "llmgw.server.gateway.metrics",
    "llmgw.server.gateway.fastlane",
    "llmgw.server.gateway.attempt",
    "llmgw.server.gateway.balance",
    "llmgw.server.gateway.admission",
    "llmgw.server.gateway.breaker",
    "llmgw.server.gateway.retry",
)

# mypyc must know every module the compiled ones import: a class or call it cannot see is built
# against `Any`, and a compiled class whose base it could not see corrupted the interpreter at
# start (issue 36: a pip install built server.metrics without prometheus_client). So no
# --ignore-missing-imports: an unknown import fails the build (setup.py then installs pure, with a
# warning), and the build requirements (pyproject.toml) carry the import closure of COMPILED. The
# modules they import but that are not compiled are read for their types, not held to mypy's
# errors (`make lint` holds them); the untyped ones are listed in pyproject's [tool.mypy].
MYPYC_FLAGS = ("--follow-imports=silent",)


def mypyc_args(root: str) -> list[str]:
    """mypyc's command line for COMPILED, their files under `root` (the directory holding llmgw/)."""
    return [*MYPYC_FLAGS, *(f"{root}/{name.replace('.', '/')}.py" for name in COMPILED)]


def compiled() -> list[str]:
    """The modules of COMPILED this interpreter would load from a compiled extension."""
    import importlib.machinery
    import importlib.util

    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    found = []
    for name in COMPILED:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin is not None and spec.origin.endswith(suffixes):
            found.append(name)
    return found


def summary() -> str:
    """One phrase for `llmgw --version` and the start-up log."""
    n = len(compiled())
    if n:
        return f"hot path compiled ({n} of {len(COMPILED)} modules)"
    return "hot path pure Python (an editable or compiler-less install: about half the gateway's throughput)"
