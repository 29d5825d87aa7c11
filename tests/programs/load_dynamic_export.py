"""Serves a DynamicEmbedding export in a process that never imports tf_nestpipe.

usage: load_dynamic_export.py EXPORT_DIR PREDICTIONS.npz
Prints the largest difference between the served and the saved predictions; fails if
tf_nestpipe got imported.
"""
import sys

import numpy as np
import tensorflow as tf


def main():
    saved = np.load(sys.argv[2])
    served = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
    (name,) = served.structured_input_signature[1].keys()
    outputs = served(**{name: tf.constant(saved["ids"])})["outputs"].numpy()
    assert not [m for m in sys.modules if m.startswith("tf_nestpipe")]
    print("max_diff %.3g" % float(np.max(np.abs(outputs - saved["predictions"]))), flush=True)


if __name__ == "__main__":
    main()
