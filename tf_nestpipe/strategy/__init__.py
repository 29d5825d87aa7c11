"""The synchronous NestPipe distribution strategy and its collectives, and the
parameter-server strategy."""
from tf_nestpipe.collectives.communication import CommunicationImplementation, Collectives
from tf_nestpipe.strategy.nestpipe_strategy import (NestPipeExtended, NestPipeStrategy,
                                                    is_row_shard)
from tf_nestpipe.strategy.downpour import DownpourTrainer, LocalAdagrad, LocalSGD
from tf_nestpipe.strategy.parameter_server import ParameterServerStrategy

__all__ = ["CommunicationImplementation", "Collectives", "DownpourTrainer", "LocalAdagrad",
           "LocalSGD", "NestPipeExtended", "NestPipeStrategy",
           "ParameterServerStrategy", "is_row_shard"]
