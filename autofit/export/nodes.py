"""Several nodes: what every launcher needs to start a plan whose ranks span machines (`Config.nodes`).

The same script runs on every node. torchrun meets the others at a c10d rendezvous on the first node
(MASTER_ADDR, MASTER_PORT); DeepSpeed's runner reads a hostfile (one line per node, `slots` its GPUs) and
starts the ranks over ssh from the first node; accelerate takes the machine count from its config and each
node's rank and the first node's address from the launch line. What is the same on every node is written;
what differs (the node's rank, the addresses) is read from the environment, and a missing one stops the
script naming the variable.
"""

from __future__ import annotations

import shlex

from autofit.config import Config

DEFAULT_PORT = 29500  # torchrun's and accelerate's own default
HOSTFILE = "hostfile"
# (variable, what it holds): no quote characters, which bash would read inside "${VAR:?...}"
ADDRESS = ("MASTER_ADDR", "the address (hostname or IP) of the first node, the same on every node")
NODE_RANK = ("NODE_RANK", "the rank of this node, 0 on the first")


def required(variable: tuple[str, str], where: str) -> str:
    """A bash line stopping the script, naming `variable` and what it holds, where it is not set; `where`
    says where the script runs."""
    name, what = variable
    return f': "${{{name}:?set {name} to {what}; run this script {where}}}"'


def port_line() -> str:
    """A bash line defaulting MASTER_PORT."""
    return f'MASTER_PORT="${{MASTER_PORT:-{DEFAULT_PORT}}}"'


def torchrun_arguments(config: Config) -> list[str]:
    """torchrun's arguments for `config`'s ranks: one standalone node, or `nodes` nodes meeting at a c10d
    rendezvous on the first (its address and port from MASTER_ADDR, MASTER_PORT: "$..." words, expanded
    by the script)."""
    if config.nodes == 1:
        return ["--standalone", "--nnodes", "1", "--nproc_per_node", str(config.num_gpus)]
    return ["--nnodes", str(config.nodes), "--nproc_per_node", str(config.gpus_per_node),
            "--rdzv_backend", "c10d", "--rdzv_endpoint", "$MASTER_ADDR:$MASTER_PORT",
            "--rdzv_id", "${AUTOFIT_RUN_ID:-autofit}"]


def setup_lines(config: Config, every_node: bool = True) -> list[str]:
    """The bash lines a multi-node launch script runs before its command: the first node's address
    required, the port defaulted (none on one node). `every_node`: the script runs on each node (torchrun,
    accelerate), else on the first alone (DeepSpeed's runner)."""
    if config.nodes == 1:
        return []
    where = f"on each of the {config.nodes} nodes" if every_node else "on the first node"
    said = ", with the same MASTER_ADDR (and MASTER_PORT) on each" if every_node else ""
    return [f"# {config.nodes} nodes x {config.gpus_per_node} GPUs: run this script {where}{said}",
            required(ADDRESS, where), port_line()]


def shell_join(words: list[str]) -> str:
    """`words` as one bash line: those holding a "$" in double quotes (the shell expands them), the rest
    quoted as `shlex.quote` does."""
    return " ".join(f'"{w}"' if "$" in w else shlex.quote(w) for w in words)


def hostfile(config: Config) -> str:
    """DeepSpeed's hostfile for `config`: a line per node, `slots` its GPUs, named node-1 .. node-N for you to
    replace with the nodes' hostnames (as ssh reaches them from the first)."""
    lines = [f"# {config.nodes} nodes x {config.gpus_per_node} GPUs. Replace each name with a node's hostname, "
             "reachable by passwordless ssh from the first node (DeepSpeed's runner starts the ranks over pdsh)."]
    return "\n".join(lines + [f"node-{i + 1} slots={config.gpus_per_node}" for i in range(config.nodes)]) + "\n"


def deepspeed_arguments(config: Config, hostfile_path: str) -> list[str]:
    """`deepspeed` runner arguments for `config`'s ranks: the hostfile and the node and GPU counts over
    several nodes, the GPU count on one."""
    if config.nodes == 1:
        return ["--num_gpus", str(config.num_gpus)]
    return ["--hostfile", hostfile_path, "--num_nodes", str(config.nodes), "--num_gpus", str(config.gpus_per_node),
            "--master_addr", "$MASTER_ADDR", "--master_port", "$MASTER_PORT"]


def accelerate_arguments(config: Config) -> list[str]:
    """`accelerate launch` arguments that differ per node (none on one): this node's rank and the first
    node's address, from NODE_RANK and MASTER_ADDR."""
    if config.nodes == 1:
        return []
    return ["--machine_rank", "$NODE_RANK", "--main_process_ip", "$MASTER_ADDR", "--main_process_port",
            "$MASTER_PORT"]


def accelerate_setup_lines(config: Config) -> list[str]:
    """The bash lines accelerate_launch.sh runs first over several nodes: the node's rank and the first
    node's address required."""
    if config.nodes == 1:
        return []
    return [*setup_lines(config), required(NODE_RANK, f"on each of the {config.nodes} nodes")]
