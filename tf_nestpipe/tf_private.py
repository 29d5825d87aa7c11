"""The one module through which tf_nestpipe reaches TensorFlow's, tf_keras', Keras 3's and
keras-rs's private APIs (`tensorflow.python.*`, `tf_keras.src.*`, `keras.src.*`, private
attributes). When TensorFlow or tf_keras
changes them, only this file changes; `tests/test_layering.py` checks that no other module of
the package imports them.

It imports nothing of tf_nestpipe, so every layer (ops, collectives, sharding, pipeline,
strategy) may import it. The modules are re-exported under the names below; the functions wrap
the private attributes the package reads."""
# pylint: disable=unused-import
import contextlib

import tensorflow as tf
import tf_keras
from tensorflow.python.autograph.core import config as autograph_config  # noqa: F401
from tensorflow.python.checkpoint import graph_view  # noqa: F401
from tensorflow.python.checkpoint import tensor_callable  # noqa: F401
from tensorflow.python.data.ops import multi_device_iterator_ops  # noqa: F401
from tensorflow.python.distribute import collective_all_reduce_strategy  # noqa: F401
from tensorflow.python.distribute import distribute_lib  # noqa: F401
from tensorflow.python.distribute import distribute_utils  # noqa: F401
from tensorflow.python.distribute import input_ops  # noqa: F401
from tensorflow.python.distribute import multi_worker_util  # noqa: F401
from tensorflow.python.distribute import ps_values  # noqa: F401
from tensorflow.python.distribute import reduce_util  # noqa: F401
from tensorflow.python.distribute import values as distribute_values  # noqa: F401
from tensorflow.python.distribute.cluster_resolver import cluster_resolver as cluster_resolver_lib  # noqa: F401
from tensorflow.python.distribute.cluster_resolver import tfconfig_cluster_resolver  # noqa: F401
from tensorflow.python.distribute.coordinator import cluster_coordinator as cluster_coordinator_lib  # noqa: F401
from tensorflow.python.eager import context as eager_context  # noqa: F401
from tensorflow.python.framework import auto_control_deps_utils  # noqa: F401
from tensorflow.python.framework import ops as framework_ops  # noqa: F401
from tensorflow.python.ops import collective_ops  # noqa: F401
from tensorflow.python.ops import resource_variable_ops  # noqa: F401
from tensorflow.python.saved_model import save_context  # noqa: F401
from tensorflow.python.trackable import base as trackable_base  # noqa: F401
from tensorflow.python.trackable import trackable_utils  # noqa: F401
from tf_keras.src.engine import training as keras_training  # noqa: F401  (Model, reduce_per_replica)
from tf_keras.src.layers.core import embedding as keras_embedding  # noqa: F401  (Embedding)
from tf_keras.src.mixed_precision import loss_scale_optimizer as keras_loss_scale  # noqa: F401
from tf_keras.src.saving import saving_api as keras_saving_api  # noqa: F401  (save_model, load_model)


# --- tf.function ----------------------------------------------------------------------------------
def call_concrete_flat(concrete, flat_inputs):
    """Runs a `ConcreteFunction` on its inputs already flattened (composites expanded), without
    the argument matching of a call; returns its structured outputs."""
    return concrete._call_flat(flat_inputs, concrete.captured_inputs)  # pylint: disable=protected-access


def single_replica_spec(spec):
    """`spec` (an element spec of a distributed iterator) with every `PerReplicaSpec` of one
    replica replaced by that replica's spec."""
    def unwrap(leaf):
        if isinstance(leaf, distribute_values.PerReplicaSpec):
            value_specs = leaf._value_specs  # pylint: disable=protected-access
            if len(value_specs) != 1:
                raise ValueError("expected one replica per worker, got a spec of %d"
                                 % len(value_specs))
            return value_specs[0]
        return leaf

    return tf.nest.map_structure(unwrap, spec)


# --- tf_keras models ------------------------------------------------------------------------------
def in_saved_model_trace():
    """True while `tf.saved_model.save` (or tf_keras' SavedModel save) traces functions."""
    return save_context.in_save_context()


