"""The peer benchmark's Flower side: the job `anchorage export` wrote, run in Flower's simulation
engine (Ray) with PyTorch on the CPU.

    python flower_job.py EXPORT_DIR RESULT_JSON [--cpus-per-client N] [--local-eval]

Same features (x_train.npy / x_test.npy), same rows per client, same clients per round
(selection.npy), same batch order (batch_order.npy), same initial weights (init/*.npy), same
optimiser (Adam, lr and epsilon from meta.json, a fresh optimiser per local round as in the
Anchorage client), the same sample-weighted FedAvg, the global model evaluated on the server
after every round. Client-side (federated) evaluation is off on both sides, unless --local-eval:
then each trained client evaluates its local model on the whole test set before it replies (as
Anchorage's clients do when eval_every is not set).

How the selection is matched: Flower's FedAvg samples node ids itself; this strategy keeps
Flower's sampling of nodes and sends each sampled node, in its message, the data partition
Anchorage's engine picked for that slot of the round (every ClientApp can read every partition:
the arrays are memory-mapped .npy files shared through the page cache). Per round, the same
partitions train as in Anchorage, on the same rows, in the same order.

The apps are module-level objects of this module, imported by name (`import flower_job`) and
handed to `run_simulation`, so that Ray pickles them by reference, as `flwr run` loads an app:
pickled by value from `__main__`, they would carry the server's loaded arrays to every actor.
"""

import json
import os
import sys
import time

import numpy as np
import torch
from torch import nn

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import sample_nodes
from flwr.simulation import run_simulation

EXPORT = os.environ.get("PEERS_EXPORT", "")
RESULT = os.environ.get("PEERS_RESULT", "")
LOCAL_EVAL = os.environ.get("PEERS_LOCAL_EVAL", "") == "1"

_cache: dict = {}


def load(export: str) -> dict:
    """The exported arrays, memory-mapped once per process (a Ray actor keeps its module)."""
    if export not in _cache:
        meta = json.load(open(os.path.join(export, "meta.json")))
        arrays = {
            name: np.load(os.path.join(export, f"{name}.npy"), mmap_mode="r")
            for name in ["x_train", "y_train", "x_test", "y_test", "batch_order", "selection"]
        }
        _cache[export] = {"meta": meta, **arrays}
    return _cache[export]


def make_model(meta: dict) -> nn.Module:
    dims = [meta["feature_dim"], *meta["model"]["hidden"], meta["num_classes"]]
    layers: list[nn.Module] = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if i + 2 < len(dims):
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def initial_state(export: str, model: nn.Module) -> dict:
    """Anchorage's initial blocks as a PyTorch state dict (weights transposed to [out, in])."""
    meta = load(export)["meta"]
    blocks = {b["name"]: np.load(os.path.join(export, b["file"])) for b in meta["blocks"]}
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    names = [f"adapter.{i}" for i in range(len(linears) - 1)] + ["head"]
    state = {}
    for torch_name, block in zip(linears, names):
        state[f"{torch_name}.weight"] = torch.from_numpy(np.ascontiguousarray(blocks[f"{block}.weight"].T))
        state[f"{torch_name}.bias"] = torch.from_numpy(np.ascontiguousarray(blocks[f"{block}.bias"]))
    return state


# ----------------------------------------------------------------------------- ClientApp

