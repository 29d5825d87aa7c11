"""TrainPipeline's `trainable_variables`: the variables the first step would create (the model's
and the optimizer's slots) exist before the step functions are traced, so each is traced once
(a tf.function whose first trace creates variables is traced twice), with the same results; the
drain is the pipelined step once more (no function of its own), and an iterator that gives an
element after its end is refused."""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_nestpipe as tnp

VOCAB, DIM, BATCH, STEPS = 40, 4, 8, 4


class Ranker(tf_keras.Model):
    """A sharded table and a dense head."""

    def __init__(self):
        super().__init__()
        init = tf_keras.initializers.RandomUniform(-0.5, 0.5, seed=3)
        self.table = tnp.ShardedEmbedding(VOCAB, DIM, embeddings_initializer=init)
        self.head = tf_keras.layers.Dense(1, kernel_initializer=tf_keras.initializers.Ones())

    def call(self, ids):
        return self.head(tf.reshape(self.table(ids), [-1, 2 * DIM]))


def _batches():
    rng = np.random.default_rng(0)
    return [(rng.integers(0, VOCAB, size=(BATCH, 2)).astype(np.int64),
             rng.normal(size=(BATCH, 1)).astype(np.float32)) for _ in range(STEPS)]


def _step_fn(model, optimizer, traced=None):
    """A train step of `model` on (ids, labels), squared error, updated by `optimizer`; counts
    its traces in `traced["step"]` (if given)."""
    def step_fn(batch):
        if traced is not None:
            traced["step"] += 1
        ids, labels = batch
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(ids) - labels))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step_fn


def _train(with_variables, partly_built=False):
    """Trains a fresh model through a DBP TrainPipeline; returns (its weights, the number of
    times the step function and the route pass ran in Python, i.e. were traced). `partly_built`:
    the table is called on its own first (the model has some variables, not all)."""
    strategy = tnp.NestPipeStrategy()
    with strategy.scope():
        model = Ranker()
        optimizer = tf_keras.optimizers.Adam(0.05)
    if partly_built:
        model.table(tf.constant([[0, 1]], tf.int64))
    traced = {"step": 0, "route": 0}
    step_fn = _step_fn(model, optimizer, traced)

    def route_fn(batch):
        traced["route"] += 1
        model(batch[0])

    pipeline = tnp.TrainPipeline(
        strategy, step_fn, route_fn, optimizer=optimizer,
        trainable_variables=(lambda: model.trainable_variables) if with_variables else None)
    iterator = iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(tuple(np.stack(t) for t in zip(*_batches())))))
    for _ in range(STEPS):
        pipeline.progress(iterator)
    return [v.numpy() for v in model.weights], traced


def test_created_ahead_each_step_function_is_traced_once_with_the_same_results():
    weights, traced = _train(with_variables=True)
    # route: the variable-creating trace, the prime, the pipelined step; step: the pipelined
    # step, once (the drain is the same step function).
    assert traced == {"route": 3, "step": 1}
    # Positive control: without them, the prime (it creates the model's variables) and the
    # pipelined step (the optimizer's slots) are traced twice each.
    control_weights, control_traced = _train(with_variables=False)
    assert control_traced == {"route": 4, "step": 2}
    assert len(weights) == len(control_weights)
    for got, want in zip(weights, control_weights):
        np.testing.assert_array_equal(got, want)


def test_a_partly_built_model_gets_every_slot_before_its_first_step():
    weights, traced = _train(with_variables=True, partly_built=True)
    assert traced == {"route": 3, "step": 1}
    control_weights, _ = _train(with_variables=False)
    for got, want in zip(weights, control_weights):
        np.testing.assert_array_equal(got, want)


def test_trainable_variables_must_be_a_callable():
    strategy = tnp.NestPipeStrategy()
    with pytest.raises(TypeError, match="lambda: model.trainable_variables"):
        tnp.TrainPipeline(strategy, lambda b: None, lambda b: None, trainable_variables=[])


def test_a_drain_whose_iterator_gives_another_element_is_refused():
    """The drain runs the pipelined step once more: an iterator that gives an element after it
    reported its end would make the last batch train twice, so the pipeline refuses it."""
    strategy = tnp.NestPipeStrategy()
    pipeline = tnp.TrainPipeline(strategy, lambda batch: None, lambda batch: None)
    iterator = object()
    pipeline._primed, pipeline._has_upcoming = True, False
    # The drain's step reports whether the iterator gave an element (the step is faked: the
    # guard reads only what the step returns).
    # (outputs, [has_upcoming, rows received, rows sent, rows requested per round...])
    pipeline._step = lambda it: (None, tf.constant([1, 0, 0, 0], tf.int64))
    with pytest.raises(RuntimeError, match="gave an element after it had reported its end"):
        pipeline._advance(iterator)
    # Positive control: an iterator that stays at its end drains.
    pipeline._has_upcoming = False
    pipeline._step = lambda it: (None, tf.constant([0, 0, 0, 0], tf.int64))
    pipeline._advance(iterator)
    assert pipeline.stats.drains == 1 and not pipeline._primed


