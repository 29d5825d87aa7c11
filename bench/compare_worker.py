"""One row of the side-by-side benchmark (bench/compare.py): trains one model on one data set with
one distribution system for `--warmup + --steps` steps and prints, on rank 0, `RESULT {json}`
with the median / p90 / mean wall time of the steps after warm-up, rank 0's process CPU time
per step over them and the cores it kept busy (`cpu_ms_per_step`, `cpu_busy`; under
pipeline="auto" also `auto_cpu`, the same per mode of its probe) (and, with `--profile-steps`,
a later `PROFILE {json}`: the timing is printed first, so a profiling pass that aborts the process
does not take the timing with it).

Systems (`--system`), all on the same model, data and global batch:
- `single`: one process, no strategy, replicated tf_keras `Embedding` per table, tf_keras fit;
- `compute_only`: the compute-only bound of a W-worker row: `single` on its own share (global
  batch / W) of the data, started W times at once by the launcher on the same cores, no
  communication;
- `mwms`: `tf.distribute.MultiWorkerMirroredStrategy` (RING), tf_keras `Embedding`, fit;
- `psv2`: `tf.distribute.ParameterServerStrategy` (chief of a `--workers W --ps W --chief`
  cluster) with `MinSizePartitioner`-sharded tf_keras `Embedding`s; synchronous-style: one step
  = W scheduled functions of global_batch / W samples each, then `join()`; after the timed steps
  the same number of steps is scheduled with one join at the end (`async_samples_per_s`);
- `hvd_replicated`: Horovod, replicated tf_keras `Embedding`s, `hvd.DistributedGradientTape`
  (Horovod's default for the embeddings' `IndexedSlices` gradients: allgather);
- `hvd_alltoall`: Horovod with model-parallel tables in the style of NVIDIA's TF2 DLRM: rank r owns
  whole tables t with t mod W == r; the ids go to the owners by `hvd.alltoall`, the rows come back
  by a second one (its gradient, Horovod's reverse all-to-all, brings each owner the gradient of
  its rows from every rank); dense gradients `hvd.allreduce`d (multi-hot MovieLens bags stay
  replicated);
- `nestpipe`: `tnp.NestPipeStrategy(pipeline=..., collectives=...)` with one fused
  `ShardedEmbeddingCollection` (+ mean-pooled `ShardedEmbedding` bags), fit; `--profile-steps K`
  runs K more steps on every worker, profiled on rank 0 only (bench/dlrm_worker.py's `profile`),
  for the communication and exposure.

Models (`--model`): `dlrm` = examples/dlrm.py's DLRM (bottom MLP, dot interaction, top MLP);
`dcn` = a TFRS ranking model (`tfrs.layers.dcn.Cross` + deep tower + `tfrs.tasks.Ranking` with SUM
reduction divided by the batch, as TFRS needs under tf.distribute). Data (`--data`): `synthetic`
(Zipf Criteo-profile `SyntheticClickLog`, 26 tables scaled by `--table-scale`, 13 dense) or
`movielens-1m` (7 single-hot features + mean-pooled genres, no dense features). Every step's
loss is the mean binary cross-entropy over the global batch; Adagrad everywhere.

`--wire-dtype FORWARD-BACKWARD` (nestpipe; e.g. int8-bf16, or one name for both) compresses the
embedding exchanges; the RESULT then has `wire_bytes_per_step` (bytes rank 0 sent per step by
exchange kind, from the strategy's wire counters) and `clamped`. `--placement` (nestpipe, default "auto") and `--memory-budget-bytes N` (nestpipe: tables +
slots per worker) go to `NestPipeStrategy`; ours' RESULT then has `placements` (tables per
placement) and `table_bytes_per_worker` (the planner's). With `--memory-check-workers W` the
worker trains nothing: it prints `MEMORY {json}`, whether `--system`'s tables + Adagrad slots fit
the budget per process on W workers (bench/compare_memory.py, computed), and exits.
`--eval-batches N` (dlrm) adds
`auc`: the AUC after training on N held-out global batches (synthetic: batches 10**6 and on, never
trained on; MovieLens-1M: its test split).
"""
import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tensorflow_recommenders as tfrs  # noqa: E402
import tf_keras  # noqa: E402

import dlrm  # noqa: E402
import tf_nestpipe as tnp  # noqa: E402
from compare_memory import memory_verdict  # noqa: E402
from dlrm_worker import profile  # noqa: E402
from ps_worker import MeanBag  # noqa: E402
from tf_nestpipe.data import (SyntheticClickLog, criteo_kaggle_table_sizes,  # noqa: E402
                              load_or_prepare_movielens, make_dataset, split_files)
from tf_nestpipe.sharding.row_shard import is_row_shard  # noqa: E402

SYSTEMS = ("single", "mwms", "psv2", "hvd_replicated", "hvd_alltoall", "nestpipe", "compute_only")
LEARNING_RATE = 0.05
MOVIELENS_CYCLE = 20  # distinct MovieLens batches per worker, cached after the first pass


def _uniform(seed):
    return tf_keras.initializers.RandomUniform(-0.05, 0.05, seed=seed)


