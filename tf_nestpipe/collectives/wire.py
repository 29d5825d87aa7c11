"""Compressed exchanges (docs/design/design.md §13): what the embedding all-to-alls put on the
wire.

A `WireDtype` names the encoding of the rows exchange (`forward`: "fp32", "bf16", "fp16" or
"int8") and of the gradient exchange (`backward`: "fp32", "bf16" or "fp16"). A sender encodes a
padded `[W, capacity, dim]` block with the direction's `Codec`, the all-to-all carries the
encoded tensor and the receiver decodes it to the table's dtype:

- fp32: nothing encoded (the table's own dtype travels): bit-exact, the default.
- bf16: round to nearest bfloat16 (8 mantissa bits, fp32's range: nothing overflows). Its bits
  travel as float16 entries (a bit copy: Horovod has no bfloat16 all-to-all).
- fp16: the saturating float16 cast: finite values beyond +-65504 are clamped, not turned into
  inf (a loss-scaled gradient would otherwise look like an overflow), and counted
  (`WireStats`, "clamped"); inf and NaN pass through. Below 6.1e-5 float16 is subnormal and
  loses precision, so bf16 is the better gradient encoding without loss scaling.
- int8 (forward only): per row a float32 scale and offset computed by the sender and one byte per
  value (`ops.encode_int8_rows`), `dim + 8` bytes a row padded to 4-byte words.

Padding rows are zeros and decode to zeros in every codec (a backend's zero fill of received
padding included). `WireStats` counts the bytes each exchange sends to the other workers, as the
backend sends them: whole padded blocks (CollectiveAllToAllV2) or the data entries only (Horovod).
"""
from typing import NamedTuple

import numpy as np
import tensorflow as tf
from tf_nestpipe.tf_private import resource_variable_ops

from tf_nestpipe import ops

FORWARD_DTYPES = ("fp32", "bf16", "fp16", "int8")
BACKWARD_DTYPES = ("fp32", "bf16", "fp16")
# TensorFlow's names of the same encodings.
_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
# The kinds of exchange `WireStats` counts.
KINDS = ("keys", "forward", "backward", "sync")


class WireDtype(NamedTuple):
    """The encodings of the rows exchange (`forward`) and the gradient exchange (`backward`)."""

    forward: str = "fp32"
    backward: str = "fp32"

    @property
    def exact(self):
        """Whether nothing is compressed (both directions fp32)."""
        return self.forward == "fp32" and self.backward == "fp32"

    def __str__(self):
        return "%s/%s" % (self.forward, self.backward)


def _choice(value, choices, direction):
    name = _ALIASES.get(value, value) if isinstance(value, str) else value
    if name not in choices:
        hint = (" (int8 encodes rows only: use {'forward': 'int8', 'backward': 'bf16'})"
                if direction == "backward" and name == "int8" else "")
        raise ValueError("wire_dtype %s must be one of %s (or %s), got %r%s"
                         % (direction, ", ".join(choices),
                            ", ".join(k for k, v in _ALIASES.items() if v in choices), value, hint))
    return name


def parse_wire_dtype(value):
    """A `WireDtype` from a string (both directions), a `{"forward": ..., "backward": ...}`
    dict (a missing direction stays fp32), a `WireDtype` or None (fp32). Raises `ValueError`
    naming the choices for anything else."""
    if value is None:
        return WireDtype()
    if isinstance(value, WireDtype):
        value = value._asdict()
    if isinstance(value, str):
        value = {"forward": value, "backward": value}
    if not isinstance(value, dict):
        raise ValueError("wire_dtype must be a string or a dict with keys 'forward' and "
                         "'backward', got %r" % (value,))
    unknown = sorted(set(value) - {"forward", "backward"})
    if unknown:
        raise ValueError("wire_dtype has unknown keys %s; its keys are 'forward' and 'backward'"
                         % unknown)
    return WireDtype(_choice(value.get("forward", "fp32"), FORWARD_DTYPES, "forward"),
                     _choice(value.get("backward", "fp32"), BACKWARD_DTYPES, "backward"))


