"""Row-sharded embedding tables: layout, row-wise initialization, lookup and the Keras layer."""
from tf_nestpipe.sharding.collection import ShardedEmbeddingCollection
from tf_nestpipe.sharding.dynamic_embedding import DynamicEmbedding
from tf_nestpipe.sharding.embedding import ShardedEmbedding
from tf_nestpipe.sharding.layout import ShardLayout
from tf_nestpipe.sharding.lookup import sharded_lookup

__all__ = ["DynamicEmbedding", "ShardedEmbedding", "ShardedEmbeddingCollection", "ShardLayout", "sharded_lookup"]
