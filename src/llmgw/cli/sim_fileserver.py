"""`llmgw sim fileserver`: files over HTTP with Range, and the ways real servers misbehave."""

from __future__ import annotations

import click

from llmgw.catalog.units import parse_size
from llmgw.errors import unwrap


class _Size(click.ParamType):
    name = "size"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            return int(parse_size(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


SIZE = _Size()


@click.command()
@click.option("--root", required=True, type=click.Path(file_okay=False), help="Directory whose files are served.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="Port; 0 picks a free one. The address is printed as `llmgw-sim-fileserver listening on HOST:PORT`.")
@click.option("--drop-after", type=SIZE, default=0, help="Cut the connection after this many body bytes (e.g. 40MB).")
@click.option("--drops", type=click.IntRange(min=1), default=1, show_default=True,
              help="How many responses --drop-after cuts (the later ones are whole).")
@click.option("--no-length", is_flag=True, help="Send no Content-Length: the body ends when the connection closes.")
@click.option("--extra-length", type=SIZE, default=0,
              help="Announce this many bytes more than the file has (a lying server).")
@click.option("--ignore-range", is_flag=True, help="Answer every GET with the whole file (no Range support).")
@click.option("--rate", type=SIZE, default=0,
              help="Serve each response at most this many bytes per second (e.g. 16MB).")
@click.option("--validator", type=click.Choice(["etag", "last-modified", "none"]), default="etag", show_default=True,
              help="What the server offers for If-Range.")
@click.option("--redirect", "redirects", multiple=True, metavar="PATH=URL",
              help="Answer GET PATH with 302 to URL (repeatable): a CDN hand-off, or a redirect into the network.")
def fileserver(root: str, host: str, port: int, drop_after: int, drops: int, no_length: bool, extra_length: int,
               ignore_range: bool, rate: int, validator: str, redirects: tuple[str, ...]) -> None:
    """Serve the files under --root over HTTP/1.1 (GET, HEAD, Range, If-Range), for tests and the demo.

    \b
    Every request is logged on stdout: method, path, Range, If-Range and the status.
    SIGTERM or SIGINT stops it.
    """
    import trio

    from llmgw.sim.fileserver import (
        LISTENING_PREFIX,
        FileServerHandle,
        FileServerOptions,
        serve_files,
    )

    moved: dict[str, str] = {}
    for item in redirects:
        path, sep, url = item.partition("=")
        if not sep or not path.startswith("/") or not url:
            raise click.BadParameter(f"{item!r} is not PATH=URL (PATH starting with /)", param_hint="--redirect")
        moved[path] = url
    options = FileServerOptions(root=root, host=host, port=port, drop_after=drop_after, drops=drops,
                                no_length=no_length, extra_length=extra_length, ignore_range=ignore_range,
                                rate=float(rate), validator=validator, redirects=moved)

    def say(line: str) -> None:
        click.echo(line)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            handle: FileServerHandle = await nursery.start(
                lambda task_status: serve_files(options, log=say, task_status=task_status))
            say(f"{LISTENING_PREFIX} {handle.url.removeprefix('http://')}")

    try:
        trio.run(main)
    except BaseExceptionGroup as group:
        raise unwrap(group) from None
    except KeyboardInterrupt:
        pass
