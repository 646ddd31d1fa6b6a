"""Generate completions/ (bash, zsh, fish) and man/ (one page per command) from the CLI.

`make docs` writes them; tests/unit/test_generated_docs.py fails when they are out of date,
so a changed flag or help text cannot ship with stale completion scripts or man pages.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
SHELLS = {"bash": "llmgw.bash", "zsh": "_llmgw", "fish": "llmgw.fish"}


def completion_scripts() -> dict[str, str]:
    out = {}
    for shell, name in SHELLS.items():
        env = dict(os.environ, _LLMGW_COMPLETE=f"{shell}_source")
        result = subprocess.run([sys.executable, "-m", "llmgw"], env=env, capture_output=True, text=True, check=True)
        # `python -m llmgw` names itself after the module; the installed command is `llmgw`.
        out[name] = result.stdout
    return out


def _roff(text: str) -> str:
    lines = []
    for line in text.replace("\\", "\\\\").splitlines():
        line = line.replace("\b", "").rstrip()
        if line.startswith((".", "'")):
            line = "\\&" + line
        lines.append(line)
    return "\n".join(lines)


def _walk(command: click.Command, path: list[str]) -> list[tuple[list[str], click.Command]]:
    out = [(path, command)]
    if isinstance(command, click.Group):
        ctx = click.Context(command, info_name=path[-1])
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                out += _walk(sub, [*path, name])
    return out


def _completion_section(command: click.Command, ctx: click.Context) -> list[str]:
    """COMPLETION: what each argument completes at TAB beyond the CLI's own words (a callback of
    llmgw.cli.complete says it in its `what`), and how names are asked of the server."""
    from llmgw.cli import candidates

    lines, asks = [], False
    for param in command.get_params(ctx):
        # click keeps the shell_complete= callback here; ours carry the sentence for this page.
        found = getattr(param, "_custom_shell_complete", None)
        what = getattr(found, "what", None)
        if what is None:
            continue
        name = param.human_readable_name if isinstance(param, click.Argument) else param.opts[-1]
        lines.append(f"{name}: {what}.")
        asks = asks or getattr(found, "asks_server", False)
    if not lines:
        return []
    note = ("Names the server knows are asked with the --server, --token, --cert, --key and --ca given to llmgw ctl "
            f"(or LLMGW_SERVER, LLMGW_TOKEN, LLMGW_CERT, LLMGW_KEY, LLMGW_CA): one read-only GET, at most "
            f"{candidates.TIMEOUT:g} s, kept {candidates.TTL:g} s in a private file under ~/.cache/llmgw/complete "
            "($XDG_CACHE_HOME). A server that cannot answer offers nothing, and nothing is printed.")
    return [".SH COMPLETION", "With the bash, zsh or fish completion scripts (completions/), TAB completes",
            ".nf", *(_roff(line) for line in lines), ".fi", *([_roff(note)] if asks else [])]


def _first_sentence(text: str) -> str:
    """The help's first sentence, whole (a NAME line cut at the first line's end read "… counters
    (hw_counters as"): its first paragraph joined, up to the first full stop."""
    paragraph = " ".join(line.strip() for line in text.strip().split("\n\n")[0].splitlines() if line.strip() != "\b")
    depth = 0
    for i, char in enumerate(paragraph):  # the first ". " or ": " outside parentheses ends it
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and char in ".:" and paragraph[i + 1:i + 2] in (" ", ""):
            return paragraph[:i].strip()
    return paragraph.strip().rstrip(".")


def _exit_status(command: click.Command, path: list[str]) -> list[str]:
    from llmgw.cli.render import NagiosCommand

    if isinstance(command, NagiosCommand):
        text = ("As a Nagios plugin: 0 all ok, 1 a warning, 2 a critical finding, 3 could not run (the server "
                "unreachable or refusing the credential, bad usage).")
    elif path[:2] == ["llmgw", "ctl"] and "cert" not in path:
        text = "0 ok, 1 failed (refused, or what was asked did not happen), 2 bad usage, 3 the server unreachable."
    else:
        text = ("0 ok (or a clean stop on SIGTERM or Ctrl-C), 1 an error, said in one line, 2 bad usage or a bad "
                "config file.")
    return [".SH EXIT STATUS", _roff(text)]


def _environment(command: click.Command, ctx: click.Context) -> list[str]:
    """The variables that stand in for this command's options and its parents' (ctl's --server …)."""
    found: dict[str, str] = {}
    scope: click.Context | None = ctx
    while scope is not None:
        for param in scope.command.get_params(scope):
            if isinstance(param, click.Option) and param.envvar and not param.hidden:
                names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar)
                for name in names:
                    found.setdefault(name, max(param.opts, key=len))
        scope = scope.parent
    lines = [".SH ENVIRONMENT"]
    for name, opt in sorted(found.items()):
        lines += [".TP", f".B {name}", _roff(f"stands in for {opt}")]
    lines += [".TP", ".B NO_COLOR", "set and not empty: no colour, even at a terminal"]
    return lines


def man_pages() -> dict[str, str]:
    from llmgw import __version__
    from llmgw.cli.main import cli

    pages = {}
    for path, command in _walk(cli, ["llmgw"]):
        name = "-".join(path)
        title = name.upper()
        ctx = click.Context(cli, info_name="llmgw", help_option_names=["-h", "--help"])
        for part in path[1:]:
            sub = ctx.command.get_command(ctx, part)  # type: ignore[attr-defined]
            ctx = click.Context(sub, info_name=part, parent=ctx, help_option_names=["-h", "--help"])
        usage = " ".join(path) + " " + " ".join(command.collect_usage_pieces(ctx))
        summary = command.short_help or _first_sentence(command.help or "")
        lines = [
            f'.TH "{title}" "1" "" "llmgw {__version__}" "llmgw manual"',
            ".SH NAME",
            f"{name} \\- {_roff(summary)}",
            ".SH SYNOPSIS",
            f".B {_roff(usage.strip())}",
            ".SH DESCRIPTION",
            ".nf",
            _roff(command.help or summary),
            ".fi",
        ]
        params = [p for p in command.get_params(ctx) if isinstance(p, click.Option) and not p.hidden]
        if params:
            lines.append(".SH OPTIONS")
            for param in params:
                record = param.get_help_record(ctx)
                if record is None:
                    continue
                opts, help_text = record
                lines += [".TP", f".B {_roff(opts)}", _roff(help_text)]
        lines += _completion_section(command, ctx)
        lines += _exit_status(command, path)
        lines += _environment(command, ctx)
        if isinstance(command, click.Group):
            lines.append(".SH COMMANDS")
            for sub in command.list_commands(ctx):
                lines += [".TP", f".B {sub}", f"See \\fB{name}-{sub}\\fR(1)."]
        lines += [".SH SEE ALSO", "\\fBllmgw\\fR(1)", ""]
        pages[f"{name}.1"] = "\n".join(lines)
    return pages


def main() -> None:
    (ROOT / "completions").mkdir(exist_ok=True)
    (ROOT / "man").mkdir(exist_ok=True)
    for name, text in completion_scripts().items():
        (ROOT / "completions" / name).write_text(text)
    stale = {p.name for p in (ROOT / "man").glob("*.1")}
    for name, text in man_pages().items():
        (ROOT / "man" / name).write_text(text)
        stale.discard(name)
    for name in stale:
        (ROOT / "man" / name).unlink()
    print(f"wrote {len(SHELLS)} completion scripts and {len(man_pages())} man pages")


if __name__ == "__main__":
    main()