def is_graph_network(model):
    """True for a functional or Sequential-with-inputs model (its inputs are known)."""
    return bool(getattr(model, "_is_graph_network", False))


def nested_inputs(model):
    """A graph network's inputs in the structure it is called with (dict, list or tensor)."""
    return model._nested_inputs  # pylint: disable=protected-access


def keras_cluster_coordinator(model):
    """The `ClusterCoordinator` tf_keras made for a model under a parameter-server strategy."""
    return model._cluster_coordinator  # pylint: disable=protected-access


def build_input_shape(model):
    """The input shape a model was built with (`model.build(shape)`)."""
    return model._build_input_shape  # pylint: disable=protected-access


def flatten_layers(model):
    """Every layer of a tf_keras model or layer, nested ones included (itself first)."""
    return model._flatten_layers()  # pylint: disable=protected-access


def steps_per_execution(model):
    """The compiled model's `steps_per_execution` variable (None before compile)."""
    return model._steps_per_execution  # pylint: disable=protected-access


def train_counter(model):
    """The compiled model's step counter (`model._train_counter`), incremented by each step."""
    return model._train_counter  # pylint: disable=protected-access


def minimum_control_deps(outputs):
    """The outputs a train step's counter increment must wait for (tf_keras' own rule)."""
    return keras_training._minimum_control_deps(outputs)  # pylint: disable=protected-access


def validate_target_and_loss(model, y, loss):
    """tf_keras' check that a compiled model got targets for its loss (the error of `fit`)."""
    model._validate_target_and_loss(y, loss)  # pylint: disable=protected-access


# --- tf.data --------------------------------------------------------------------------------------
def serialized_dataset_graph(dataset, external_state_policy):
    """A dataset's graph as a serialized `GraphDef` (a scalar string tensor)."""
    return dataset._as_serialized_graph(  # pylint: disable=protected-access
        external_state_policy=external_state_policy)


def device_datasets_without_autotune():
    """From now on in this process, the per-device datasets of TensorFlow's multi-device
    iterators (the prefetch every distributed dataset's iterator puts behind its source, one per
    device) are built with tf.data autotuning off. Idempotent; elements are unchanged.

    Such a dataset has nothing to tune (a fixed prefetch buffer), but autotuning gives its
    iterator a model thread, and in a multi-worker cluster (MultiWorkerMirroredStrategy too,
    TF 2.21) that thread sometimes sleeps through the iterator's deletion: the deletion (the end
    of `fit`, a custom loop dropping its iterator) then blocks until the thread's next
    optimization round, which backs off to as long as the iterator has lived (up to a minute).
    The source dataset's own iterator autotunes as its options say (docs/guides/reliability.md,
    "Fewer stalls when an iterator is deleted")."""
    create = multi_device_iterator_ops._create_device_dataset  # pylint: disable=protected-access
    if getattr(create, "_nestpipe_without_autotune", False):
        return

    def create_without_autotune(*args, **kwargs):
        options = tf.data.Options()
        options.autotune.enabled = False
        return create(*args, **kwargs).with_options(options)

    create_without_autotune._nestpipe_without_autotune = True
    create_without_autotune.__wrapped__ = create  # the stock function
    multi_device_iterator_ops._create_device_dataset = create_without_autotune  # pylint: disable=protected-access


def iterator_never_ends(iterator):
    """Whether `iterator` (a tf.distribute iterator) reads a dataset of infinite cardinality
    (e.g. repeated), as TensorFlow's partial-batch handling reads it: its `next` never reaches
    an end. False when unknown (another iterator, a finite or unknown cardinality)."""
    cardinality = getattr(iterator, "_cardinality", None)  # DistributedIterator's, TF 2.21
    return cardinality is not None and cardinality == tf.data.INFINITE_CARDINALITY


