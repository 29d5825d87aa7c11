"""Wire codecs of the compressed exchanges: 8-bit rows with a per-row scale and offset, and the
saturating float16 cast (see ops/wire_ops.cc). They run inside exchanges whose gradients are
defined by the exchange (the backward all-to-all), so the ops themselves have none."""
import tensorflow as tf

from tf_nestpipe.ops.library import load_op_library

# The largest finite float16.
HALF_MAX = 65504.0


def int8_words(dim):
    """int32 words per row of `encode_int8_rows` for rows of `dim` values (8 header bytes)."""
    return (int(dim) + 8 + 3) // 4


def encode_int8_rows(rows):
    """Float32 rows `[n, dim]` -> int32 words `[n, int8_words(dim)]`: per row its scale
    ((max - min) / 255) and offset (min) as float32, then one uint8 code per value. A constant
    row (e.g. all-zero padding) has scale 0 and decodes exactly."""
    return load_op_library().nestpipe_encode_int8_rows(tf.convert_to_tensor(rows, tf.float32))


def decode_int8_rows(packed, dim):
    """The float32 rows `[n, dim]` of `encode_int8_rows`' words: offset + code * scale (error at
    most half a scale step per value); all-zero words decode to a zero row."""
    return load_op_library().nestpipe_decode_int8_rows(packed, dim=int(dim))


def saturate_to_half(x):
    """Float32 -> float16 with finite values beyond +-65504 clamped to +-65504 (not rounded to
    inf); inf and NaN pass through. Returns `(y, clamped)`, `clamped` an int64 count."""
    return load_op_library().nestpipe_saturate_to_half(tf.convert_to_tensor(x, tf.float32))


def to_int64_words(block):
    """A `[W, ...]` block of any dtype as `[W, R]` int64 words: row w holds block[w]'s bytes
    (row-major), then zero bytes up to a whole word. One op; see `from_int64_words`."""
    return load_op_library().nestpipe_to_int64_words(block)


def from_int64_words(words, dtype, shape):
    """The block of `to_int64_words`: `words` `[W, R]` back to `dtype` entries of `shape`
    (`[W, ...]`, an int32 vector), each row's padding dropped. One op."""
    return load_op_library().nestpipe_from_int64_words(words, tf.cast(shape, tf.int32), T=dtype)


tf.no_gradient("NestpipeEncodeInt8Rows")
tf.no_gradient("NestpipeDecodeInt8Rows")
tf.no_gradient("NestpipeSaturateToHalf")
tf.no_gradient("NestpipeToInt64Words")
tf.no_gradient("NestpipeFromInt64Words")
