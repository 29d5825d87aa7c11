"""Cross-worker collectives (the lowest layer with sharding's ops): TensorFlow's collective ops on
ordered streams (`Collectives`) and the same interface over Horovod (`HorovodCollectives`)."""
from tf_nestpipe.collectives.communication import (CommunicationImplementation, Collectives,
                                                   capacity_bucket, resolve_implementation)

__all__ = ["CommunicationImplementation", "Collectives", "capacity_bucket",
           "resolve_implementation"]
