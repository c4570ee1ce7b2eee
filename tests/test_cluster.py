"""A cluster's conventions (spmdsplit/cluster.py): the GPU a rank takes where one is bound per task,
and the interface gloo uses when the world spans nodes, chosen from the route to MASTER_ADDR; a
real two-"node" job over a network namespace shows what the default interface did."""

import os
import subprocess
import sys

import pytest

from spmdsplit.cluster import choose_gloo_interface, device_index, interface_of, route_source
from spmdsplit.errors import ConfigError
from tests.support.launch import base_env, free_port


def test_a_task_bound_to_one_gpu_takes_device_0_whatever_its_local_rank():
    """Slurm's --gpus-per-task=1 leaves each task CUDA_VISIBLE_DEVICES=<its GPU>: torch sees one
    device, cuda:0; cuda:LOCAL_RANK (what train.pick_device took before) does not exist there.
    What only a GPU shows: torch.cuda.set_device(3) failing with one visible device."""
    assert device_index(local_rank=3, visible=1) == 0
    assert device_index(local_rank=3, visible=8) == 3  # every task sees the node's GPUs (torchrun, --gpus-per-node)
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=5 but this rank sees 4 GPUs \(CUDA_VISIBLE_DEVICES=0,1,2,3\)"):
        device_index(local_rank=5, visible=4, env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})


def own_ipv4() -> tuple[str, str] | None:
    """(interface, address) of this machine's first non-loopback IPv4 address, as iproute2 lists it."""
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return None
    for line in out.splitlines():
        fields = line.split()  # "4: eth0    inet 192.0.2.2/24 brd ..."
        if len(fields) > 3 and fields[1] != "lo":
            return fields[1], fields[3].split("/")[0]
    return None


def test_the_interface_is_the_one_that_holds_this_hosts_end_of_the_route():
    assert route_source("127.0.0.1") == "127.0.0.1" and interface_of("127.0.0.1") == "lo"
    own = own_ipv4()
    if own is None:
        pytest.skip("no non-loopback IPv4 address here")
    name, address = own
    # On MASTER_ADDR's own node the kernel routes to its address over lo, but sends from that
    # address, which the other nodes reach on `name`.
    assert route_source(address) == address and interface_of(address) == name
    env = {"MASTER_ADDR": address}
    assert choose_gloo_interface(2, env) == f"gloo on {name} (the route to MASTER_ADDR={address})"
    assert env["GLOO_SOCKET_IFNAME"] == name


def test_the_interface_is_left_alone_on_one_node_or_when_given():
    env = {"MASTER_ADDR": "127.0.0.1"}
    assert choose_gloo_interface(1, env) == "" and "GLOO_SOCKET_IFNAME" not in env
    env = {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "ib0"}
    assert choose_gloo_interface(2, env) == "gloo on ib0 (GLOO_SOCKET_IFNAME)" and env["GLOO_SOCKET_IFNAME"] == "ib0"


@pytest.fixture
def second_host():
    """A network namespace joined to this one by a veth pair: a second "node" with an address of
    its own, 10.213.N.2, this host being 10.213.N.1. Both resolve the machine's name as before
    (this machine's /etc/hosts says 127.0.0.1, as Debian's 127.0.1.1 does on many clusters)."""
    n = os.getpid() % 250 + 1
    ns, host_end, ns_end = f"spmdsplit{n}", f"spmh{n}", f"spmn{n}"
    steps = [["ip", "netns", "add", ns], ["ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end],
             ["ip", "link", "set", ns_end, "netns", ns], ["ip", "addr", "add", f"10.213.{n}.1/24", "dev", host_end],
             ["ip", "link", "set", host_end, "up"],
             ["ip", "netns", "exec", ns, "ip", "addr", "add", f"10.213.{n}.2/24", "dev", ns_end],
             ["ip", "netns", "exec", ns, "ip", "link", "set", ns_end, "up"],
             ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"]]
    try:
        for step in steps:
            made = subprocess.run(step, capture_output=True, text=True, timeout=30)
            if made.returncode != 0:
                pytest.skip(f"no network namespace here ({' '.join(step)}: {made.stderr.strip()})")
        yield ns, f"10.213.{n}.1", (host_end, ns_end)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", host_end], capture_output=True, timeout=30)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_world_over_two_hosts_runs_its_gloo_groups_over_the_route_between_them(second_host, tmp_path):
    """Rank 0 here, rank 1 in the namespace: two nodes of one rank each (actor pool | critic pool).
    Gloo's default binds the address the host name resolves to, 127.0.0.1 on both, so each rank
    tells the other to reach it at its own loopback and the first gloo group times out
    (trainer.dist_timeout_s=20 here); over the interface of the route to MASTER_ADDR the job runs."""
    ns, master, (host_end, ns_end) = second_host
    argv = ["-m", "spmdsplit.train", "trainer.total_steps=2", "trainer.progress_bar=false", "trainer.device=cpu",
            "data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
            "trainer.dist_timeout_s=20", "trainer.pool_wait_timeout_s=40", "trainer.timeline=", "trainer.output_dir=",
            f"trainer.log_dir={tmp_path}/tb", f"trainer.default_local_dir={tmp_path}/ckpt"]
    common = {"MASTER_ADDR": master, "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
              "LOCAL_RANK": "0", "PYTHONPATH": os.environ["PYTHONPATH"]}
    ranks = [subprocess.Popen(prefix + [sys.executable, *argv], env=base_env(**common, RANK=rank), cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, prefix in ((0, []), (1, ["ip", "netns", "exec", ns]))]
    outputs = [rank.communicate(timeout=240) for rank in ranks]
    for rank, (out, err) in zip(ranks, outputs):
        assert rank.returncode == 0, err[-3000:]
    out0 = outputs[0][0]
    assert f"(1+1 nodes x 1); device=cpu, backend=gloo; gloo on {host_end} (the route to MASTER_ADDR={master})" in out0
    assert "step 2:" in out0
