"""tf_keras callbacks that need to know about `NestPipeStrategy`."""
import tf_keras

from tf_nestpipe.strategy.nestpipe_strategy import NestPipeStrategy


class BackupAndRestore(tf_keras.callbacks.BackupAndRestore):
    """tf_keras `BackupAndRestore` (same arguments) that also accepts `NestPipeStrategy`, whose
    table shards it backs up whole (see `row_shard_saving`): an interrupted `fit` resumes at the
    last backed-up epoch (or step, with an integer `save_freq`) on any number of workers."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._supported_strategies = tuple(self._supported_strategies) + (NestPipeStrategy,)