def local_next_as_optional(iterator):
    """The next element of this worker's part of `iterator` (a tf.distribute iterator with one
    device per worker) as an Optional read on this worker alone, or None when that would not
    be the element the distributed iterator gives: its partial-batch handling is on (its reads
    agree across workers, by an all-reduce each, whether any has data left) or it is not such
    an iterator. With the handling off every worker holds as many elements as the others (see
    `tf_nestpipe.data.autoshard.equal_static_shares`), so a local read ends when all do."""
    if getattr(iterator, "_enable_get_next_as_optional", True):  # DistributedIterator, TF 2.21
        return None
    workers = getattr(iterator, "_iterators", None)
    if not workers or len(workers) != 1 or len(getattr(workers[0], "_devices", ())) != 1:
        return None
    (optional,) = workers[0].get_next_as_optional_list()
    return optional


# --- tf.distribute strategies ---------------------------------------------------------------------
def variable_partitioner(extended):
    """A parameter-server strategy's variable partitioner (its `extended`'s)."""
    return extended._variable_partitioner  # pylint: disable=protected-access


def num_ps(extended):
    """The number of ps tasks of a parameter-server strategy's `extended`."""
    return extended._num_ps  # pylint: disable=protected-access


def num_workers(extended):
    """The number of worker tasks of a parameter-server strategy's `extended`."""
    return extended._num_workers  # pylint: disable=protected-access


def cluster_resolver(extended):
    """The cluster resolver a multi-worker strategy's `extended` was built with."""
    return extended._cluster_resolver  # pylint: disable=protected-access


def per_worker_variable_creator(extended):
    """The function a parameter-server strategy's `extended` creates per-worker variables with."""
    return extended._create_per_worker_variable  # pylint: disable=protected-access


def set_per_worker_variable_creator(extended, creator):
    """Replaces the function `extended` creates per-worker variables with."""
    extended._create_per_worker_variable = creator  # pylint: disable=protected-access


def is_ps_failure(error):
    """Whether `ClusterCoordinator` takes `error` for a parameter-server failure."""
    return cluster_coordinator_lib._is_ps_failure(error)  # pylint: disable=protected-access


def failed_ps_tasks(message):
    """The ps task indices `ClusterCoordinator` reads from a failure's message."""
    return cluster_coordinator_lib._extract_failed_ps_instances(message)  # pylint: disable=protected-access


# --- ops and the gradient tape --------------------------------------------------------------------
def register_read_only_resource_op(op_type):
    """Declares that ops of `op_type` never update the resources they take: `tf.function`'s
    automatic control dependencies order them after earlier writes and before later ones, but not
    against other reads (as for `ResourceGather`)."""
    auto_control_deps_utils.register_read_only_resource_op(op_type)


def variable_accessed(variable):
    """Records `variable` as read, for the gradient tapes and the function being traced, as its
    own read ops do: an op that then takes its handle is recorded on the tapes."""
    resource_variable_ops.variable_accessed(variable)


def lazy_read(variable, op):
    """What a resource variable's own `scatter_*` methods return after running `op` on it: the
    variable, read only when used, after `op`."""
    return variable._lazy_read(op)  # pylint: disable=protected-access


def variable_shape(handle):
    """The shape (int32) of the variable behind resource `handle`, as a gather's gradient reads
    it."""
    return resource_variable_ops.variable_shape(handle)


def accept_strategy_in_backup(callback, strategy_class):
    """Adds `strategy_class` to the strategies a tf_keras `BackupAndRestore` accepts."""
    supported = tuple(callback._supported_strategies)  # pylint: disable=protected-access
    if strategy_class not in supported:
        callback._supported_strategies = supported + (strategy_class,)  # pylint: disable=protected-access


# --- Keras 3 (`import keras`, TensorFlow backend) -------------------------------------------------
# Imported on first use: a tf_keras user's process never loads Keras 3.
def keras3_tf_trainer_module():
    """Keras 3's TensorFlow trainer module (`TensorFlowTrainer`, its `reduce_per_replica`)."""
    from keras.src.backend.tensorflow import trainer  # pylint: disable=import-outside-toplevel
    return trainer


def keras3_tf_optimizer_class():
    """Keras 3's TensorFlow optimizer base class (`TFOptimizer`: its gradients' all-reduce)."""
    from keras.src.backend.tensorflow import optimizer  # pylint: disable=import-outside-toplevel
    return optimizer.TFOptimizer


