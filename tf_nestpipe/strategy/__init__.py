"""The synchronous NestPipe distribution strategy and its collectives."""
from tf_nestpipe.strategy.communication import CommunicationImplementation, Collectives
from tf_nestpipe.strategy.nestpipe_strategy import (NestPipeExtended, NestPipeStrategy,
                                                    is_row_shard)

__all__ = ["CommunicationImplementation", "Collectives", "NestPipeExtended", "NestPipeStrategy",
           "is_row_shard"]