# --- data --------------------------------------------------------------------------------------
class Data:
    """One data set: single-hot table sizes, multi-hot (bag) sizes, number of dense features and
    `dataset_fn(InputContext)` giving that input pipeline's batches of its share of the batch."""

    def __init__(self, table_sizes, bag_sizes, num_dense, dataset_fn):
        self.table_sizes = list(table_sizes)
        self.bag_sizes = dict(bag_sizes)
        self.num_dense = num_dense
        self.dataset_fn = dataset_fn


def synthetic_table_sizes(args):
    """The synthetic data's table sizes: the Criteo Kaggle profile times `--table-scale`, or
    `--synthetic-tables N:ROWS` tables of ROWS rows each."""
    if args.synthetic_tables:
        count, rows = (int(v) for v in args.synthetic_tables.split(":"))
        return [rows] * count
    return list(criteo_kaggle_table_sizes(args.table_scale))


def table_sizes_of(args):
    """(single-hot table sizes, {bag name: size}) of `--data`, without reading its records."""
    if args.data == "synthetic":
        return synthetic_table_sizes(args), {}
    _, metadata = load_or_prepare_movielens("movielens-1m")
    _, _, table_sizes, bag_sizes = dlrm.model_inputs(metadata)
    return table_sizes, bag_sizes


def synthetic_data(args):
    """The Zipf Criteo-profile click log of bench/dlrm_worker.py (or `--synthetic-tables N:ROWS`
    tables of ROWS rows each), each worker's slices of `min(total steps, 100)` global batches
    generated up front and repeated."""
    table_sizes = synthetic_table_sizes(args)
    log = SyntheticClickLog(table_sizes, seed=1, zipf_exponent=args.zipf)
    batches = min(args.warmup + args.steps + args.profile_steps + 3, 100)
    return Data(table_sizes, {}, log.num_dense,
                dlrm.make_dataset_fn(log, 0, batches, args.global_batch, repeat=True))


def movielens_data(args):
    """MovieLens-1M's train split (examples/dlrm.py's input mapping): each input pipeline reads
    every train shard in its own shuffled order; its first batches are cached and repeated, so
    the timed steps do not parse records."""
    data_dir, metadata = load_or_prepare_movielens("movielens-1m")
    schema, to_model_inputs, table_sizes, bag_sizes = dlrm.model_inputs(metadata)
    files = split_files(data_dir, "train", metadata)

    def dataset_fn(context):
        batch = context.get_per_replica_batch_size(args.global_batch)
        dataset = make_dataset(files, schema, batch, shuffle=True,
                               seed=1 + context.input_pipeline_id, num_epochs=None,
                               drop_remainder=True).map(to_model_inputs)
        return dataset.take(MOVIELENS_CYCLE).cache().repeat().prefetch(2)

    test_files = split_files(data_dir, "test", metadata)

    def eval_dataset_fn(context):
        """Each input pipeline's share of the test split's batches, in order."""
        batch = context.get_per_replica_batch_size(args.global_batch)
        dataset = make_dataset(test_files, schema, batch, shuffle=False, num_epochs=1,
                               drop_remainder=True)
        return dataset.shard(context.num_input_pipelines,
                             context.input_pipeline_id).map(to_model_inputs)

    result = Data(table_sizes, bag_sizes, 0, dataset_fn)
    result.eval_dataset_fn = eval_dataset_fn
    return result


# --- embeddings: inputs dict -> list of [B, D] vectors -----------------------------------------
class KerasEmbedder(tf_keras.layers.Layer):
    """One tf_keras `Embedding` per single-hot field (examples/dlrm.py's "keras" tables) and one
    mean-pooled tf_keras `Embedding` per multi-hot feature: the replicated / PS layout."""

    def __init__(self, table_sizes, bag_sizes, dim, seed=0, **kwargs):
        super().__init__(**kwargs)
        self.tables = dlrm.make_embeddings("keras", table_sizes, dim, seed)
        self.bag_names = sorted(bag_sizes)
        self.bags = _keras_bags(bag_sizes, dim, seed)

    def call(self, inputs):
        """inputs dict -> one [B, D] vector per single-hot field, then one per bag."""
        vectors = tf.unstack(self.tables(inputs["sparse"]), axis=1)
        return vectors + [bag(inputs[name]) for bag, name in zip(self.bags, self.bag_names)]


def _keras_bags(bag_sizes, dim, seed):
    return [MeanBag(tf_keras.layers.Embedding(bag_sizes[name], dim, name="bag_table_" + name,
                                              embeddings_initializer=_uniform(seed + 500 + i)),
                    name="bag_" + name)
            for i, name in enumerate(sorted(bag_sizes))]