def keras3_base_optimizer_class():
    """Keras 3's backend-independent optimizer base class (its `load_own_variables`)."""
    from keras.src.optimizers import base_optimizer  # pylint: disable=import-outside-toplevel
    return base_optimizer.BaseOptimizer


def keras3_trackable_layers(model):
    """Every layer of a Keras 3 model or layer, nested ones included (itself first)."""
    return list(model._flatten_layers())  # pylint: disable=protected-access


def is_keras3_object(obj):
    """Whether `obj` is an instance of a Keras 3 class (a `keras.src` module's), without
    importing Keras 3."""
    return any(cls.__module__.startswith("keras.src.") for cls in type(obj).__mro__)


def keras3_variable_value(variable):
    """The `tf.Variable` behind a Keras 3 variable (anything else as it is)."""
    return variable.value if is_keras3_object(variable) else variable


def keras3_input_structure(model):
    """A Keras 3 functional model's inputs as `tf.TensorSpec`s in the structure it is called
    with (None for a model without symbolic inputs)."""
    structure = getattr(model, "_inputs_struct", None)  # Functional's, Keras 3.15
    if structure is None:
        return None
    return tf.nest.map_structure(
        lambda t: tf.TensorSpec(t.shape, t.dtype, name=getattr(t, "name", None)), structure)


@contextlib.contextmanager
def keras3_eager_variable_creation():
    """Within this context Keras 3 creates variables at once, outside any `StatelessScope`
    (where it would defer them to the scope's exit) and any function graph (`tf.init_scope`):
    a sharded table must be created while its row-shard context is active."""
    from keras.src.backend.common import global_state  # pylint: disable=import-outside-toplevel
    previous = global_state.get_global_attribute("stateless_scope")
    global_state.set_global_attribute("stateless_scope", None)
    try:
        with tf.init_scope():
            yield
    finally:
        global_state.set_global_attribute("stateless_scope", previous)


def saved_model_op_types(path):
    """Every op type the SavedModel at `path` uses (its graph and its functions)."""
    import os  # pylint: disable=import-outside-toplevel
    from tensorflow.core.protobuf import saved_model_pb2  # pylint: disable=import-outside-toplevel
    proto = saved_model_pb2.SavedModel()
    with tf.io.gfile.GFile(os.path.join(path, "saved_model.pb"), "rb") as f:
        proto.ParseFromString(f.read())
    types = set()
    for meta_graph in proto.meta_graphs:
        types.update(node.op for node in meta_graph.graph_def.node)
        for function in meta_graph.graph_def.library.function:
            types.update(node.op for node in function.node_def)
    return types


def keras3_export_archive_variables(archive):
    """The `tf.Variable`s a Keras 3 `ExportArchive` will save: those its endpoints use (traced
    here if not yet, as its `write_out` traces them) and those of the layers it tracks."""
    trainable, non_trainable = archive._get_variables_used_by_endpoints()  # pylint: disable=protected-access
    tracked = getattr(archive._tf_trackable, "variables", [])  # pylint: disable=protected-access
    return [keras3_variable_value(v) for v in list(trainable) + list(non_trainable)
            + list(tracked)]


def keras3_export_archive_class():
    """Keras 3's SavedModel `ExportArchive` base class (its `write_out`, which `model.export`
    and `keras.export.ExportArchive` write through)."""
    from keras.src.export import saved_model_export_archive  # pylint: disable=import-outside-toplevel
    return saved_model_export_archive.SavedModelExportArchive


# --- keras-rs (Keras 3's recommenders library; imported only where the user imported it) -------
# The private methods of `keras_rs.layers.DistributedEmbedding` (keras-rs 0.4) by role:
# "init_tables": `_default_device_init(feature_configs, table_stacking)` makes the tables of the
#     features placed off TPU SparseCore ({path: FeatureConfig});
# "call_tables": `_default_device_call(inputs, weights=None, training=False)` looks them up
#     ({path: ids} -> {path: embedding});
# "read_tables": `_default_device_get_embedding_tables()` reads them ({table name: table});
# "init_sparsecore": `_sparsecore_init(feature_configs, table_stacking)` makes SparseCore tables.
# "place_features": `_init_feature_configs_structures(feature_configs)` resolves each feature's
#     placement (before the tables are made).
_KERAS_RS_METHODS = {"init_tables": "_default_device_init", "call_tables": "_default_device_call",
                     "read_tables": "_default_device_get_embedding_tables",
                     "init_sparsecore": "_sparsecore_init",
                     "place_features": "_init_feature_configs_structures"}


