"""A private network of namespaces for the fault tests and the chaos run: one namespace per host, each
joined by a veth pair to a bridge in a switch namespace of its own. Faults act in the switch (the
link, not the hosts: neither end sees a refused packet, an ICMP error or an RST), so a partition is
silence both ways, as a cut cable or a dead switch port.

Loss and partitions are nftables drops. Delay and jitter: this kernel has no sch_netem (`tc qdisc
... netem` answers "Specified qdisc kind is unknown") and no nft `queue` (CONFIG_NFT_QUEUE), but it
has br_netfilter and legacy iptables' NFQUEUE target. So delay() has the bridge hand IPv4 packets to
iptables (net.bridge.bridge-nf-call-iptables=1, in the switch namespace only), where a rule in the
mangle table's FORWARD chain queues every one of them to a userspace delayer
(tests/harness/nfqueue_delay.py) running in the switch namespace, which accepts each after a delay drawn
uniformly from [ms - jitter, ms + jitter]. Every packet crosses the bridge once: each direction is
delayed once, a round trip twice. Packets whose delays cross are reordered, as netem's are. The
delayer holds at most QUEUE_MAXLEN packets (the kernel drops what comes beyond, as netem beyond its
limit); undelay() removes the rule, then lets the delayer release what it holds, each at its time,
and exit.

Duplication and rate act where a packet leaves the switch for its host, on each host's port (the
switch's end of its veth pair), so every packet meets them once, after any loss and delay:
- duplicate() hooks an nftables netdev-family chain to each port's egress whose rule sends a copy
  of N% of the packets out of that port again (`dup to`; netem's duplication is not here). The rule marks the packet before copying it, so the copy, which passes the
  same hook on its way out, is not copied again; crossing the veth into the host's namespace
  clears the mark. A copy leaves with its original: the same loss, delay and rate, both arriving
  together (netem's copy draws a delay of its own). stop_duplicating() deletes the rules and
  leaves the chains: deleting a chain unregisters its hook, and the kernel then drops every packet
  a delay() holds (so does a host's cut_off() once its port has a chain; the delayer goes on).
- limit_rate() puts a token bucket (tc's tbf) on each port's egress, so each direction of a link
  is capped once, a host's traffic from all others sharing its cap; packets beyond its queue of
  RATE_QUEUE_MS at the rate are dropped, as a switch port's full buffer drops them.

Every name carries this process's id and a counter, so concurrent runs never share one; the
addresses (10.213.0.0/24) exist only inside these namespaces, which have no route anywhere else.
`close()` deletes the switch namespace (its bridge, veths and rules go with it) and every host's;
a network or host whose making fails half way deletes what it made before the error propagates.
Every ip, nft, iptables and tc command, and the delayer's start and stop, is bounded (COMMAND_TIMEOUT_S)
and its failure names it; close() stops a delayer still running.

Also the checks every user of namespaces makes (tests/tf/coverage/netns.py's too): root, and the
tools it runs.
"""
import itertools
import os
import select
import shutil
import subprocess
import sys
from pathlib import Path

SUBNET = "10.213.0"
_networks = itertools.count()
# ip and nft answer in milliseconds, even on a busy machine; one still running after this is stuck
# (on a lock in the kernel or a wedged netns mount) and would hang whatever waits for the network.
COMMAND_TIMEOUT_S = 30.0
DELAYER = Path(__file__).with_name("nfqueue_delay.py")
# The delayer's kernel queue, in packets: at 20 ms a link moving 1 GB/s in 64 KiB GSO packets holds
# ~300 (and as many ACKs); what comes beyond is dropped. Queue numbers are per namespace.
QUEUE_MAXLEN, QUEUE = 10000, 0
# iptables-legacy, not the nft-backed `iptables`: this kernel has no nft queue expression.
QUEUE_RULE = ("FORWARD", "-j", "NFQUEUE", "--queue-num", str(QUEUE))
# Set on a packet duplicate() copies (and so on its copy): the copy passes the port's egress hook
# too, and a marked packet is not copied again. Any value: nothing else marks packets here.
COPIED_MARK = 0x2d
# limit_rate()'s bucket: a 64 KiB burst lets a whole GSO packet of a veth through as one (a smaller
# bucket cuts each into MTU-sized segments first); the queue holds RATE_QUEUE_MS at the rate.
RATE_BURST, RATE_QUEUE_MS = "64kb", 20