class ShardedEmbedder(tf_keras.layers.Layer):
    """Ours: one `tnp.ShardedEmbeddingCollection` for the single-hot fields (`tables="fused"`) or
    one `tnp.ShardedEmbedding` layer per field (`"per_table"`: the model written the natural
    Keras way), and a mean-pooled `tnp.ShardedEmbedding` per multi-hot feature (row-sharded over
    the workers)."""

    def __init__(self, table_sizes, bag_sizes, dim, seed=0, tables="fused", **kwargs):
        super().__init__(**kwargs)
        self.tables = dlrm.make_embeddings(tables, table_sizes, dim, seed)
        self.bag_names = sorted(bag_sizes)
        self.bags = [tnp.ShardedEmbedding(bag_sizes[name], dim, combiner="mean", name="bag_" + name,
                                          embeddings_initializer=_uniform(seed + 500 + i))
                     for i, name in enumerate(self.bag_names)]

    def call(self, inputs):
        """inputs dict -> one [B, D] vector per single-hot field, then one per bag."""
        vectors = tf.unstack(self.tables(inputs["sparse"]), axis=1)
        return vectors + [bag(inputs[name]) for bag, name in zip(self.bags, self.bag_names)]


class AllToAllEmbedder(tf_keras.layers.Layer):
    """Horovod model-parallel tables (NVIDIA TF2 DLRM style): this rank holds whole tables
    t with t mod W == rank. Forward: all-to-all of the ids to the owners, local lookups for the
    whole global batch, all-to-all of the rows back; multi-hot bags stay replicated."""

    def __init__(self, hvd, table_sizes, bag_sizes, dim, seed=0, **kwargs):
        super().__init__(**kwargs)
        self.hvd, self.dim = hvd, dim
        workers, rank, fields = hvd.size(), hvd.rank(), len(table_sizes)
        if fields < workers:
            raise ValueError("hvd_alltoall needs at least one table per rank (%d tables, %d ranks)"
                             % (fields, workers))
        # Fields grouped by owner: owner 0's fields, then owner 1's, ...
        self.order = [t for owner in range(workers) for t in range(owner, fields, workers)]
        self.inverse = np.argsort(self.order).tolist()
        self.counts = [len(range(owner, fields, workers)) for owner in range(workers)]
        self.workers, self.rank = workers, rank
        self.tables = [tf_keras.layers.Embedding(table_sizes[t], dim, name="table_%d" % t,
                                                 embeddings_initializer=_uniform(seed + t))
                       for t in range(rank, fields, workers)]
        self.bag_names = sorted(bag_sizes)
        self.bags = _keras_bags(bag_sizes, dim, seed)

    def owned_variables(self):
        """The table variables this rank owns (their gradients are not all-reduced)."""
        return [table.embeddings for table in self.tables]

    def call(self, inputs):
        """inputs dict -> one [B, D] vector per single-hot field (in field order), then bags."""
        ids = inputs["sparse"]
        batch = tf.shape(ids)[0]
        grouped = tf.gather(ids, self.order, axis=1)
        blocks = tf.split(grouped, self.counts, axis=1)  # owner o's block: [b, n_o]
        payload = tf.concat([tf.reshape(block, [-1]) for block in blocks], axis=0)
        splits = tf.stack([batch * n for n in self.counts])
        received, _ = self.hvd.alltoall(payload, splits=splits, name="compare_a2a_ids")
        mine = self.counts[self.rank]
        received = tf.reshape(received, [self.workers, batch, mine])  # [source, sample, my field]
        rows = tf.stack([table(received[:, :, k]) for k, table in enumerate(self.tables)], axis=2)
        rows = tf.reshape(rows, [-1, self.dim])
        back, _ = self.hvd.alltoall(rows, splits=tf.fill([self.workers], batch * mine),
                                    name="compare_a2a_rows")
        pieces = tf.split(back, tf.stack([batch * n for n in self.counts]), num=self.workers)
        columns = tf.concat([tf.reshape(piece, [batch, n, self.dim])
                             for piece, n in zip(pieces, self.counts)], axis=1)
        vectors = tf.unstack(tf.gather(columns, self.inverse, axis=1), axis=1)
        return vectors + [bag(inputs[name]) for bag, name in zip(self.bags, self.bag_names)]


# --- models --------------------------------------------------------------------------------------
class CompareDLRM(dlrm.DLRM):
    """examples/dlrm.py's DLRM (same layers and initializers) on an embedder that maps the whole
    inputs dict to a list of [B, D] vectors (tables and bags of any layout)."""

    def __init__(self, embedder, dim, num_dense):
        super().__init__(embedder, dim=dim, num_dense=num_dense)

    def call(self, inputs):
        """[B, 1] logits: DLRM's bottom MLP, dot interaction and top MLP on the embedder's vectors."""
        vectors = self.embeddings(inputs)
        if self.bottom is None:
            return self.top(tf.concat(vectors + [self.interaction(vectors)], axis=1))
        dense_out = self.bottom(inputs["dense"])
        return self.top(tf.concat([dense_out, self.interaction([dense_out] + vectors)], axis=1))

    def summed_loss(self, features, labels):
        """Sum over the batch of the binary cross-entropy of the logits."""
        return tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(
            tf.reshape(tf.cast(labels, tf.float32), [-1]), tf.reshape(self(features), [-1])))