def _train_two_sizes(lookahead, rebuild=True, held=None):
    """Trains a fresh model through a TrainPipeline on batches of BATCH rows, then (a new
    iterator, as a new fit call makes) on batches of BATCH // 2 rows, both from repeated
    datasets of static shapes; each phase ends by training the batches the look-ahead holds
    (`progress_held`, as `auto` does when it switches pipelines; without look-ahead, `held`
    gives how many more batches to train instead). Returns (its weights, the number of held
    batches trained per phase). `rebuild=False` keeps the step functions traced for the first
    size (what the pipeline must not do)."""
    strategy = tnp.NestPipeStrategy()
    with strategy.scope():
        model = Ranker()
        optimizer = tf_keras.optimizers.SGD(0.1)
    pipeline = tnp.TrainPipeline(strategy, _step_fn(model, optimizer),
                                 lambda batch: model(batch[0]),
                                 optimizer=optimizer, lookahead=lookahead,
                                 trainable_variables=lambda: model.trainable_variables)
    if not rebuild:
        pipeline._build_pipelined_steps = lambda: None
    rng = np.random.default_rng(1)
    trained_held = []
    for phase, size in enumerate((BATCH, BATCH // 2)):
        ids = rng.integers(0, VOCAB, size=(6, size, 2)).astype(np.int64)
        labels = rng.normal(size=(6, size, 1)).astype(np.float32)
        dataset = tf.data.Dataset.from_tensor_slices((ids, labels)).repeat()
        iterator = iter(strategy.experimental_distribute_dataset(dataset))
        assert iterator.element_spec[0].shape == [size, 2]  # static, as the test needs
        for _ in range(3):
            pipeline.progress(iterator)
        if lookahead:
            trained_held.append(0)
            while pipeline.progress_held(iterator) is not None:
                trained_held[-1] += 1
        else:
            for _ in range(held[phase]):
                pipeline.progress(iterator)
    return [v.numpy() for v in model.weights], trained_held


def test_a_new_batch_size_retraces_the_steps_that_read_the_prefetch_state():
    """The prefetch state keeps the batches' static shapes; a batch of another size (a new fit
    call) relaxes them, and the steps that read them are traced again (also the held step,
    which takes no iterator whose new type would retrace it), so DBP still trains as the
    synchronous pipeline does."""
    got, held = _train_two_sizes(lookahead=1)
    assert held[0] >= 1 and held[1] >= 1
    want, _ = _train_two_sizes(lookahead=0, held=held)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6)
    # Positive control: the held step traced for the first size refuses the second's batches.
    with pytest.raises(tf.errors.InvalidArgumentError, match="does not match the expected shape"):
        _train_two_sizes(lookahead=1, rebuild=False)


class LookupRouted(tf_keras.Model):
    """A table and an unbuilt `Sequential` head; its route pass looks up only (as a TFRS model's
    `nestpipe_route` does), so the head has no weights before the first step."""

    def __init__(self):
        super().__init__()
        init = tf_keras.initializers.RandomUniform(-0.5, 0.5, seed=3)
        self.table = tnp.ShardedEmbedding(VOCAB, DIM, embeddings_initializer=init)
        self.head = tf_keras.Sequential(
            [tf_keras.layers.Dense(1, kernel_initializer=tf_keras.initializers.Ones())])

    def call(self, ids):
        return self.head(tf.reshape(self.table(ids), [-1, 2 * DIM]))

    def nestpipe_route(self, data):
        self.table(data[0])


def _fit_lookup_routed(pipeline):
    strategy = tnp.NestPipeStrategy(pipeline=pipeline)
    with strategy.scope():
        model = LookupRouted()
        model.compile(tf_keras.optimizers.Adam(0.05), loss="mse")
    ids, labels = (np.concatenate(parts) for parts in zip(*_batches()))
    model.fit(ids, labels, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    return model.get_weights()


def test_a_route_pass_that_leaves_a_sub_model_unbuilt_trains_as_without_a_pipeline():
    """dbp's variables-ahead pass cannot list an unbuilt sub-model's weights (Keras raises): the
    first step builds them instead, with the same results as pipeline="none" (which has no such
    pass on one worker)."""
    for got, want in zip(_fit_lookup_routed("dbp"), _fit_lookup_routed("none")):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