class WireStats:
    """Cumulative counters of one strategy's exchanges on this worker: bytes sent to the other
    workers per kind ("keys", "forward", "backward", "sync") and float16 values clamped."""

    def __init__(self, device):
        with tf.init_scope(), tf.device(device):
            # Constructed directly (not tf.Variable) so no strategy creator intercepts them.
            self._counters = {
                name: resource_variable_ops.ResourceVariable(
                    0, dtype=tf.int64, trainable=False, name="nestpipe_wire_" + name)
                for name in KINDS + ("clamped",)}

    def add(self, name, amount):
        """Adds `amount` (int64) to counter `name`; returns the op."""
        return self._counters[name].assign_add(tf.cast(amount, tf.int64), read_value=False)

    def count_sent(self, kind, wire, collectives, send_counts=None, uncounted=0):
        """Counts the bytes of the padded `[W, capacity, ...]` `wire` tensor that leave this
        worker (its own block stays): whole blocks on a padded backend, the first
        `send_counts[j]` entries of each block on one with variable splits. `uncounted`
        (entries of each block, e.g. another kind's rider counted by its sender) is left out
        on a padded backend; `send_counts` must already leave them out. Returns the op."""
        static = wire.shape
        if static.rank is not None and static[2:].is_fully_defined():
            # The usual case (dims known when traced): a few ops on the hot path, not a dozen.
            entry_bytes = int(np.prod(static[2:].as_list(), dtype=np.int64)) * wire.dtype.size
        else:
            entry_bytes = (tf.reduce_prod(tf.shape(wire, out_type=tf.int64)[2:])
                           * wire.dtype.size)
        if send_counts is not None and getattr(collectives, "sends_real_splits", False):
            counts = tf.cast(send_counts, tf.int64)
            entries = tf.reduce_sum(counts) - counts[collectives.worker_index]
        else:
            shape = tf.shape(wire, out_type=tf.int64)
            blocks = static[0] if static.rank is not None and static[0] is not None else shape[0]
            columns = shape[1] if isinstance(uncounted, int) and not uncounted else (
                shape[1] - tf.cast(uncounted, tf.int64))
            entries = (blocks - 1) * columns
        return self.add(kind, entries * entry_bytes)

    def read(self):
        """The counters now, as a dict of Python ints."""
        return {name: int(v.numpy()) for name, v in self._counters.items()}


class Codec:
    """Encodes a padded `[W, capacity, dim]` float block for the wire and decodes it back."""

    def __init__(self, name):
        self.name = name

    @property
    def exact(self):
        """Whether the codec sends the values unchanged."""
        return self.name == "fp32"

    def tag(self, tag):
        """The collective tag of an exchange in this encoding (its own instance keys: an
        instance key always sees one shape and dtype)."""
        return tag if self.exact else "%s/%s" % (tag, self.name)

    def wire_width(self, dim):
        """Elements per entry on the wire for rows of `dim` values."""
        return ops.int8_words(dim) if self.name == "int8" else int(dim)

    def wire_dtype(self, table_dtype):
        """The dtype on the wire."""
        return {"fp32": table_dtype, "bf16": tf.float16, "fp16": tf.float16,
                "int8": tf.int32}[self.name]

    def encode(self, block, stats=None):
        """The wire tensor of `block` (`[W, capacity, dim]`); fp16 counts its clamped values."""
        if self.exact:
            return block
        block32 = tf.cast(block, tf.float32)
        if self.name == "bf16":
            return tf.bitcast(tf.cast(block32, tf.bfloat16), tf.float16)
        if self.name == "fp16":
            wire, clamped = ops.saturate_to_half(block32)
            if stats is None:
                return wire
            with tf.control_dependencies([stats.add("clamped", clamped)]):
                return tf.identity(wire)
        dim = block.shape[-1]
        shape = tf.shape(block)
        packed = ops.encode_int8_rows(tf.reshape(block32, [-1, dim]))
        return tf.reshape(packed, tf.stack([shape[0], shape[1], ops.int8_words(dim)]))

    def decode(self, wire, dim, dtype):
        """The `[W, capacity, dim]` block of `dtype` a wire tensor encodes."""
        if self.exact:
            return wire
        if self.name == "int8":
            shape = tf.shape(wire)
            rows = ops.decode_int8_rows(tf.reshape(wire, [-1, ops.int8_words(dim)]), dim)
            return tf.cast(tf.reshape(rows, tf.stack([shape[0], shape[1], dim])), dtype)
        if self.name == "bf16":
            wire = tf.bitcast(wire, tf.bfloat16)
        return tf.cast(wire, dtype)