def unavailable_reason(purpose):
    """Why this machine cannot make namespaces for `purpose`, or None. Only not being root is a
    reason to skip; a root machine without the tools is broken (check_tools says how to fix it)."""
    if os.geteuid() != 0:
        return f"needs root: {purpose}"
    return None


def check_tools(tools=("ip", "nft"), purpose="the fault tests"):
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(f"{' and '.join(missing)} not found: run tools/install_test_prereqs.sh "
                           f"(it installs util-linux, iproute2, nftables and iptables; {purpose} need them)")


def _run(*command, input=None):
    try:
        result = subprocess.run(command, input=input, capture_output=True, text=True,
                                timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(command)} did not finish within {COMMAND_TIMEOUT_S:g} s and was killed: "
                           "see what holds the network namespaces (ps -C ip,nft; dmesg)") from None
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout


def _percent(percent):
    """A whole percentage from 1 to 100: nftables draws `numgen random mod 100`."""
    if isinstance(percent, bool) or not isinstance(percent, int) or not 1 <= percent <= 100:
        raise ValueError(f"{percent!r}%: give a whole percentage from 1 to 100")
    return percent


def namespaces():
    """The namespaces `ip netns list` shows (each line "NAME" or "NAME (id: N)")."""
    return {line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()}


def _undo(error, namespace):
    """Deletes the namespace a failed construction made while `error` propagates: if it cannot be
    deleted, that is noted on the error, not raised over it (the first failure is the one to fix)."""
    try:
        if namespace in namespaces():  # a failed `ip netns add` may or may not have made it
            _run("ip", "netns", "del", namespace)
    except RuntimeError as e:
        error.add_note(f"{namespace} may be left behind (ip netns del {namespace}): {e}")


