"""One TorchRec row of the side-by-side benchmark (bench/compare.py): the peer a PyTorch user
would pick, on the same cores, cell and data as ours.

Every task of a `python -m tf_nestpipe.launch` cluster runs it; rank and world size come from
`TF_CONFIG` (task index, number of workers) and the process group meets at worker 0's address
in it (gloo backend, so on an emulated network it crosses the same rate-limited links). The
model is bench/compare_worker.py's DLRM in PyTorch: an `EmbeddingBagCollection` of the same
tables (dim, rows, sum pooling of one id per sample), bottom MLP 64-32-dim, pairwise dot
interaction, top MLP 64-32-1, binary cross-entropy on the logits; the same synthetic Zipf
batches (`SyntheticClickLog`, this rank's contiguous slice of each global batch). Sharded by
`DistributedModelParallel` with its planner's plan (printed), embeddings updated by FBGEMM's
fused Adagrad in the backward, the dense layers by `torch.optim.Adagrad` after DDP's
all-reduce; learning rate 0.05 everywhere.

`--pipeline none`: the plain loop (forward, backward, step); `--pipeline sparse_dist`:
TorchRec's `TrainPipelineSparseDist` (the next batch's input distribution overlapped with this
batch's compute). Prints on rank 0 `RESULT {json}` like compare_worker.py: median / p90 / mean
ms per step after `--warmup`, and rank 0's process CPU per step.
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402

LEARNING_RATE = 0.05


def cluster_of_tf_config():
    """(rank, world size, worker 0's host, port) from `TF_CONFIG`.

    Raises:
        RuntimeError: No TF_CONFIG with a worker task (run it through tf_nestpipe.launch).
    """
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    workers = config.get("cluster", {}).get("worker")
    task = config.get("task", {})
    if not workers or task.get("type") != "worker":
        raise RuntimeError("torchrec_worker.py needs TF_CONFIG with a worker task: run it with "
                           "`python -m tf_nestpipe.launch --workers W -- python "
                           "bench/torchrec_worker.py ...`")
    host, port = workers[0].rsplit(":", 1)
    return int(task["index"]), len(workers), host, int(port)


def table_sizes_of(args):
    """The cell's tables: `--synthetic-tables COUNT:ROWS`."""
    count, rows = args.synthetic_tables.split(":")
    return [int(rows)] * int(count)


# `SyntheticClickLog` lives in a package that loads TensorFlow, and TensorFlow and PyTorch in
# one process crash here (SIGSEGV at PyTorch's first ops): the batches are made in a child.
_GENERATE = """
import json, sys, numpy as np
from tf_nestpipe.data.synthetic import SyntheticClickLog
sizes, zipf, batch, count, lo, hi, path = json.loads(sys.argv[1])
log = SyntheticClickLog(sizes, seed=1, zipf_exponent=zipf)
parts = [log.batch(i, batch) for i in range(count)]
np.savez(path, dense=np.stack([f["dense"][lo:hi] for f, _ in parts]),
         sparse=np.stack([f["sparse"][lo:hi] for f, _ in parts]),
         labels=np.stack([l[lo:hi] for _, l in parts]))
"""


def local_batches(args, rank, world, table_sizes):
    """This rank's slices of the first `count` global batches (numpy dense, sparse, labels):
    the same batches as compare_worker.py's (`SyntheticClickLog`, seed 1)."""
    import subprocess  # pylint: disable=import-outside-toplevel
    import tempfile  # pylint: disable=import-outside-toplevel
    per = args.global_batch // world
    count = min(args.warmup + args.steps + 3, 100)
    with tempfile.TemporaryDirectory(prefix="torchrec_batches_") as tmp:
        path = os.path.join(tmp, "batches.npz")
        spec = (list(table_sizes), args.zipf, args.global_batch, count, rank * per,
                (rank + 1) * per, path)
        subprocess.run([sys.executable, "-c", _GENERATE, json.dumps(spec)], check=True,
                       env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
        with np.load(path) as saved:
            return list(zip(saved["dense"], saved["sparse"], saved["labels"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", choices=["none", "sparse_dist"], default="none")
    parser.add_argument("--synthetic-tables", required=True, help="COUNT:ROWS")
    parser.add_argument("--zipf", type=float, default=1.2)
    parser.add_argument("--global-batch", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--torch-profile", type=int, default=0,
                        help="then profile this many steps with torch.profiler and print rank "
                             "0's top ops (a diagnostic)")
    args = parser.parse_args()
    rank, world, host, port = cluster_of_tf_config()
    table_sizes = table_sizes_of(args)
    batches = local_batches(args, rank, world, table_sizes)

    import torch  # pylint: disable=import-outside-toplevel
    import torch.distributed as dist  # pylint: disable=import-outside-toplevel
    from torch import nn  # pylint: disable=import-outside-toplevel
    from torchrec import (EmbeddingBagCollection, EmbeddingBagConfig,  # pylint: disable=import-outside-toplevel
                          KeyedJaggedTensor, PoolingType)
    from torchrec.datasets.utils import Batch  # pylint: disable=import-outside-toplevel
    from torchrec.distributed.model_parallel import DistributedModelParallel  # pylint: disable=import-outside-toplevel
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist  # pylint: disable=import-outside-toplevel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward  # pylint: disable=import-outside-toplevel

    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    if host in ("localhost", "127.0.0.1"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    elif os.path.exists("/sys/class/net/npb0"):  # bench/netem.py's task interface
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "npb0")
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=
                          __import__("datetime").timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    names = ["t%d" % i for i in range(len(table_sizes))]
    features = ["f%d" % i for i in range(len(table_sizes))]

    class DLRM(nn.Module):
        """compare_worker.py's DLRM: bottom MLP, dot interaction, top MLP."""

        def __init__(self):
            super().__init__()
            self.ebc = EmbeddingBagCollection(device=torch.device("meta"), tables=[
                EmbeddingBagConfig(name=n, embedding_dim=args.dim, num_embeddings=rows,
                                   feature_names=[f], pooling=PoolingType.SUM)
                for n, f, rows in zip(names, features, table_sizes)])
            self.bottom = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 32),
                                        nn.ReLU(), nn.Linear(32, args.dim), nn.ReLU())
            vectors = len(table_sizes) + 1
            pairs = vectors * (vectors - 1) // 2
            self.top = nn.Sequential(nn.Linear(args.dim + pairs, 64), nn.ReLU(),
                                     nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))
            self.pairs = torch.triu_indices(vectors, vectors, offset=1)
            self.loss = nn.BCEWithLogitsLoss()

        def forward(self, batch):
            dense = self.bottom(batch.dense_features)
            pooled = self.ebc(batch.sparse_features)
            stacked = torch.stack([dense] + [pooled[f] for f in features], dim=1)
            dots = torch.bmm(stacked, stacked.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
            logits = self.top(torch.cat([dense, dots], dim=1)).squeeze(1)
            loss = self.loss(logits, batch.labels)
            return loss, (loss.detach(), logits.detach(), batch.labels)

    model = DLRM()
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(),
                                {"lr": LEARNING_RATE})
    model = DistributedModelParallel(model, device=torch.device("cpu"))
    plan = {name: str(getattr(spec, "sharding_type", "?"))
            for module_plan in model.plan.plan.values() for name, spec in module_plan.items()}
    dense_params = [p for name, p in model.named_parameters() if "ebc" not in name]
    optimizer = torch.optim.Adagrad(dense_params, lr=LEARNING_RATE)

    def to_batch(item):
        dense, sparse, labels = item
        n, f = sparse.shape
        return Batch(dense_features=torch.from_numpy(np.ascontiguousarray(dense)),
                     sparse_features=KeyedJaggedTensor.from_lengths_sync(
                         keys=features,
                         values=torch.from_numpy(np.ascontiguousarray(sparse.T.reshape(-1))),
                         lengths=torch.ones(n * f, dtype=torch.int32)),
                     labels=torch.from_numpy(np.ascontiguousarray(labels.reshape(-1))))

    data = [to_batch(item) for item in batches]

    def cycle():
        while True:
            yield from data

    iterator = cycle()
    if args.pipeline == "sparse_dist":
        pipeline = TrainPipelineSparseDist(model, optimizer, torch.device("cpu"))
        step = lambda: pipeline.progress(iterator)  # noqa: E731
    else:
        def step():
            optimizer.zero_grad()
            loss, _ = model(next(iterator))
            loss.backward()
            optimizer.step()
    times = []
    cpu_start = None
    for index in range(args.warmup + args.steps):
        if index == args.warmup:
            dist.barrier()
            cpu_start = time.process_time()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    cpu = (time.process_time() - cpu_start) / args.steps * 1e3
    timed = np.asarray(times[args.warmup:]) * 1e3
    dist.barrier()
    if args.torch_profile:
        with torch.profiler.profile() as profiler:
            for _ in range(args.torch_profile):
                step()
        if rank == 0:
            print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    if rank == 0:
        print("RESULT " + json.dumps({
            "steps": int(len(timed)), "ms_median": float(np.median(timed)),
            "ms_p90": float(np.percentile(timed, 90)), "ms_mean": float(timed.mean()),
            "cpu_ms_per_step": cpu, "cpu_busy": cpu / float(np.median(timed)),
            "system": "torchrec", "workers": world, "global_batch": args.global_batch,
            "samples_per_s": args.global_batch / float(np.median(timed)) * 1e3,
            "torchrec_plan": sorted(set(plan.values())), "torch_threads": cores,
            "torch_version": torch.__version__}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
