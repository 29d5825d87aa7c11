"""Python-dict reference of the dynamic-table semantics (ops/dynamic_table_ops.cc) and of a small
model trained with a `DynamicEmbedding` on W simulated owners (tests/programs/dynamic_table.py)."""
import numpy as np

MASK64 = (1 << 64) - 1


def splitmix64(k):
    """The splitmix64 finalizer of an int64's bits (uint64 arithmetic)."""
    z = k & MASK64
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & MASK64
    return z ^ (z >> 31)


def owner(k, workers):
    """Owner worker of id k."""
    return splitmix64(int(k)) % workers


class RefTable:
    """One owner's table: dicts id -> [slot, last step, freq] and pending id -> [count, last]."""

    def __init__(self, capacity, admit_after=1, policy="lru", ttl=0, counter_capacity=1024):
        self.capacity, self.admit_after, self.policy = capacity, admit_after, policy
        self.ttl, self.counter_capacity = ttl, counter_capacity
        self.map, self.pending, self.free = {}, {}, set(range(capacity))
        self.step = 0
        self.stats = dict(admitted=0, evicted=0, expired=0, refused=0, pending_dropped=0)

    def find(self, ids):
        return [self.map[k][0] if k in self.map else -1 for k in ids]

    def _keep_pending(self, k, count):
        if len(self.pending) >= self.counter_capacity and self.pending:
            oldest = min(self.pending, key=lambda p: (self.pending[p][1], p))
            del self.pending[oldest]
            self.stats["pending_dropped"] += 1
        self.pending[k] = [count, self.step]

    def admit(self, ids):
        """One step: (slots, fresh) per input id; also returns the evicted/expired ids."""
        self.step += 1
        gone = []
        if self.ttl:
            for k in sorted(self.map):
                if self.map[k][1] + self.ttl < self.step:
                    self.free.add(self.map.pop(k)[0])
                    self.stats["expired"] += 1
                    gone.append(k)
        fresh = set()
        for k in sorted(set(ids)):  # every present id is touched before any is admitted
            if k in self.map:
                self.map[k][1] = self.step
                self.map[k][2] += 1
        for k in sorted(set(ids)):
            if k in self.map:
                continue
            count = self.pending.pop(k, [0, 0])[0] + 1
            if count < self.admit_after:
                self._keep_pending(k, count)
                continue
            if self.free:
                slot = min(self.free)
                self.free.remove(slot)
            else:
                old = [v for v in self.map if self.map[v][1] < self.step]
                if not old:
                    self.stats["refused"] += 1
                    self._keep_pending(k, count)
                    continue
                if self.policy == "lru":
                    victim = min(old, key=lambda v: (self.map[v][1], v))
                else:
                    victim = min(old, key=lambda v: (self.map[v][2], self.map[v][1], v))
                slot = self.map.pop(victim)[0]
                gone.append(victim)
                self.stats["evicted"] += 1
            self.map[k] = [slot, self.step, count]
            fresh.add(k)
            self.stats["admitted"] += 1
        return self.find(ids), [k in fresh for k in ids], gone


