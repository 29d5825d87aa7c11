"""The tf_keras surface paths under a collectives backend (issue 16 under Horovod): a fit of the
keras_surface ranker, `predict` of 100 rows, a `.h5` saved and loaded into a fresh model, and a
custom train_step's raw `total_loss` history.

    horovod_surface.py OUT_DIR                 # one process (the reference), collectives="tf"
    (or `surface(strategy, OUT_DIR)` from horovod_exactness.py --surface OUT_DIR, any backend)

Writes OUT_DIR/rank<r>.npz: trained/*, predict, h5/* (the fresh model after load_weights),
raw/total_loss (the history of the raw value, one per epoch).
"""
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import keras_surface as ks  # noqa: E402


class RawLossModel(tf_keras.Model):
    """A functional model whose train_step returns only a raw value: this worker's share of the
    global-batch mean loss (summed over workers by the strategy, as under MWMS)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            per_sample = tf_keras.losses.binary_crossentropy(y, self(x, training=True),
                                                             from_logits=True)
            loss = tf.reduce_sum(per_sample) / ks.GLOBAL_BATCH
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"total_loss": loss}


def surface(strategy, out):
    """Runs the surface cases on `strategy`; writes OUT/rank<r>.npz (see module)."""
    os.makedirs(out, exist_ok=True)
    x, y = ks.make_data(ks.GLOBAL_BATCH * ks.STEPS, 0)
    px, _ = ks.make_data(100, 2)
    results = {}
    tf_keras.utils.set_random_seed(1)
    with strategy.scope():
        model = ks.ranker()
    model.fit(ks.per_worker_dataset(strategy, x, y, True), epochs=ks.EPOCHS,
              steps_per_epoch=ks.STEPS, verbose=0)
    results.update(ks.state(model, "trained/"))
    results["predict"] = model.predict(tf.data.Dataset.from_tensor_slices(px).batch(16),
                                       verbose=0)
    model.save_weights(os.path.join(out, "w.h5"))  # every worker saves (a collective)
    with strategy.scope():
        fresh = ks.ranker(seed=10)
    fresh.load_weights(os.path.join(out, "w.h5"))
    results.update(ks.state(fresh, "h5/"))
    tf_keras.utils.set_random_seed(1)
    with strategy.scope():
        base = ks.ranker()
        raw = RawLossModel(base.inputs, base.outputs)
        raw.compile(optimizer=tf_keras.optimizers.Adagrad(0.1))
    history = raw.fit(ks.per_worker_dataset(strategy, x, y, True), epochs=ks.EPOCHS,
                      steps_per_epoch=ks.STEPS, verbose=0)
    results["raw/total_loss"] = np.array(history.history["total_loss"])
    np.savez(os.path.join(out, "rank%d.npz" % strategy.worker_index), **results)
    print("surface done on worker %d" % strategy.worker_index, flush=True)


if __name__ == "__main__":
    import tf_nestpipe as tnp  # noqa: E402

    surface(tnp.NestPipeStrategy(placement="row_wise"), sys.argv[1])  # the row shards' paths