class CompareDCN(tfrs.Model):
    """TFRS DCN ranking model: embeddings (+ dense features) -> `tfrs.layers.dcn.Cross` -> deep
    tower 64-32-1 -> `tfrs.tasks.Ranking` (SUM reduction, divided by `loss_denominator`)."""

    def __init__(self, embedder, num_dense, loss_denominator, seed=0):
        super().__init__()
        glorot = lambda s: tf_keras.initializers.GlorotUniform(seed=seed + 1000 + s)  # noqa: E731
        self.embeddings = embedder
        self.num_dense = num_dense
        self.loss_denominator = float(loss_denominator)
        self.cross = tfrs.layers.dcn.Cross(kernel_initializer=glorot(0))
        self.deep = tf_keras.Sequential(
            [tf_keras.layers.Dense(64, activation="relu", kernel_initializer=glorot(1)),
             tf_keras.layers.Dense(32, activation="relu", kernel_initializer=glorot(2)),
             tf_keras.layers.Dense(1, kernel_initializer=glorot(3))])
        self.task = tfrs.tasks.Ranking(loss=tf_keras.losses.BinaryCrossentropy(
            from_logits=True, reduction=tf_keras.losses.Reduction.SUM))

    def call(self, inputs):
        """[B, 1] logits: Cross(x0=x, x) then the deep tower on the concatenated features."""
        vectors = self.embeddings(inputs)
        if self.num_dense:
            vectors = vectors + [inputs["dense"]]
        x = tf.concat(vectors, axis=1)
        return self.deep(self.cross(x, x))

    def summed_loss(self, features, labels):
        """Sum over the batch of the ranking task's binary cross-entropy."""
        return self.task(labels=tf.cast(labels, tf.float32), predictions=self(features))

    def compute_loss(self, inputs, training=False):
        """TFRS's training loss: the summed loss over `loss_denominator` (the global batch)."""
        features, labels = inputs
        return self.summed_loss(features, labels) / self.loss_denominator

    def nestpipe_route(self, inputs):
        """tf_nestpipe's route pass: what `compute_loss` looks up (the embeddings of the
        features), so that ours fuses every table's lookup into one exchange per step and can
        pipeline this TFRS model (its train_step is TFRS's own)."""
        features, _ = inputs
        self.embeddings(features)


def build_model(args, data, embedder, loss_denominator):
    """The `--model` on `embedder`; compiled (Adagrad, and for DLRM binary cross-entropy on the
    logits) so that it can be trained with fit. Call under the strategy's scope."""
    if args.model == "dlrm":
        model = CompareDLRM(embedder, args.dim, data.num_dense)
        model.compile(optimizer=tf_keras.optimizers.Adagrad(LEARNING_RATE),
                      loss=tf_keras.losses.BinaryCrossentropy(from_logits=True))
    else:
        model = CompareDCN(embedder, data.num_dense, loss_denominator)
        model.compile(optimizer=tf_keras.optimizers.Adagrad(LEARNING_RATE))
    return model


def _context(workers, index):
    return tf.distribute.InputContext(num_input_pipelines=workers, input_pipeline_id=index,
                                      num_replicas_in_sync=workers)


def summarize(times_s, warmup):
    """Median, p90 and mean (ms) of the step times after `warmup` steps."""
    times = np.asarray(times_s[warmup:]) * 1e3
    return {"steps": int(len(times)), "ms_median": float(np.median(times)),
            "ms_p90": float(np.percentile(times, 90)), "ms_mean": float(times.mean())}


