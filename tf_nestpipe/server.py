"""Server entry point for tasks that only serve (ps, and workers in parameter-server mode).

`python -m tf_nestpipe.server` loads tf_nestpipe's custom ops first, so functions that use them
can run on this task, then serves the task named by `TF_CONFIG` until killed. While serving,
it takes part in the start-up cluster check of parameter-server mode (`cluster_check`, led by
a `tnp.ParameterServerStrategy` chief): a task given another cluster exits, naming the field.
Like `tnp.NestPipeStrategy` and `tnp.ParameterServerStrategy`, it first makes this process keep
freed memory (`tf_nestpipe.launch.allocator`; a `MALLOC_TOP_PAD_` in the environment wins, so
`MALLOC_TOP_PAD_=0` keeps none); the serving line says what was done.
"""
import os
import sys

import tensorflow as tf

from tf_nestpipe.launch import allocator, cluster_check
from tf_nestpipe.tf_config import parse_tf_config
from tf_nestpipe.ops import load_op_library


def main():
    """Starts a `tf.distribute.Server` for this task and blocks."""
    config = parse_tf_config()
    if config is None:
        sys.exit("tf_nestpipe.server: TF_CONFIG is not set; it names this task's role and index.")
    top_pad = allocator.keep_freed_memory()
    load_op_library()
    server = tf.distribute.Server(tf.train.ClusterSpec(config.cluster), job_name=config.task_type,
                                  task_index=config.task_index, protocol="grpc", start=True)
    print("tf_nestpipe.server: %s:%d serving at %s (malloc top pad: %s)"
          % (config.task_type, config.task_index, server.target, top_pad), flush=True)
    if config.cluster.get("chief"):  # parameter-server mode: the chief leads the check
        cluster_check.report_while_serving(config.cluster, config.task_type, config.task_index,
                                           _exit_on_mismatch)
    server.join()


def _exit_on_mismatch(message):
    """The chief found this task's cluster wrong: stop serving at once, naming the cause."""
    print("tf_nestpipe.server: ClusterMismatchError: %s" % message, flush=True)
    os._exit(1)  # pylint: disable=protected-access


if __name__ == "__main__":
    main()
