"""Wire codecs against NumPy references: int8 rows (round trip within half a scale step, exact
for constant and zero rows), the saturating float16 cast (clamps and counts, never overflows a
finite value to inf), bf16 and fp16 codecs' round-trip bounds, the exact header bit copies, and
the wire_dtype parser's errors."""
import numpy as np
import pytest
import tensorflow as tf

from tf_nestpipe import ops
from tf_nestpipe.collectives import wire as wire_lib


def encode_int8_reference(rows):
    """NumPy reference of NestpipeEncodeInt8Rows: (scale, offset, codes) per row."""
    lo, hi = rows.min(axis=1), rows.max(axis=1)
    scale = ((hi - lo) / np.float32(255)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale[:, None] > 0,
                     np.rint((rows - lo[:, None]) * (np.float32(1) / scale[:, None])), 0)
    return scale, lo, np.clip(q, 0, 255).astype(np.uint8)


def unpack_words(packed, dim):
    """(scale, offset, codes, trailing bytes) of the int32 words of NestpipeEncodeInt8Rows."""
    raw = np.ascontiguousarray(packed).view(np.uint8).reshape(packed.shape[0], -1)
    scale = raw[:, 0:4].copy().view(np.float32)[:, 0]
    offset = raw[:, 4:8].copy().view(np.float32)[:, 0]
    return scale, offset, raw[:, 8:8 + dim], raw[:, 8 + dim:]


@pytest.mark.parametrize("dim", [1, 3, 4, 16, 61])
def test_int8_encode_matches_numpy_and_round_trips_within_half_a_step(dim):
    rng = np.random.default_rng(dim)
    rows = (rng.normal(size=(50, dim)) * rng.uniform(0.01, 10, size=(50, 1))).astype(np.float32)
    rows[3] = 0.0  # padding
    rows[7] = -1.25  # constant
    packed = ops.encode_int8_rows(rows).numpy()
    assert packed.shape == (50, ops.int8_words(dim)) and packed.dtype == np.int32
    scale, offset, codes, tail = unpack_words(packed, dim)
    ref_scale, ref_offset, ref_codes = encode_int8_reference(rows)
    np.testing.assert_array_equal(scale, ref_scale)
    np.testing.assert_array_equal(offset, ref_offset)
    # The kernel multiplies by a float32 reciprocal as the reference does: codes agree but for
    # ties rounded the other way by a last-bit difference.
    assert np.abs(codes.astype(int) - ref_codes.astype(int)).max() <= 1
    assert (tail == 0).all()
    decoded = ops.decode_int8_rows(packed, dim).numpy()
    step = rows.max(axis=1) - rows.min(axis=1)
    bound = step / 510 * (1 + 1e-4) + 1e-6 * np.abs(rows).max(axis=1)
    assert (np.abs(decoded - rows).max(axis=1) <= bound).all()
    np.testing.assert_array_equal(decoded[3], 0.0)  # zero rows: scale 0, no division by zero
    np.testing.assert_array_equal(decoded[7], -1.25)


def test_int8_zero_words_decode_to_zero_rows_and_empty_inputs_work():
    np.testing.assert_array_equal(ops.decode_int8_rows(tf.zeros([2, 4], tf.int32), 7), 0.0)
    assert ops.encode_int8_rows(tf.zeros([0, 5])).shape == (0, 4)
    assert ops.decode_int8_rows(tf.zeros([0, 4], tf.int32), 5).shape == (0, 5)


def test_int8_shape_inference_and_errors():
    @tf.function(input_signature=[tf.TensorSpec([None, 6], tf.float32)])
    def f(x):
        packed = ops.encode_int8_rows(x)
        assert packed.shape.as_list() == [None, 4]
        out = ops.decode_int8_rows(packed, 6)
        assert out.shape.as_list() == [None, 6]
        return out

    f(tf.ones([2, 6]))
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError)):
        ops.encode_int8_rows(tf.zeros([2, 2, 2]))
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="4|words|dim"):
        ops.decode_int8_rows(tf.zeros([2, 3], tf.int32), 6)  # 6 values need 4 words