def int32_bits(values, dtype):
    """int32 `values` `[...]` as `[..., k]` entries of `dtype` (bit copies: k = 4 / itemsize)."""
    return values[..., None] if dtype == tf.int32 else tf.bitcast(values, dtype)


def from_int32_bits(entries):
    """The int32 values of `int32_bits`' entries `[..., k]`."""
    return entries[..., 0] if entries.dtype == tf.int32 else tf.bitcast(entries, tf.int32)


def pack_header(counts, width, dtype):
    """int32 `counts` `[W, k]` as `[W, rows, width]` entries of `dtype` (bit copies, exact),
    to travel at the head of an encoded block; see `unpack_header`."""
    bits = counts if dtype == tf.int32 else tf.bitcast(counts, dtype)
    flat = tf.reshape(bits, [tf.shape(counts)[0], -1])
    per_row = flat.shape[1]
    rows = -(-per_row // width)
    flat = tf.pad(flat, [[0, 0], [0, rows * width - per_row]])
    return tf.reshape(flat, [-1, rows, width])


def unpack_header(entries, k):
    """The int32 `[W, k]` counts of `pack_header`'s entries `[W, rows, width]`."""
    dtype = entries.dtype
    per_value = 1 if dtype == tf.int32 else 4 // dtype.size
    flat = tf.reshape(entries, [tf.shape(entries)[0], -1])[:, :k * per_value]
    if dtype == tf.int32:
        return flat
    return tf.bitcast(tf.reshape(flat, [-1, k, per_value]), tf.int32)


def header_rows(k, width, dtype):
    """Entries `pack_header` uses for `k` int32 counts per block."""
    per_value = 1 if dtype == tf.int32 else 4 // dtype.size
    return -(-k * per_value // width)


class Wire:
    """One strategy's wire: the `WireDtype`, its forward and backward `Codec` and the
    `WireStats` (None: nothing counted)."""

    def __init__(self, wire_dtype=None, stats=None):
        self.dtype = parse_wire_dtype(wire_dtype)
        self.forward = Codec(self.dtype.forward)
        self.backward = Codec(self.dtype.backward)
        self.stats = stats

    def count(self, kind, wire, collectives, send_counts=None, uncounted=0):
        """Control dependencies that count `wire`'s bytes (none without stats; see
        `WireStats.count_sent`)."""
        if self.stats is None:
            return []
        return [self.stats.count_sent(kind, wire, collectives, send_counts, uncounted)]

    def exchange(self, codec, kind, block, collectives, tag, bucket, send_counts=None):
        """`collectives.all_to_all` of a float `[W, capacity, dim]` block through `codec`:
        encode, count, send, decode."""
        wire = codec.encode(block, self.stats)
        with tf.control_dependencies(self.count(kind, wire, collectives, send_counts)):
            received = collectives.all_to_all(wire, codec.tag(tag), bucket,
                                              send_counts=send_counts)
        return codec.decode(received, block.shape[-1], block.dtype)

    def differentiable_exchange(self, block, collectives, tag, bucket, send_counts,
                                grad_send_counts):
        """The rows exchange (forward codec) whose gradient is the reverse exchange of the
        incoming gradient (backward codec). `grad_send_counts[j]`: entries of the gradient that
        carry data for worker j (the rows received from it)."""

        @tf.custom_gradient
        def exchanged(x):
            def grad(dy):
                return self.exchange(self.backward, "backward", tf.convert_to_tensor(dy),
                                     collectives, tag + "/grad", bucket, grad_send_counts)

            return self.exchange(self.forward, "forward", x, collectives, tag, bucket,
                                 send_counts), grad

        return exchanged(block)


# Uncounted fp32: the wire of exchanges made outside a strategy's registry.
PLAIN = Wire()