# --- systems -------------------------------------------------------------------------------------
def run_fit(args, data):
    """single / compute_only / mwms / nestpipe: tf_keras fit with a per-step timer; for nestpipe
    with --profile-steps, also the profiling pass to run after the timing is printed."""
    if args.system == "single":
        strategy, rank, workers = tf.distribute.get_strategy(), 0, 1
        kind = "keras"
    elif args.system == "compute_only":
        # One process as `single`, on its own share of the global batch, started W times at
        # once by the launcher (TF_CONFIG says W and this task's index; no server, no strategy).
        strategy = tf.distribute.get_strategy()
        task = json.loads(os.environ["TF_CONFIG"])
        workers, rank = len(task["cluster"]["worker"]), task["task"]["index"]
        kind = "keras"
    elif args.system == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(
                implementation=tf.distribute.experimental.CommunicationImplementation.RING))
        rank, workers, kind = strategy.cluster_resolver.task_id, strategy.num_replicas_in_sync, "keras"
    else:
        pipeline = {"micro_batches": args.micro_batches, "auto_timed_steps": args.auto_timed_steps}
        if args.auto_probe_rounds:
            pipeline["auto_probe_rounds"] = args.auto_probe_rounds
        if args.skip_buffer_sync:  # a diagnostic: what the look-ahead modes' sync costs
            pipeline["unsafe_skip_buffer_sync"] = True
        options = {"pipeline": tnp.PipelineConfig(args.pipeline, **pipeline)}
        options["transport"] = args.collectives  # sockets, tf or horovod
        if args.wire_dtype != "fp32":  # compressed exchanges
            forward, _, backward = args.wire_dtype.partition("-")
            options["wire_dtype"] = {"forward": forward, "backward": backward or forward}
        options["placement"] = args.placement  # table placement
        if args.memory_budget_bytes:  # per worker, tables + optimizer slots
            options["memory_budget_bytes"] = args.memory_budget_bytes
        strategy = tnp.NestPipeStrategy(**options)
        rank, workers, kind = strategy.worker_index, strategy.num_workers, "sharded"
    with strategy.scope():
        if kind == "keras":
            embedder = KerasEmbedder(data.table_sizes, data.bag_sizes, args.dim)
        else:
            embedder = ShardedEmbedder(data.table_sizes, data.bag_sizes, args.dim,
                                       tables=args.tables)
        model = build_model(args, data, embedder, args.global_batch)
    if args.system == "single":
        dataset = data.dataset_fn(tf.distribute.InputContext())
    elif args.system == "compute_only":
        dataset = data.dataset_fn(_context(workers, rank))  # its share: global batch / W
    else:
        dataset = strategy.distribute_datasets_from_function(data.dataset_fn)
    timer, cpu_timer = dlrm.StepTimer(), CpuTimer()
    exchange = strategy.extended.embedding_exchange if kind == "sharded" else None
    before = exchange.wire_stats() if exchange is not None else None
    callbacks = [timer, cpu_timer]
    marks = StepMarks() if args.steps_out else None
    if marks is not None:
        callbacks.append(marks)
    if kind == "sharded" and args.pipeline == "auto":
        # auto's probe is not the mode it chose: warm-up and timing start after the choice.
        settled = AutoSettled(args.warmup + args.steps)
        callbacks.append(settled)
        # The epoch fit is told is the job auto's probe budget sees (a share of it); the row
        # stops once its warm-up and timed steps after the choice are done.
        steps = max(args.warmup + args.steps + auto_probe_steps_limit(strategy),
                    args.auto_job_steps)
    else:
        settled, steps = None, args.warmup + args.steps
    model.fit(dataset, epochs=1, steps_per_epoch=steps, callbacks=callbacks, verbose=0)
    if args.times_out and rank == 0:
        with open(args.times_out, "w") as f:
            json.dump([1e3 * t for t in timer.times], f)
    probe = settled.probe_steps if settled is not None else 0
    if marks is not None and rank == 0:
        with open(args.steps_out, "w") as f:  # timed: after the probe and the warm-up steps
            json.dump([{"start": start, "end": end, "timed": i >= probe + args.warmup}
                       for i, (start, end) in enumerate(marks.steps)], f)
    if settled is not None and probe is None:
        raise RuntimeError("pipeline='auto' made no choice within %d steps"
                           % auto_probe_steps_limit(strategy))
    if args.probe_steps_out and settled is not None:
        # Every rank's probe steps (perf_counter = CLOCK_MONOTONIC seconds), for
        # bench/probe_profile.py to attribute a profiler's samples to the candidates.
        with open(args.probe_steps_out.format(rank=rank), "w") as f:
            json.dump([step._asdict() for step in model._nestpipe_pipeline.probe_log], f)
    result = summarize(timer.times[probe:], args.warmup)
    result.update(cpu_timer.cpu_per_step(probe + args.warmup))
    result.update(pipeline_facts(model))
    if kind == "sharded":
        result.update(placement_facts(strategy))
    if probe:
        result["auto_probe_steps"] = probe
        # The probe's cost: its steps' time beyond the same steps at the chosen mode's median.
        chosen = statistics.median(timer.times[probe + args.warmup:] or timer.times[probe:])
        result["auto_probe_extra_s"] = max(sum(timer.times[:probe]) - probe * chosen, 0.0)
        result["auto_job_steps"] = steps
    if exchange is not None:
        after = exchange.wire_stats()
        steps = len(timer.times)
        result["wire_dtype"] = str(exchange.wire.dtype)
        result["wire_bytes_per_step"] = {k: (after[k] - before[k]) / steps
                                         for k in after if k != "clamped"}
        result["clamped"] = after["clamped"] - before["clamped"]
        # The dense weights' all-reduce is not an embedding exchange: its bytes, for the link's
        # share of a step (bench/family_report.py's wire bound).
        result["dense_bytes"] = sum(v.shape.num_elements() * v.dtype.size
                                    for v in model.trainable_variables if not is_row_shard(v))
    if args.eval_batches:
        result["auc"] = held_out_auc(args, strategy, model, data)
    profiling = None
    if args.profile_steps:
        # Ours, and the one-process baselines (single, compute_only: what a step's ops cost
        # without the exchange), op by op.
        profiling = lambda: profiling_pass(strategy, model, dataset, args.profile_steps,  # noqa: E731
                                           args.trace, rank, workers if kind == "sharded" else 1)
    return rank, workers, result, profiling


def auto_probe_steps_limit(strategy):
    """The steps an auto row may take to choose before it is an error: at least 1000, and room
    for 8 candidates' rounds (the strategy's probe rounds and timed steps) with their settle and
    held steps."""
    return max(1000, 8 * strategy.auto_probe_rounds * (strategy.auto_timed_steps + 4))