client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = msg.content["config"]
    data = load(str(cfg["export"]))
    meta = data["meta"]
    pid, k = int(cfg["partition"]), int(cfg["participation"])
    model = make_model(meta)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    model.train()
    opt = torch.optim.Adam(
        model.parameters(),
        lr=meta["learning_rate"],
        betas=(meta["optimizer"]["beta_1"], meta["optimizer"]["beta_2"]),
        eps=meta["optimizer"]["epsilon"],
    )
    loss_fn = nn.CrossEntropyLoss()
    order = np.asarray(data["batch_order"][pid, k])
    order = order[order >= 0]
    n = meta["train_samples"][pid]
    batch = meta["batch_size"]
    total, seen = 0.0, 0
    for e in range(meta["local_epochs"]):
        rows = order[e * n : (e + 1) * n]
        for s in range(0, n, batch):
            idx = rows[s : s + batch]
            x = torch.from_numpy(np.asarray(data["x_train"][idx]))
            y = torch.from_numpy(np.asarray(data["y_train"][idx]))
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
            seen += len(idx)
    metrics = {"train_loss": total / max(seen, 1), "num-examples": n}
    if bool(cfg["local-eval"]):
        # The trained local model on the whole test set (Anchorage's local accuracy).
        model.eval()
        with torch.no_grad():
            x_test = torch.from_numpy(np.asarray(data["x_test"]))
            y_test = torch.from_numpy(np.asarray(data["y_test"]))
            metrics["local_accuracy"] = (model(x_test).argmax(1) == y_test).float().mean().item()
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


# ----------------------------------------------------------------------------- ServerApp


class SameSelectionFedAvg(FedAvg):
    """FedAvg whose round r trains the partitions Anchorage's engine picked for round r."""

    def __init__(self, export: str, **kw):
        super().__init__(**kw)
        self.export = export
        self.counts: dict[int, int] = {}

    def configure_train(self, server_round, arrays, config, grid):
        selection = load(self.export)["selection"][server_round - 1]
        node_ids, _ = sample_nodes(grid, self.min_available_nodes, len(selection))
        messages = []
        for node_id, pid in zip(node_ids, selection):
            pid = int(pid)
            k = self.counts.get(pid, 0)
            self.counts[pid] = k + 1
            c = ConfigRecord(
                {
                    **dict(config),
                    "server-round": server_round,
                    "export": self.export,
                    "partition": pid,
                    "participation": k,
                    "local-eval": LOCAL_EVAL,
                }
            )
            record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: c})
            messages.append(Message(content=record, message_type=MessageType.TRAIN, dst_node_id=node_id))
        return messages


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    data = load(EXPORT)
    meta = data["meta"]
    model = make_model(meta)
    model.load_state_dict(initial_state(EXPORT, model))
    x_test = torch.from_numpy(np.asarray(data["x_test"]))
    y_test = torch.from_numpy(np.asarray(data["y_test"]))
    rounds: list[dict] = []
    started = time.perf_counter()

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net = make_model(meta)
        net.load_state_dict(arrays.to_torch_state_dict())
        net.eval()
        with torch.no_grad():
            acc = (net(x_test).argmax(1) == y_test).float().mean().item()
        rounds.append({"round": server_round, "accuracy": acc, "seconds": time.perf_counter() - started})
        print(f"flower round {server_round}: accuracy {acc * 100:.2f}%", flush=True)
        return MetricRecord({"accuracy": acc})

    n = meta["clients"]
    strategy = SameSelectionFedAvg(
        EXPORT,
        fraction_train=meta["sampled_per_round"] / n,
        fraction_evaluate=0.0,
        min_train_nodes=1,
        min_available_nodes=n,
    )
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=meta["rounds"],
        evaluate_fn=evaluate,
    )
    with open(RESULT, "w") as f:
        json.dump({"rounds": rounds, "final_accuracy": rounds[-1]["accuracy"]}, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    args = sys.argv[1:]
    cpus = 1
    if "--cpus-per-client" in args:
        i = args.index("--cpus-per-client")
        cpus = int(args[i + 1])
        del args[i : i + 2]
    if "--local-eval" in args:
        args.remove("--local-eval")
        os.environ["PEERS_LOCAL_EVAL"] = "1"
    export, result = os.path.abspath(args[0]), os.path.abspath(args[1])
    os.environ["PEERS_EXPORT"], os.environ["PEERS_RESULT"] = export, result
    # Ray's workers import the module too: from this folder.
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])
    import flower_job as app

    meta = json.load(open(os.path.join(export, "meta.json")))
    run_simulation(
        server_app=app.server_app,
        client_app=app.client_app,
        num_supernodes=meta["clients"],
        backend_config={"client_resources": {"num_cpus": cpus, "num_gpus": 0.0}},
    )
