"""Loads what keras_surface.py saved, in a process that never imports tf_nestpipe.

usage: load_saved.py RUN_DIR OUT.npz
Writes OUT.npz: saved_model/predict (tf_keras.models.load_model of RUN_DIR/saved0, predicting
RUN_DIR/x_predict.npz), export/predict and tf_saved/predict (serving_default of RUN_DIR/export
and of RUN_DIR/tf_saved), h5/<dataset> (every
dataset of RUN_DIR/w0.h5, read with h5py). Fails if tf_nestpipe got imported.
"""
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import h5py  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402


def main():
    run, out_path = sys.argv[1], sys.argv[2]
    x = dict(np.load(os.path.join(run, "x_predict.npz")))
    out = {}
    model = tf_keras.models.load_model(os.path.join(run, "saved0"))
    out["saved_model/predict"] = model.predict(x, batch_size=16, verbose=0)
    served = tf.saved_model.load(os.path.join(run, "export")).signatures["serving_default"]
    out["export/predict"] = served(**{k: tf.constant(v) for k, v in x.items()})["outputs"].numpy()
    served = tf.saved_model.load(os.path.join(run, "tf_saved")).signatures["serving_default"]
    outputs = served(**{k: tf.constant(v) for k, v in x.items()})
    assert len(outputs) == 1, list(outputs)
    out["tf_saved/predict"] = list(outputs.values())[0].numpy()
    with h5py.File(os.path.join(run, "w0.h5"), "r") as f:
        f.visititems(lambda name, obj: out.__setitem__("h5/" + name, obj[()])
                     if isinstance(obj, h5py.Dataset) else None)
    loaded = sorted(m for m in sys.modules if m.startswith("tf_nestpipe"))
    assert not loaded, loaded
    np.savez(out_path, **out)
    print("loaded", sorted(out), flush=True)


if __name__ == "__main__":
    main()