class Network:
    def __init__(self):
        check_tools()
        self.prefix = f"tfrf{os.getpid()}n{next(_networks)}"
        self.switch = f"{self.prefix}-sw"
        self.hosts = {}                # name -> (namespace, address)
        self.ports = {}                # name -> the host's port on the bridge, while its link is up
        self.duplicated = None         # the percentage duplicate() copies, while it holds
        self.rate_mbit = None          # limit_rate()'s cap, while it holds
        self.rules = {}                # fault name -> nftables rule handles
        self.delayer = None            # the nfqueue_delay process while delay() holds
        try:
            _run("ip", "netns", "add", self.switch)
            self._in_switch("ip", "link", "add", "br0", "type", "bridge")
            self._in_switch("ip", "link", "set", "br0", "up")
            self._nft("add table bridge faults\n"
                      "add chain bridge faults forward { type filter hook forward priority 0; policy accept; }\n")
        except BaseException as e:  # ^C too: no caller gets an object to close
            _undo(e, self.switch)
            raise

    def _in_switch(self, *command):
        return _run("ip", "netns", "exec", self.switch, *command)

    def _nft(self, script):
        return _run("ip", "netns", "exec", self.switch, "nft", "-f", "-", input=script)

    def add_host(self, name, address=None):
        """A namespace named after `name`, up on the bridge; returns its address. `address`: the one
        a host of this network had before (a restarted machine keeps its address)."""
        assert name not in self.hosts, name
        if address is None:
            used = {a for _, a in self.hosts.values()}
            address = next(f"{SUBNET}.{i}" for i in itertools.count(1) if f"{SUBNET}.{i}" not in used)
        namespace = f"{self.prefix}-{name}"
        port = f"p{len(self.hosts)}{name}"[:15]
        try:
            _run("ip", "netns", "add", namespace)
            _run("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                 "netns", namespace)
            self._in_switch("ip", "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", namespace, "link", "set", "lo", "up")
            _run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            _run("ip", "-n", namespace, "link", "set", "eth0", "up")
            # A host that joins a network with its ports duplicating or capped gets the same.
            if self.duplicated is not None:
                self._nft(self._duplication(port, self.duplicated))
            if self.rate_mbit is not None:
                self._cap(port, self.rate_mbit)
        except BaseException as e:
            # Half a host is none: its namespace goes, its veth (and so the bridge's end) with it;
            # the hosts made before stay, and close() deletes them.
            _undo(e, namespace)
            raise
        self.hosts[name] = (namespace, address)
        self.ports[name] = port
        return address

    def cut_off(self, name):
        """Deletes the host's link: whatever its processes send from now on (a FIN as they die)
        reaches no one, and the others get no RST or ICMP error for what they send it."""
        _run("ip", "-n", self.namespace(name), "link", "del", "eth0")
        del self.ports[name]  # the veth pair's other end, the bridge's port, went with it

    def remove_host(self, name):
        """Deletes the host's namespace, after cut_off() and once its processes are gone (a
        process inside keeps a namespace alive)."""
        namespace, _ = self.hosts.pop(name)
        self.ports.pop(name, None)  # deleting the namespace deletes the veth pair, and so the port
        _run("ip", "netns", "del", namespace)

    def namespace(self, name):
        return self.hosts[name][0]

    def address(self, name):
        return self.hosts[name][1]

    def _add_rules(self, fault, rules):
        if fault in self.rules:
            raise RuntimeError(f"{' '.join(fault)} is applied already: lift it first")
        handles = []
        for rule in rules:
            out = _run("ip", "netns", "exec", self.switch, "nft", "--echo", "--handle",
                       "add", "rule", "bridge", "faults", "forward", *rule.split())
            handles.append(out.rsplit("# handle", 1)[1].split()[0])
        self.rules[fault] = handles

    def partition(self, a, b):
        """Drops everything between hosts `a` and `b`, both ways, until heal(a, b)."""
        x, y = self.address(a), self.address(b)
        self._add_rules(("partition", a, b), [f"ip saddr {x} ip daddr {y} drop",
                                              f"ip saddr {y} ip daddr {x} drop"])

    def heal(self, a, b):
        self._lift(("partition", a, b))

    def block_port(self, port):
        """Drops every TCP segment to or from `port` on the bridge, until unblock_port(port)."""
        self._add_rules(("block", port), [f"tcp dport {port} drop", f"tcp sport {port} drop"])

    def unblock_port(self, port):
        self._lift(("block", port))

    def lose(self, percent):
        """Drops `percent`% of all IPv4 packets on the bridge, at random, until keep_all()."""
        self._add_rules(("loss",), [f"meta protocol ip numgen random mod 100 < {_percent(percent)} drop"])

    def keep_all(self):
        self._lift(("loss",))

    def delay(self, ms, jitter_ms=0.0, seed=0):
        """Delays every IPv4 packet on the bridge by a time drawn uniformly from [ms - jitter_ms,
        ms + jitter_ms] (by a random.Random(seed)), each direction, until undelay()."""
        if self.delayer is not None:
            raise RuntimeError("a delay is applied already: undelay() it first")
        if not 0 <= jitter_ms <= ms:
            raise ValueError(f"delay {ms} ms with jitter {jitter_ms} ms: the jitter must be between 0 and the delay")
        check_tools(("iptables-legacy",), "delays on the link")
        _run("ip", "netns", "exec", self.switch, "tee", "/proc/sys/net/bridge/bridge-nf-call-iptables", input="1\n")
        command = ["ip", "netns", "exec", self.switch, sys.executable, str(DELAYER), str(QUEUE),
                   str(ms), str(jitter_ms), str(seed), str(QUEUE_MAXLEN)]
        name = " ".join(command)
        # ip netns exec execs the delayer: this is its process, and SIGTERM reaches it.
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ready, _, _ = select.select([process.stdout], [], [], COMMAND_TIMEOUT_S)
            said = process.stdout.readline() if ready else ""
            if said != "bound\n":
                # Its stdout at an end is its exit, though it may not be reaped yet (poll() says None).
                how = ("exited" if ready and not said else "answered otherwise" if ready
                       else f"was killed after {COMMAND_TIMEOUT_S:g} s")
                process.kill()
                _, stderr = process.communicate(timeout=COMMAND_TIMEOUT_S)
                raise RuntimeError(f"{name} did not bind its queue: it {how} (said {said!r}, "
                                   f"exit status {process.returncode}): {stderr.strip()}")
            self._in_switch("iptables-legacy", "-w", "-t", "mangle", "-A", *QUEUE_RULE)
        except BaseException:
            if process.poll() is None:
                process.kill()
                process.wait()
            raise
        self.delayer = process

    def undelay(self):
        """Removes delay()'s rule, then stops its delayer once it has released every packet it
        holds (each at its time): a status other than 0 or a stuck delayer raises, naming it."""
        process, self.delayer = self.delayer, None
        if process is None:
            raise RuntimeError("no delay is applied")
        try:
            self._in_switch("iptables-legacy", "-w", "-t", "mangle", "-D", *QUEUE_RULE)
        finally:
            process.terminate()
            try:
                _, stderr = process.communicate(timeout=COMMAND_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                raise RuntimeError(f"{' '.join(process.args)} did not stop within {COMMAND_TIMEOUT_S:g} s "
                                   "of SIGTERM and was killed") from None
        if process.returncode != 0:
            raise RuntimeError(f"{' '.join(process.args)} failed ({process.returncode}): {stderr.strip()}")

    def duplicate(self, percent):
        """Sends `percent`% of the packets leaving the switch for each host twice, at random, so
        each direction of a link duplicates that share once, until stop_duplicating()."""
        if self.duplicated is not None:
            raise RuntimeError(f"{self.duplicated}% duplication is applied already: stop_duplicating() first")
        percent = _percent(percent)
        # One script: every port duplicates from the same moment, or none does.
        self._nft("add table netdev duplicates\n"
                  + "".join(self._duplication(port, percent) for port in self.ports.values()))
        self.duplicated = percent

    @staticmethod
    def _duplication(port, percent):
        """nft commands: a chain on `port`'s egress copying `percent`% of what leaves by it."""
        return (f'add chain netdev duplicates {port} {{ type filter hook egress device "{port}" priority 0; }}\n'
                f"add rule netdev duplicates {port} meta mark != {COPIED_MARK} numgen random mod 100 < {percent} "
                f'meta mark set {COPIED_MARK} dup to "{port}"\n')

    def stop_duplicating(self):
        if self.duplicated is None:
            raise RuntimeError("no duplication is applied")
        self.duplicated = None
        # The rules go, the chains (their hooks) stay: unregistering a netfilter hook makes the
        # kernel drop every packet a delay() holds in its queue.
        self._in_switch("nft", "flush", "table", "netdev", "duplicates")

    def limit_rate(self, mbit):
        """Caps what leaves the switch for each host at `mbit` megabits per second (each direction
        of a link once; a host's traffic from all others shares its cap), until unlimit_rate()."""
        if self.rate_mbit is not None:
            raise RuntimeError(f"a rate limit of {self.rate_mbit:g} Mbit/s is applied already: unlimit_rate() first")
        if isinstance(mbit, bool) or not isinstance(mbit, (int, float)) or not 0.01 <= mbit <= 100_000:
            raise ValueError(f"rate limit {mbit!r}: give megabits per second, from 0.01 to 100000")
        check_tools(("tc",), "rate limits on the link")
        capped = []
        try:
            for port in self.ports.values():
                self._cap(port, mbit)
                capped.append(port)
        except BaseException as e:  # all ports capped or none
            try:
                self._uncap(capped)
            except RuntimeError as undoing:
                e.add_note(f"and the ports capped before it stay capped: {undoing}")
            raise
        self.rate_mbit = mbit

    def _cap(self, port, mbit):
        self._in_switch("tc", "qdisc", "add", "dev", port, "root", "tbf", "rate", f"{round(mbit * 1000)}kbit",
                        "burst", RATE_BURST, "latency", f"{RATE_QUEUE_MS}ms")

    def unlimit_rate(self):
        if self.rate_mbit is None:
            raise RuntimeError("no rate limit is applied")
        self.rate_mbit = None
        self._uncap(self.ports.values())

    def _uncap(self, ports):
        errors = []
        for port in ports:  # a port that fails leaves the others uncapped all the same
            try:
                self._in_switch("tc", "qdisc", "del", "dev", port, "root")
            except RuntimeError as e:
                errors.append(str(e))
        if errors:
            raise RuntimeError("; ".join(errors))

    def _lift(self, fault):
        if fault not in self.rules:
            raise RuntimeError(f"no {' '.join(fault)} is applied")
        for handle in self.rules.pop(fault):
            self._in_switch("nft", "delete", "rule", "bridge", "faults", "forward", "handle", handle)

    def close(self):
        errors = []
        if self.delayer is not None:  # a process in the switch namespace would keep it alive
            try:
                self.undelay()
            except RuntimeError as e:
                errors.append(str(e))
        for namespace in [self.switch] + [n for n, _ in self.hosts.values()]:
            try:
                _run("ip", "netns", "del", namespace)
            except RuntimeError as e:
                errors.append(str(e))
        self.hosts.clear()
        self.ports.clear()
        if errors:
            raise RuntimeError("; ".join(errors))

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        try:
            self.close()
        except RuntimeError as e:
            if error is None:
                raise
            # The failure that ended the block stays the one raised (a ChaosError, a ^C).
            error.add_note(f"closing the network failed too: {e}")