class CpuTimer(tf_keras.callbacks.Callback):
    """This process's CPU time (every thread: TensorFlow's pools, the socket mesh's, Keras's
    loop) and wall time when training starts and after every step, to tell a step's CPU work
    from its waiting (`cpu_per_step`)."""

    def on_train_begin(self, logs=None):
        self.marks = [self._mark()]  # marks[i]: before step i (after step i - 1)

    def on_train_batch_end(self, batch, logs=None):
        self.marks.append(self._mark())

    @staticmethod
    def _mark():
        times = os.times()
        return time.perf_counter(), time.process_time(), times.system

    def cpu_per_step(self, first):
        """Over steps `first` to the last: `{"cpu_ms_per_step": this process's CPU ms per step,
        "cpu_busy": CPU time / wall time` (1.0: one core busy all the time), `"cpu_sys_ms_per_step":
        the part of it spent in the kernel}` (system calls, and the network stack's work done in
        them: on an emulated link each packet crosses a veth pair, a bridge and a qdisc), or {}
        if there are no such steps."""
        steps = len(self.marks) - 1 - first
        if steps < 1:
            return {}
        (wall_start, cpu_start, sys_start), (wall_end, cpu_end, sys_end) = (self.marks[first],
                                                                            self.marks[-1])
        return {"cpu_ms_per_step": (cpu_end - cpu_start) / steps * 1e3,
                "cpu_busy": (cpu_end - cpu_start) / max(wall_end - wall_start, 1e-9),
                "cpu_sys_ms_per_step": (sys_end - sys_start) / steps * 1e3}


class StepMarks(tf_keras.callbacks.Callback):
    """Every fit step's start and end (`time.perf_counter`, CLOCK_MONOTONIC seconds, the clock
    of `perf record -k CLOCK_MONOTONIC`), for bench/bound_profile.py to give a profiler's
    samples to the steps they fell in."""

    def on_train_begin(self, logs=None):
        self.steps = []

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append((self._start, time.perf_counter()))


class AutoSettled(tf_keras.callbacks.Callback):
    """Under pipeline="auto": notes the step at which the probe chose (`probe_steps`) and stops
    fit `steps_after` steps later, so that a row's warm-up and timed steps are the chosen mode's."""

    def __init__(self, steps_after):
        super().__init__()
        self.steps_after = steps_after
        self.probe_steps = None

    def on_train_batch_end(self, batch, logs=None):
        pipeline = getattr(self.model, "_nestpipe_pipeline", None)
        if self.probe_steps is None and (pipeline is None or pipeline.choice is not None):
            self.probe_steps = batch + 1  # no pipeline (Keras's own train function): no probe
        if self.probe_steps is not None and batch + 1 - self.probe_steps >= self.steps_after:
            self.model.stop_training = True


def pipeline_facts(model):
    """Ours under fit: the collectives a step issues (as traced), the fused exchanges per step
    and, under pipeline="auto", the mode it chose and the probe's timings."""
    pipeline = getattr(model, "_nestpipe_pipeline", None)
    if pipeline is None:
        return {}
    facts = {"exchanges": pipeline.stats.exchanges}
    if pipeline.stats.collectives is not None:
        facts["collectives_per_step"] = pipeline.stats.collectives.total
        facts["collectives_detail"] = pipeline.stats.collectives.describe()
    if getattr(pipeline, "choice", None) is not None:
        facts["auto_choice"] = str(pipeline.choice)
        facts["auto_timings_ms"] = pipeline.timings_ms
        if getattr(pipeline, "cpu", None):  # this worker's process CPU per probed mode
            # A mode the probe stopped before timing (its budget spent) has no CPU use.
            facts["auto_cpu"] = {name: list(use) for name, use in pipeline.cpu.items()
                                 if use is not None}
    return facts


def placement_facts(strategy):
    """Ours: the planner's placements (how many tables each) and the bytes of tables + slots
    the fullest worker holds (the planner's count: 2 optimizer slots assumed)."""
    planner = strategy.extended.placement_planner
    counts = {}
    for plan in planner.plans:
        counts[plan.placement] = counts.get(plan.placement, 0) + 1
    return {"placements": counts, "table_bytes_per_worker": planner.used_bytes()}


HELD_OUT_FIRST_BATCH = 10 ** 6  # synthetic batches from here on are never trained on


def held_out_auc(args, strategy, model, data):
    """The trained DLRM's AUC (tf_keras `AUC`, over the global batch) on `--eval-batches`
    held-out global batches: recompiled with the metric (same optimizer), then `evaluate`."""
    if args.model != "dlrm":
        raise ValueError("--eval-batches needs --model dlrm")
    if args.data == "synthetic":
        log = SyntheticClickLog(data.table_sizes, seed=1, zipf_exponent=args.zipf)
        eval_fn = dlrm.make_dataset_fn(log, HELD_OUT_FIRST_BATCH, args.eval_batches,
                                       args.global_batch, repeat=False)
    else:
        eval_fn = data.eval_dataset_fn
    with strategy.scope():
        model.compile(optimizer=model.optimizer,
                      loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
                      metrics=[tf_keras.metrics.AUC(from_logits=True, name="auc")])
    if args.system == "single":
        dataset = eval_fn(tf.distribute.InputContext())
    else:
        dataset = strategy.distribute_datasets_from_function(eval_fn)
    return float(model.evaluate(dataset, steps=args.eval_batches, verbose=0,
                                return_dict=True)["auc"])