class RefDynamicModel:
    """pred = sum_k row(ids[:, k]) . w + b, loss = mean over the global batch of (pred - y)^2,
    Adagrad (tf_keras: accumulator 0.1, epsilon 1e-7) on rows (sparse) and dense weights, with
    the table of W owners (`RefTable` each); ids not admitted embed to zero, get no update."""

    def __init__(self, workers, dim, init_fn, table_kwargs, w, b, lr):
        self.workers, self.dim, self.init_fn, self.lr = workers, dim, init_fn, lr
        self.tables = [RefTable(**table_kwargs) for _ in range(workers)]
        self.rows, self.acc = {}, {}
        self.w, self.b = np.array(w, np.float32), np.float32(b)
        self.acc_w, self.acc_b = np.full_like(self.w, 0.1), np.float32(0.1)

    def _adagrad(self, value, acc, grad):
        acc = acc + grad * grad
        return value - self.lr * grad / (np.sqrt(acc) + np.float32(1e-7)), acc

    def step(self, ids, y):
        ids = np.asarray(ids, np.int64)
        flat = [int(k) for k in ids.reshape(-1)]
        admitted = {}
        for t, table in enumerate(self.tables):
            mine = [k for k in sorted(set(flat)) if owner(k, self.workers) == t]
            slots, fresh, gone = table.admit(mine)
            for k in gone:
                self.rows.pop(k, None)
                self.acc.pop(k, None)
            for k, slot, is_fresh in zip(mine, slots, fresh):
                if is_fresh:
                    self.rows[k] = np.asarray(self.init_fn([k]), np.float32)[0]
                    self.acc[k] = np.full(self.dim, 0.1, np.float32)
                admitted[k] = slot >= 0
        zero = np.zeros(self.dim, np.float32)
        emb = np.stack([sum((self.rows[int(k)] if admitted[int(k)] else zero) for k in row)
                        for row in ids]).astype(np.float32)
        pred = emb @ self.w + self.b
        n = len(y)
        dpred = (2.0 / n) * (pred - np.asarray(y, np.float32))
        g_w = (emb * dpred[:, None]).sum(0).astype(np.float32)
        g_b = np.float32(dpred.sum())
        g_rows = {}
        for row, d in zip(ids, dpred):
            for k in row:
                if admitted[int(k)]:
                    g_rows[int(k)] = g_rows.get(int(k), zero) + d * self.w
        for k, g in g_rows.items():
            self.rows[k], self.acc[k] = self._adagrad(self.rows[k], self.acc[k],
                                                      g.astype(np.float32))
        self.w, self.acc_w = self._adagrad(self.w, self.acc_w, g_w)
        self.b, self.acc_b = self._adagrad(self.b, self.acc_b, g_b)
        return float(np.mean((pred - y) ** 2))

    def rehash(self, workers, capacity=None):
        """The tables moved onto `workers` owners (of `capacity` each): each id, with its step,
        frequency (and row), to its new owner at slots 0, 1, ... in ascending id order; pending
        ids with their counts likewise; the old counters summed go to owner 0."""
        old = self.tables
        first = old[0]
        kwargs = dict(capacity=capacity or first.capacity, admit_after=first.admit_after,
                      policy=first.policy, ttl=first.ttl, counter_capacity=first.counter_capacity)
        entries = {k: v for table in old for k, v in table.map.items()}
        pending = {k: v for table in old for k, v in table.pending.items()}
        self.tables = [RefTable(**kwargs) for _ in range(workers)]
        for index, table in enumerate(self.tables):
            mine = sorted(k for k in entries if owner(k, workers) == index)
            assert len(mine) <= table.capacity, "the reference's owner %d overflows" % index
            for slot, k in enumerate(mine):
                table.map[k] = [slot, entries[k][1], entries[k][2]]
                table.free.discard(slot)
            table.pending = {k: list(v) for k, v in pending.items()
                             if owner(k, workers) == index}
            table.step = first.step
        for name in first.stats:
            self.tables[0].stats[name] = sum(table.stats[name] for table in old)
        self.workers = workers

    def snapshot(self):
        """{id: (last step, frequency, row, accumulator, owner)} and {pending id: (steps seen,
        last step, owner)}."""
        table = {k: (e[1], e[2], self.rows[k], self.acc[k], index)
                 for index, t in enumerate(self.tables) for k, e in t.map.items()}
        pending = {k: (p[0], p[1], index)
                   for index, t in enumerate(self.tables) for k, p in t.pending.items()}
        return table, pending

    def full_table(self):
        ids = np.array(sorted(self.rows), np.int64)
        return ids, np.stack([self.rows[k] for k in ids]) if len(ids) else np.zeros((0, self.dim))

    def stats(self):
        total = {}
        for table in self.tables:
            for name, v in table.stats.items():
                total[name] = total.get(name, 0) + v
        return total
