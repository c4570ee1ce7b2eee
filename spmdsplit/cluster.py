"""What a cluster's conventions ask of a rank before the world forms: which GPU is its own, and
which network interface its gloo groups use when the world spans nodes.

GPU. torchrun, and Slurm with `--gpus-per-node`, show every task all the node's GPUs: the rank
takes `cuda:LOCAL_RANK`. A cluster that binds one GPU per task (Slurm's `--gpus-per-task=1`,
`--gpu-bind=single:1`, a site default) sets CUDA_VISIBLE_DEVICES to that one device, which the
process then sees as device 0 whatever its LOCAL_RANK: `cuda:LOCAL_RANK` would not exist.

Gloo's interface. Gloo (the pools' meeting groups, the control and stop groups, DCP's checkpoint
coordination, vLLM's CPU groups) binds the interface of the address its host name resolves to,
unless GLOO_SOCKET_IFNAME names one. On many clusters the host name resolves to a management
network, or to 127.0.x.1 (Debian's /etc/hosts; this project's test machine too): ranks on other
nodes then cannot reach it and the first gloo group waits out its timeout. When the world spans
nodes and GLOO_SOCKET_IFNAME is unset, the rank takes the interface that holds its own end of
the route to MASTER_ADDR: the address the kernel would send from (a UDP socket's connect sends
nothing), and the interface that owns that address. On MASTER_ADDR's own node the route goes over
`lo`, but the source address is MASTER_ADDR itself, whose interface is the one the other nodes
reach: hence the owner of the address, not `ip route get`'s device.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

from spmdsplit.errors import ConfigError

SIOCGIFADDR = 0x8915  # Linux <linux/sockios.h>: an interface's (primary) IPv4 address


def device_index(local_rank: int, visible: int, env=os.environ) -> int:
    """This rank's GPU among the `visible` ones (torch.cuda.device_count(), which honours
    CUDA_VISIBLE_DEVICES)."""
    if visible == 1:
        return 0  # one GPU per task: the one it was given
    if local_rank >= visible:
        raise ConfigError(
            f"LOCAL_RANK={local_rank} but this rank sees {visible} GPUs "
            f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')}): give every task the node's "
            "GPUs (Slurm: --gpus-per-node) or exactly one (--gpus-per-task=1)")
    return local_rank


def route_source(address: str) -> str:
    """The local address this host sends from to `address` (a name or an IP): the kernel's route,
    asked through a UDP socket's connect, which sends no packet."""
    family, _, _, _, sockaddr = socket.getaddrinfo(address, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the interface that holds the local `address`, or None."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if ip.version == 6:
        try:
            with open("/proc/net/if_inet6") as f:  # "<32 hex digits> <index> <len> <scope> <flags> <name>"
                for line in f:
                    fields = line.split()
                    if len(fields) == 6 and ipaddress.ip_address(int(fields[0], 16)) == ip:
                        return fields[5]
        except OSError:
            return None
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(answer[20:24]) == str(ip):
                return name
    return None


def choose_gloo_interface(nnodes: int, env=os.environ) -> str:
    """Sets GLOO_SOCKET_IFNAME for a world that spans nodes, unless it is set; returns what the
    start-up line says about it ("" on one node, where gloo's default, loopback included, is right)."""
    if nnodes <= 1:
        return ""
    if env.get("GLOO_SOCKET_IFNAME"):
        return f"gloo on {env['GLOO_SOCKET_IFNAME']} (GLOO_SOCKET_IFNAME)"
    master = env.get("MASTER_ADDR", "127.0.0.1")
    try:
        source = route_source(master)
    except OSError as e:
        return f"gloo on its default interface (no route to MASTER_ADDR={master}: {e}; set GLOO_SOCKET_IFNAME)"
    name = interface_of(source)
    if name is None:
        return (f"gloo on its default interface (no interface holds {source}, this host's address towards "
                f"MASTER_ADDR={master}; set GLOO_SOCKET_IFNAME)")
    env["GLOO_SOCKET_IFNAME"] = name
    return f"gloo on {name} (the route to MASTER_ADDR={master})"