def profiling_pass(strategy, model, dataset, steps, trace="", rank=0, workers=1):
    """`steps` more steps on every worker, profiled on rank 0: its communication and exposure,
    or `profile_error` naming why the profile failed. The `workers` of one strategy (ours) return
    together; a compute_only process (`workers` 1) profiles its own steps if it is rank 0."""
    try:
        result = profile(model, dataset, steps, trace, enabled=rank == 0)
    except Exception as e:  # pylint: disable=broad-except  (timing stands without it)
        result = {"profile_error": "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:200])}
    # Rank 0 reads its trace for seconds after the last step; a Horovod-collectives rank that
    # exited meanwhile was seen to hang in its exit (until the row's timeout), so wait for it.
    if workers > 1:
        strategy.extended.collectives.all_gather(tf.constant([1], tf.int32), "compare/exit")
    return result


def run_psv2(args, data):
    """TF ParameterServerStrategy + MinSizePartitioner, coordinator-scheduled custom steps."""
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    cluster = resolver.cluster_spec().as_dict()
    workers, num_ps = len(cluster.get("worker", [])), len(cluster.get("ps", []))
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=args.min_shard_bytes, max_shards=num_ps)
    strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    local_batch = args.global_batch // workers
    example = next(iter(data.dataset_fn(_context(workers, 0))))[0]
    with strategy.scope():
        model = build_model(args, data, KerasEmbedder(data.table_sizes, data.bag_sizes, args.dim),
                            local_batch)
        model(example)
        optimizer = tf_keras.optimizers.Adagrad(LEARNING_RATE)
    shards = sum(len(getattr(v, "variables", [v])) for v in model.trainable_variables)
    iterator = iter(coordinator.create_per_worker_dataset(
        lambda: data.dataset_fn(_context(workers, 0))))

    @tf.function
    def step(iterator):
        def replica_fn(features, labels):
            with tf.GradientTape() as tape:
                loss = model.summed_loss(features, labels) / local_batch
            variables = model.trainable_variables
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return loss
        return strategy.run(replica_fn, args=next(iterator))

    times = []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        for _ in range(workers):
            coordinator.schedule(step, args=(iterator,))
        coordinator.join()
        times.append(time.perf_counter() - start)
    result = summarize(times, args.warmup)
    start = time.perf_counter()
    for _ in range(args.steps * workers):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    result["async_samples_per_s"] = args.steps * args.global_batch / (time.perf_counter() - start)
    result["ps_tasks"], result["variable_shards"] = num_ps, shards
    return 0, workers, result, None


def run_horovod(args, data):
    """Horovod custom loop: replicated tables + DistributedGradientTape, or all-to-all tables."""
    import horovod.tensorflow as hvd  # pylint: disable=import-outside-toplevel
    hvd.init()
    workers, rank = hvd.size(), hvd.rank()
    if args.global_batch % workers:
        raise SystemExit("--global-batch must be divisible by the %d ranks" % workers)
    if args.system == "hvd_alltoall":
        embedder = AllToAllEmbedder(hvd, data.table_sizes, data.bag_sizes, args.dim)
    else:
        embedder = KerasEmbedder(data.table_sizes, data.bag_sizes, args.dim)
    model = build_model(args, data, embedder, args.global_batch)
    optimizer = tf_keras.optimizers.Adagrad(LEARNING_RATE)
    iterator = iter(data.dataset_fn(_context(workers, rank)))
    model(next(iterator)[0])
    owned = embedder.owned_variables() if args.system == "hvd_alltoall" else []
    owned_ids = {id(v) for v in owned}
    replicated = [v for v in model.variables if id(v) not in owned_ids]
    hvd.broadcast_variables(replicated, root_rank=0)
    variables = model.trainable_variables
    # Horovod pairs collectives by name: number the replicated variables only, so that every
    # rank gives a variable's gradient the same name however many tables it owns.
    names = {}
    for v in variables:
        if id(v) not in owned_ids:
            names[id(v)] = "compare_grad_%d" % len(names)

    @tf.function
    def step(iterator):
        features, labels = next(iterator)
        with tf.GradientTape() as tape:
            loss = model.summed_loss(features, labels) / args.global_batch
        if not owned:
            tape = hvd.DistributedGradientTape(tape, op=hvd.Sum)
            gradients = tape.gradient(loss, variables)
        else:
            gradients = tape.gradient(loss, variables)
            gradients = [g if id(v) in owned_ids else hvd.allreduce(g, op=hvd.Sum, name=names[id(v)])
                         for g, v in zip(gradients, variables)]
        optimizer.apply_gradients(zip(gradients, variables))
        return loss

    times = []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        step(iterator).numpy()
        times.append(time.perf_counter() - start)
    result = summarize(times, args.warmup)
    result["horovod"] = __import__("horovod").__version__
    return rank, workers, result, None


