"""A TCP relay that adds a fixed one-way delay: every chunk read from either side is written to
the other side `--delay-ms` later (order kept, throughput not limited by the delay).

    python bench/delay_relay.py --delay-ms 2 20000:10.211.0.1:20000 20001:10.211.0.2:20001

Each mapping LISTEN_PORT:HOST:PORT listens on 0.0.0.0:LISTEN_PORT and forwards to HOST:PORT. It
emulates link latency where `tc netem` is unavailable. With `--dynamic PORT` the relay also
listens on PORT for connections that name their destination in a 6-byte header (IPv4 address and
port, network byte order): what bench/native/relay_connect.c sends for a task's direct
connections (Horovod's Gloo). Prints `READY` once every port listens.

The relay itself is native (`native/delay_relay.c`, built with gcc on first use and cached): it
shares the benchmark's cores with the tasks and every byte they exchange crosses it twice, so
it must cost them as little CPU as a real link would (the asyncio relay it replaced spent Python
time on every chunk).
"""
import argparse
import os
import sys

import native_build


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
    if args.delay_ms < 0:
        parser.error("--delay-ms must be >= 0, got %r" % args.delay_ms)
    relay = native_build.build("delay_relay")
    argv = [relay, "--delay-ms", repr(args.delay_ms)]
    if args.dynamic:
        argv += ["--dynamic", str(args.dynamic)]
    argv += ["%d:%s:%d" % mapping for mapping in args.mappings]
    sys.stdout.flush()
    os.execv(relay, argv)


if __name__ == "__main__":
    main()