# Our wrappers of TensorFlow's, tf_keras', Keras 3's and keras-rs' functions carry this mark, so
# installing a hook again keeps the wrapper instead of wrapping it twice.
_HOOKED = "_nestpipe_hooked"


def mark_hooked(wrapper):
    """Marks `wrapper` as one of our wrappers (`is_hooked`) and returns it."""
    setattr(wrapper, _HOOKED, True)
    return wrapper


def is_hooked(function):
    """Whether `function` is one of our wrappers (`mark_hooked`)."""
    return getattr(function, _HOOKED, False)


def wrap_keras_sparse_dedup(wrap):
    """Replaces tf_keras optimizers' summing of duplicate rows in sparse gradients (the
    `_deduplicate_sparse_grad(self, grads)` every `Optimizer.apply_gradients` runs on its
    gradients, a `tf.unique` and a segment-sum per `IndexedSlices`) with `wrap(original)`;
    idempotent (a method already replaced, `is_hooked`, is kept)."""
    owner = next(klass for klass in tf_keras.optimizers.Optimizer.__mro__
                 if "_deduplicate_sparse_grad" in vars(klass))
    original = vars(owner)["_deduplicate_sparse_grad"]
    if not is_hooked(original):
        setattr(owner, "_deduplicate_sparse_grad", mark_hooked(wrap(original)))


def wrap_keras_rs_distributed_embedding(wrappers):
    """Replaces each private method of keras-rs's `DistributedEmbedding` named by a role of
    `wrappers` ({role: wrap}, roles above) with `wrap(original)`; a method already replaced
    (`is_hooked`) is kept, so this is idempotent."""
    import keras_rs  # pylint: disable=import-outside-toplevel
    layer_class = keras_rs.layers.DistributedEmbedding
    for role, wrap in wrappers.items():
        name = _KERAS_RS_METHODS[role]
        original = getattr(layer_class, name)
        if not is_hooked(original):
            setattr(layer_class, name, wrap(original))


def keras_rs_move_to_default_device(layer, movable):
    """Places the features of a keras-rs `DistributedEmbedding` that it placed on "sparsecore"
    and for which `movable(feature_config)` holds on "default_device" instead (in its
    placement -> path -> FeatureConfig dict and its per-feature placements), after its
    `_init_feature_configs_structures` and before it makes its tables. Returns {path:
    FeatureConfig} moved."""
    import keras  # pylint: disable=import-outside-toplevel
    by_placement = layer._placement_to_path_to_feature_config  # pylint: disable=protected-access
    moved = {path: feature for path, feature in by_placement.get("sparsecore", {}).items()
             if movable(feature)}
    if not moved:
        return moved
    for path in moved:
        del by_placement["sparsecore"][path]
    if not by_placement["sparsecore"]:
        del by_placement["sparsecore"]
    by_placement.setdefault("default_device", {}).update(moved)
    for placed in keras.tree.flatten(layer._feature_deeply_nested_placement_and_paths):  # pylint: disable=protected-access
        if placed.path in moved:
            placed.placement = "default_device"
    return moved


def set_keras_rs_tables(layer, layers_by_path):
    """Gives a keras-rs `DistributedEmbedding` its per-feature table layers ({path: layer}, the
    features of one table sharing its layer), where its own `_default_device_init` puts its
    `EmbedReduce` layers: its `_default_device_build` builds them there, and Keras files hold
    them there under each table's name."""
    layer._default_device_embedding_layers = {}  # pylint: disable=protected-access
    for path, table_layer in layers_by_path.items():
        layer._default_device_embedding_layers[path] = table_layer  # pylint: disable=protected-access