def main():
    """Parses the flags, runs the system and prints `RESULT {json}` on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", required=True, choices=SYSTEMS)
    parser.add_argument("--pipeline", default="none", help="nestpipe: auto/none/dbp/fwp/nested")
    parser.add_argument("--collectives", default="tf", help="nestpipe: tf or horovod")
    parser.add_argument("--model", choices=["dlrm", "dcn"], default="dlrm")
    parser.add_argument("--data", choices=["synthetic", "movielens-1m"], default="synthetic")
    parser.add_argument("--steps", type=int, default=50, help="timed steps (after warm-up)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--table-scale", type=float, default=0.002)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--tables", choices=["fused", "per_table"], default="fused",
                        help="nestpipe: one collection, or one ShardedEmbedding layer per field")
    parser.add_argument("--zipf", type=float, default=1.2,
                        help="synthetic: the ids' Zipf exponent (> 1; nearer 1 = milder skew, "
                             "more distinct ids per batch)")
    parser.add_argument("--synthetic-tables", default="",
                        help="synthetic: N:ROWS tables of ROWS rows instead of the Criteo profile")
    parser.add_argument("--auto-timed-steps", type=int, default=4,
                        help="nestpipe pipeline=auto: timed probe steps per mode")
    parser.add_argument("--auto-job-steps", type=int, default=0,
                        help="nestpipe pipeline=auto: the epoch fit is told (the job whose 5%% "
                             "the probe may spend; the row stops after its timed steps)")
    parser.add_argument("--auto-probe-rounds", type=int, default=0,
                        help="nestpipe pipeline=auto: probe rounds (0: the strategy's default)")
    parser.add_argument("--profile-steps", type=int, default=0, help="nestpipe: profiled steps")
    parser.add_argument("--probe-steps-out", default="",
                        help="nestpipe pipeline=auto: write each rank's probe steps (candidate, "
                             "start, end, timed) to this JSON path ('{rank}' is replaced)")
    parser.add_argument("--steps-out", default="",
                        help="write rank 0's fit steps (start, end: perf_counter seconds; "
                             "timed) to this JSON (bench/bound_profile.py)")
    parser.add_argument("--times-out", default="",
                        help="write rank 0's per-step wall times (ms, every fit step) to this JSON")
    parser.add_argument("--trace", default="",
                        help="nestpipe with --profile-steps: write rank 0's profiled steps to "
                             "this Chrome trace (chrome://tracing, Perfetto)")
    parser.add_argument("--min-shard-bytes", type=int, default=64 << 10, help="psv2 partitioner")
    parser.add_argument("--wire-dtype", default="fp32",
                        help="nestpipe: FORWARD-BACKWARD wire dtypes, e.g. int8-bf16 (issue 19)")
    parser.add_argument("--placement", default="auto",
                        help="nestpipe: auto (the strategy's default), row_wise, table_wise or "
                             "data_parallel (issue 15)")
    parser.add_argument("--memory-budget-bytes", type=int, default=0,
                        help="nestpipe: NestPipeStrategy(memory_budget_bytes=...), tables + "
                             "slots per worker (0: none); with --memory-check-workers, the "
                             "budget checked")
    parser.add_argument("--memory-check-workers", type=int, default=0,
                        help="print `MEMORY {json}`: whether --system's tables + Adagrad slots "
                             "fit --memory-budget-bytes per process on this many workers "
                             "(bench/compare_memory.py; computed, nothing trained), and exit")
    parser.add_argument("--skip-buffer-sync", action="store_true",
                        help="nestpipe, a diagnostic: NestPipeStrategy(unsafe_skip_buffer_sync="
                             "True), the look-ahead pipelines without their buffer sync (training "
                             "is NOT exact: it reads rows a step stale); prices the sync")
    parser.add_argument("--eval-batches", type=int, default=0,
                        help="dlrm: held-out global batches for the AUC after training")
    args = parser.parse_args()
    if args.memory_check_workers:
        table_sizes, bag_sizes = table_sizes_of(args)
        print("MEMORY " + json.dumps(memory_verdict(
            args.system, table_sizes, bag_sizes, args.dim, args.memory_check_workers,
            args.memory_budget_bytes)), flush=True)
        return
    data = synthetic_data(args) if args.data == "synthetic" else movielens_data(args)
    if args.system == "psv2":
        rank, workers, result, profiling = run_psv2(args, data)
    elif args.system.startswith("hvd_"):
        rank, workers, result, profiling = run_horovod(args, data)
    else:
        rank, workers, result, profiling = run_fit(args, data)
    result.update({"system": args.system, "workers": workers, "global_batch": args.global_batch,
                   "samples_per_s": args.global_batch / result["ms_median"] * 1e3})
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    if profiling is not None:
        profiled = profiling()
        if rank == 0:
            print("PROFILE " + json.dumps(profiled), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