def test_saturate_to_half_clamps_counts_and_passes_non_finite_through():
    x = np.array([1.0, 7e4, -1e9, np.inf, -np.inf, np.nan, 65504.0, 65519.0, 3e-8, -2.5],
                 np.float32)
    y, clamped = ops.saturate_to_half(x)
    y = y.numpy()
    assert y.dtype == np.float16 and int(clamped) == 3  # 7e4, -1e9, 65519
    ref = np.clip(x, -65504, 65504).astype(np.float16)
    ref[3:6] = x[3:6]
    np.testing.assert_array_equal(y, ref)
    finite = np.isfinite(x)
    assert np.isfinite(y[finite]).all()  # no finite value became inf
    assert np.isposinf(y[3]) and np.isneginf(y[4]) and np.isnan(y[5])


def test_saturate_to_half_keeps_shape():
    y, clamped = ops.saturate_to_half(tf.ones([2, 3, 4]) * 1e6)
    assert y.shape == (2, 3, 4) and int(clamped) == 24


@pytest.mark.parametrize("name,rel", [("bf16", 2.0 ** -8), ("fp16", 2.0 ** -11)])
def test_float_codecs_round_trip_within_half_an_ulp(name, rel):
    codec = wire_lib.Codec(name)
    rng = np.random.default_rng(1)
    block = rng.normal(size=(2, 5, 8)).astype(np.float32)  # fp16-normal magnitudes
    block[np.abs(block) < 1e-3] = 1e-3
    block[:, 4] = 0.0
    wire = codec.encode(tf.constant(block))
    assert wire.dtype == codec.wire_dtype(tf.float32)
    back = codec.decode(wire, 8, tf.float32).numpy()
    assert (np.abs(back - block) <= rel * np.abs(block)).all()
    np.testing.assert_array_equal(back[:, 4], 0.0)


def test_int8_codec_handles_blocks_and_float64_tables():
    codec = wire_lib.Codec("int8")
    block = np.random.default_rng(2).normal(size=(3, 4, 5))
    back = codec.decode(codec.encode(tf.constant(block)), 5, tf.float64).numpy()
    assert back.dtype == np.float64 and back.shape == block.shape
    span = block.max(axis=-1, keepdims=True) - block.min(axis=-1, keepdims=True)
    assert (np.abs(back - block) <= span / 500).all()


def test_fp32_codec_is_the_identity():
    codec = wire_lib.Codec("fp32")
    block = tf.constant(np.random.default_rng(3).normal(size=(2, 3, 4)))
    assert codec.encode(block) is block and codec.tag("t") == "t"
    assert wire_lib.Codec("int8").tag("t") == "t/int8"


@pytest.mark.parametrize("dtype,width", [(tf.int32, 3), (tf.float16, 1), (tf.bfloat16, 4),
                                         (tf.float16, 3)])
def test_header_counts_travel_as_exact_bit_copies(dtype, width):
    counts = tf.constant([[0, 70000], [1 << 30, 65535], [123457, 7]], tf.int32)
    header = wire_lib.pack_header(counts, width, dtype)
    rows = wire_lib.header_rows(2, width, dtype)
    assert header.dtype == dtype and header.shape.as_list() == [3, rows, width]
    np.testing.assert_array_equal(wire_lib.unpack_header(header, 2), counts)


@pytest.mark.parametrize("value,expected", [
    (None, ("fp32", "fp32")), ("fp32", ("fp32", "fp32")), ("bf16", ("bf16", "bf16")),
    ("float16", ("fp16", "fp16")), ({"forward": "int8", "backward": "bf16"}, ("int8", "bf16")),
    ({"forward": "bfloat16"}, ("bf16", "fp32")), ({"backward": "half"}, ("fp32", "fp16"))])
def test_parse_wire_dtype(value, expected):
    parsed = wire_lib.parse_wire_dtype(value)
    assert tuple(parsed) == expected and parsed.exact == (expected == ("fp32", "fp32"))
    assert wire_lib.parse_wire_dtype(parsed) == parsed


@pytest.mark.parametrize("value,match", [
    ("fp8", r"forward must be one of fp32, bf16, fp16, int8.*'fp8'"),
    ("int8", r"backward must be one of fp32, bf16, fp16.*'int8'.*int8 encodes rows only"),
    ({"forward": "int4"}, r"forward must be one of.*'int4'"),
    ({"backward": "int8"}, r"backward must be one of.*int8 encodes rows only"),
    ({"forwards": "bf16"}, r"unknown keys \['forwards'\]"),
    (16, r"must be a string or a dict")])
def test_parse_wire_dtype_rejects_bad_names_naming_the_choices(value, match):
    with pytest.raises(ValueError, match=match):
        wire_lib.parse_wire_dtype(value)
