"""A TCP relay that adds a fixed one-way delay: every chunk read from either side is written to
the other side `--delay-ms` later (order kept, throughput not limited by the delay).

    python bench/delay_relay.py --delay-ms 2 20000:10.211.0.1:20000 20001:10.211.0.2:20001

Each mapping LISTEN_PORT:HOST:PORT listens on 0.0.0.0:LISTEN_PORT and forwards to HOST:PORT. It
emulates link latency where `tc netem` is unavailable. With `--dynamic PORT` the relay also
listens on PORT for connections that name their destination in a 6-byte header (IPv4 address and
port, network byte order): what bench/native/relay_connect.c sends for a task's direct
connections (Horovod's Gloo). Prints `READY` once every port listens.
"""
import argparse
import asyncio
import socket
import struct
import sys

CHUNK = 1 << 16


def _no_delay(writer):
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _pump(reader, writer, delay):
    """Copies reader to writer, each chunk released `delay` seconds after it arrived."""
    loop = asyncio.get_running_loop()
    queue = asyncio.Queue()

    async def release():
        while True:
            due, data = await queue.get()
            if data is None:
                break
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()

    sender = asyncio.create_task(release())
    try:
        while True:
            data = await reader.read(CHUNK)
            if not data:
                break
            queue.put_nowait((loop.time() + delay, data))
    except (ConnectionError, OSError):
        pass
    finally:
        queue.put_nowait((0.0, None))
        try:
            await sender
        except (ConnectionError, OSError):
            pass


async def _serve(listen_port, host, port, delay):
    """Listens on `listen_port` and relays each connection to `host:port` (both None: to the
    destination named by the connection's 6-byte header)."""
    async def handle(client_reader, client_writer):
        try:
            if host is None:
                header = await client_reader.readexactly(6)
                destination = (socket.inet_ntoa(header[:4]), struct.unpack("!H", header[4:])[0])
            else:
                destination = (host, port)
            server_reader, server_writer = await asyncio.open_connection(*destination)
        except (OSError, asyncio.IncompleteReadError):
            client_writer.close()
            return
        _no_delay(client_writer)
        _no_delay(server_writer)
        await asyncio.gather(_pump(client_reader, server_writer, delay),
                             _pump(server_reader, client_writer, delay))
        client_writer.close()
        server_writer.close()

    return await asyncio.start_server(handle, "0.0.0.0", listen_port)


async def _main(mappings, delay, dynamic_port=None):
    servers = [await _serve(*m, delay) for m in mappings]
    if dynamic_port:
        servers.append(await _serve(dynamic_port, None, None, delay))
    print("READY", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def parse_mapping(text):
    """LISTEN_PORT:HOST:PORT -> (listen_port, host, port)."""
    parts = text.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[2].isdigit():
        raise argparse.ArgumentTypeError("expected LISTEN_PORT:HOST:PORT, got %r" % text)
    return int(parts[0]), parts[1], int(parts[2])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("--dynamic", type=int, default=None, metavar="PORT",
                        help="also relay connections whose destination is in a 6-byte header")
    parser.add_argument("mappings", nargs="*", type=parse_mapping)
    args = parser.parse_args()
    if not args.mappings and not args.dynamic:
        parser.error("give at least one LISTEN_PORT:HOST:PORT mapping or --dynamic PORT")
    try:
        asyncio.run(_main(args.mappings, args.delay_ms / 1000.0, args.dynamic))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
