"""An emulated network for multi-worker benchmarks: every task in its own network namespace,
joined by veth pairs to a bridge, with `tc tbf` rate limits and an optional link delay.

`tc netem` is missing from this kernel, so the delay is a TCP relay (`delay_relay.py`) in the hub
namespace: each task's advertised address is a relay port that forwards to the task with a fixed
delay each way, so every message between two tasks crosses two rate-limited veth links and is
delayed twice (once in each relay direction: one-way latency ~= delay). Connections a task makes
directly to another task's own address (Horovod's Gloo ranks connect to the addresses they
publish) are sent through the same relay by a preloaded `connect()` interposer
(`native/relay_connect.c`, see `relay_env`), so they are delayed too. Every task's interface is
named `TASK_INTERFACE`, and a veth joins this (root) namespace to the bridge at `HOST_ADDRESS`
(where tasks reach a Horovod rendezvous). Needs root. Everything is created on entry and removed
on exit.

    with EmulatedNetwork({"worker": 2}, delay_ms=1.0, rate="1gbit") as net:
        run_program(argv, workers=2, launcher_flags=net.launcher_flags())
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import native_build

HERE = os.path.dirname(os.path.abspath(__file__))
SUBNET = "10.211.0"
HUB_ADDRESS = SUBNET + ".254"
HOST_ADDRESS = SUBNET + ".253"  # this (root) namespace on the bridge
HOST_LINK = "npbhost"
TASK_INTERFACE = "npb0"  # every task's veth end, inside its own namespace
BASE_PORT = 21000
PROBE_PORT = 21900  # relayed to the last task's namespace for `round_trip_ms` (not a task port)
DYNAMIC_PORT = 21901  # the relay port of direct task-to-task connections (relay_connect.c)
# Behind the relay, worker k's socket mesh listens on MESH_BASE_PORT + k on every interface of
# its namespace and the relay forwards the hub's port to it: the mesh dials the TF_CONFIG host
# (here the relay's) at the port each worker announced.
MESH_BASE_PORT = 22000
MAX_RELAYED_WORKERS = 10  # the task prefix writes the port as "2200{index}"
NETNS_ETC = "/etc/netns"


def relay_connect_library():
    """Builds (once per source version) and returns the path of the connect() interposer."""
    return native_build.build("relay_connect", shared=True)


def _ip(*args, namespace=None, check=True):
    command = (["ip", "netns", "exec", namespace] if namespace else []) + list(args)
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if check and result.returncode != 0:
        raise RuntimeError("%s failed: %s" % (" ".join(command), result.stdout.strip()))
    return result


# `tc tbf`'s bucket. After an idle spell this many bytes leave at once, faster than the rate, so
# an exchange smaller than it costs less than its bytes' time at the rate
# (bench/exposed_exchange.py measures both sizes); a smaller bucket reaches the rate only with
# more of the qdisc's timer work, which runs on the tasks' own cores.
TBF_BURST = "256kb"


class EmulatedNetwork:
    """Namespaces `{prefix}_{role}{index}` for the tasks in `tasks` (role -> count), a hub
    namespace with a bridge, a `tbf` rate limit on both ends of each veth, and (if `delay_ms`)
    the delaying relay. `cluster` holds the addresses to put in TF_CONFIG."""

    def __init__(self, tasks, delay_ms=0.0, rate="1gbit", prefix="npb", burst=TBF_BURST):
        self.tasks = [(role, index) for role in ("chief", "worker", "ps")
                      for index in range(int(tasks.get(role, 0)))]
        self.delay_ms = float(delay_ms)
        self.rate = rate
        self.burst = burst
        self.prefix = prefix
        self.hub = prefix + "_hub"
        self.cluster = {}
        self._relay = None

    def namespace(self, role, index):
        """The network namespace of one task."""
        return "%s_%s%d" % (self.prefix, role, index)

    def launcher_flags(self, horovod=False):
        """Flags for `python -m tf_nestpipe.launch` that run the tasks in their namespaces (with
        `horovod`: Horovod's rendezvous on this namespace's bridge address, Gloo on the task
        interface)."""
        prefix = "ip netns exec %s_{role}{index}" % self.prefix
        if self.delay_ms > 0:  # the socket mesh behind the relay (MESH_BASE_PORT)
            prefix += (" env TF_NESTPIPE_TRANSPORT_LISTEN_HOST=0.0.0.0 "
                       "TF_NESTPIPE_TRANSPORT_PORT=%d{index}" % (MESH_BASE_PORT // 10))
        flags = ["--cluster-spec", json.dumps(self.cluster), "--task-prefix", prefix]
        if horovod:
            flags += ["--horovod", "--horovod-address", HOST_ADDRESS,
                      "--horovod-interface", TASK_INTERFACE]
        return flags

    def relay_env(self):
        """Environment for the launcher (inherited by its tasks) that sends the tasks' direct
        connections through the delaying relay; empty when there is no delay."""
        if self._relay is None:
            return {}
        preload = os.environ.get("LD_PRELOAD", "")
        return {"LD_PRELOAD": relay_connect_library() + (":" + preload if preload else ""),
                "NESTPIPE_RELAY_SUBNET": SUBNET + ".", "NESTPIPE_RELAY_ADDRESS": HUB_ADDRESS,
                "NESTPIPE_RELAY_PORT": str(DYNAMIC_PORT), "NESTPIPE_RELAY_EXCLUDE": HOST_ADDRESS}

    def _namespaces(self):
        return [self.hub] + [self.namespace(r, i) for r, i in self.tasks]

    def _limit(self, device, namespace):
        if self.rate:
            _ip("tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", self.rate,
                "burst", self.burst, "latency", "100ms", namespace=namespace)

    def __enter__(self):
        self._remove()  # leftovers of an interrupted run
        _ip("ip", "netns", "add", self.hub)
        _ip("ip", "link", "set", "lo", "up", namespace=self.hub)
        _ip("ip", "link", "add", "br0", "type", "bridge", namespace=self.hub)
        _ip("ip", "addr", "add", HUB_ADDRESS + "/24", "dev", "br0", namespace=self.hub)
        _ip("ip", "link", "set", "br0", "up", namespace=self.hub)
        _ip("ip", "link", "add", HOST_LINK, "type", "veth", "peer", "name", "npbhub")
        _ip("ip", "link", "set", "npbhub", "netns", self.hub)
        _ip("ip", "addr", "add", HOST_ADDRESS + "/24", "dev", HOST_LINK)
        _ip("ip", "link", "set", HOST_LINK, "up")
        _ip("ip", "link", "set", "npbhub", "master", "br0", namespace=self.hub)
        _ip("ip", "link", "set", "npbhub", "up", namespace=self.hub)
        mappings = []
        for k, (role, index) in enumerate(self.tasks):
            namespace = self.namespace(role, index)
            inner, outer = "%sv%d" % (self.prefix, k), "%sh%d" % (self.prefix, k)
            address, port = "%s.%d" % (SUBNET, k + 1), BASE_PORT + k
            _ip("ip", "netns", "add", namespace)
            _ip("ip", "link", "set", "lo", "up", namespace=namespace)
            _ip("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
            _ip("ip", "link", "set", inner, "netns", namespace)
            _ip("ip", "link", "set", inner, "name", TASK_INTERFACE, namespace=namespace)
            self._hosts_file(namespace, address)
            inner = TASK_INTERFACE
            _ip("ip", "link", "set", outer, "netns", self.hub)
            _ip("ip", "addr", "add", address + "/24", "dev", inner, namespace=namespace)
            _ip("ip", "link", "set", inner, "up", namespace=namespace)
            _ip("ip", "link", "set", outer, "master", "br0", namespace=self.hub)
            _ip("ip", "link", "set", outer, "up", namespace=self.hub)
            self._limit(inner, namespace)
            self._limit(outer, self.hub)
            if self.delay_ms > 0:
                advertised = "%s:%d" % (HUB_ADDRESS, port)
                mappings.append("%d:%s:%d" % (port, address, port))
                if role == "worker":
                    if index >= MAX_RELAYED_WORKERS:
                        raise ValueError("a delayed network relays the socket mesh of at most "
                                         "%d workers" % MAX_RELAYED_WORKERS)
                    mesh = MESH_BASE_PORT + index
                    mappings.append("%d:%s:%d" % (mesh, address, mesh))
            else:
                advertised = "%s:%d" % (address, port)
            self.cluster.setdefault(role, []).append(advertised)
        if mappings:
            mappings.append("%d:%s.%d:%d" % (PROBE_PORT, SUBNET, len(self.tasks), PROBE_PORT))
            self._relay = subprocess.Popen(
                ["ip", "netns", "exec", self.hub, sys.executable, "-u",
                 os.path.join(HERE, "delay_relay.py"), "--delay-ms", str(self.delay_ms),
                 "--dynamic", str(DYNAMIC_PORT)] + mappings,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            line = self._relay.stdout.readline()
            if "READY" not in line:
                self.__exit__(None, None, None)
                raise RuntimeError("the delay relay did not start: %s" % line)
        return self

    @staticmethod
    def _hosts_file(namespace, address):
        """Inside `namespace` (`ip netns exec` mounts /etc/netns/NAME/hosts on /etc/hosts) this
        machine's name resolves to the task's own address: Horovod's process-set Gloo contexts
        ignore HOROVOD_GLOO_IFACE and bind to the address of the host name."""
        os.makedirs(os.path.join(NETNS_ETC, namespace), exist_ok=True)
        with open(os.path.join(NETNS_ETC, namespace, "hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n%s %s\n" % (address, socket.gethostname()))

    def _remove(self):
        for namespace in self._namespaces():
            _ip("ip", "netns", "del", namespace, check=False)
            shutil.rmtree(os.path.join(NETNS_ETC, namespace), ignore_errors=True)
        _ip("ip", "link", "del", HOST_LINK, check=False)  # gone with the hub, unless interrupted

    def __exit__(self, *exc):
        if self._relay is not None:
            self._relay.kill()
            self._relay.wait()
            self._relay = None
        self._remove()
        time.sleep(0.2)  # let the kernel release the veth devices before a new network


def launched_on(network, launch, argv, horovod=False):
    """The command that runs `argv` through the launcher command line `launch` (up to its own
    flags) on `network` (an `EmulatedNetwork`): every task in its namespace, and every task's
    direct connections (Gloo's) through the relay (`relay_env`, inherited by the tasks)."""
    relayed = ["env"] + ["%s=%s" % kv for kv in sorted(network.relay_env().items())]
    return relayed + list(launch) + network.launcher_flags(horovod=horovod) + ["--"] + list(argv)


def round_trip_ms(network, count=5):
    """Median round trip (ms) of one byte from the last task's namespace to its own advertised
    address and back, through the hub (and the relay, when delayed): a check of the emulation."""
    role, index = network.tasks[-1]
    host = network.cluster[role][index].rsplit(":", 1)[0]
    port = str(PROBE_PORT)
    code = ("import socket,statistics,time,sys\n"
            "host,port=sys.argv[1],int(sys.argv[2]);s=socket.socket();s.bind(('0.0.0.0',port))\n"
            "s.listen();t=[]\n"
            "for _ in range(%d):\n"
            "  c=socket.create_connection((host,port));a,_=s.accept()\n"
            "  c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\n"
            "  a.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\n"
            "  t0=time.perf_counter();c.sendall(b'x');a.recv(1);a.sendall(b'y');c.recv(1)\n"
            "  t.append((time.perf_counter()-t0)*1e3);c.close();a.close()\n"
            "print(statistics.median(t))\n" % count)
    result = _ip(sys.executable, "-c", code, host, port, namespace=network.namespace(role, index))
    return float(result.stdout.strip().splitlines()[-1])
