"""The exercises that build a piece of the engine (09: LRU eviction of parked blocks, 13: a ring all-reduce):
their checks pass a right answer and, for each usual mistake, fail with a hint. Pure Python, no model."""
from collections import OrderedDict, deque

import pytest

from minillm.course.exercises.distributed import check_ring_all_reduce
from minillm.course.exercises.prefix import _lru_scripts, check_lru
from minillm.course.ring import ring_steps


# ------------------------------------------------------------ notebook 09: LRU eviction

class LRU:
    def __init__(self, num_blocks):
        self.free = deque(range(num_blocks))
        self.users = [0] * num_blocks
        self.parked = OrderedDict()

    def reuse(self, blocks):
        for b in blocks:
            if self.users[b] == 0:
                del self.parked[b]
            self.users[b] += 1

    def _take(self, evicted):
        if self.free:
            return self.free.popleft()
        b, _ = self.parked.popitem(last=False)
        evicted.append(b)
        return b

    def allocate(self, n):
        taken, evicted = [], []
        for _ in range(n):
            taken.append(self._take(evicted))
            self.users[taken[-1]] = 1
        return taken, evicted

    def release(self, blocks):
        for b in reversed(blocks):
            self.users[b] -= 1
            if self.users[b] == 0:
                self.parked[b] = None


class HeadFirst(LRU):          # releases first block first: a chain is evicted from its start
    def release(self, blocks):
        for b in blocks:
            self.users[b] -= 1
            if self.users[b] == 0:
                self.parked[b] = None


class MostRecent(LRU):         # evicts the most recently parked block
    def _take(self, evicted):
        if self.free:
            return self.free.popleft()
        b, _ = self.parked.popitem()
        evicted.append(b)
        return b


class EvictFirst(LRU):         # evicts while never-used blocks are left
    def _take(self, evicted):
        if not self.parked:
            return self.free.popleft()
        b, _ = self.parked.popitem(last=False)
        evicted.append(b)
        return b


class NoUsers(LRU):            # parks a block another request still holds
    def release(self, blocks):
        for b in reversed(blocks):
            self.users[b] = 0
            self.parked[b] = None


class HitStaysParked(LRU):     # a reused block stays evictable
    def reuse(self, blocks):
        for b in blocks:
            self.users[b] += 1


def test_a_right_lru_passes_every_case(capsys):
    assert check_lru(LRU)
    assert "9 of 9 checks pass" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, hint", [
    (HeadFirst, "last block first"),
    (MostRecent, "evict the least recently used"),
    (EvictFirst, "take those first"),
    (NoUsers, "still held by another request"),
    (HitStaysParked, "take it out of parked"),
])
def test_each_usual_lru_mistake_fails_with_its_hint(capsys, wrong, hint):
    assert not check_lru(wrong)
    assert hint in capsys.readouterr().out


def test_an_unwritten_lru_says_so(capsys):
    class Stub(LRU):
        def reuse(self, blocks):
            raise NotImplementedError
    assert not check_lru(Stub)
    assert "not written yet" in capsys.readouterr().out


def test_the_random_cases_exercise_evictions_hits_and_shared_blocks():
    for name, trace in _lru_scripts():
        if "random" in name:
            ops = trace.ops
            assert trace.pool.num_evictions > 0, name
            assert any(what == "reuse" and arg for what, _, arg, *_ in ops), name
            assert any(what == "release" and held for what, *_, held in ops), name


# ------------------------------------------------------------ notebook 13: a ring all-reduce

def _chunks(w, P):
    edge = [c * P // w for c in range(w + 1)]
    return lambda c: slice(edge[c % w], edge[c % w + 1])


def ring_all_reduce(vectors, ring, gather=True, chunks=_chunks):
    w, P = len(vectors), len(vectors[0])
    x, part = [list(v) for v in vectors], chunks(w, P)
    for step in range(w - 1):
        for r in range(w):
            ring.send(r, x[r][part(r - step)])
        for r in range(w):
            got, c = ring.recv(r), part(r - 1 - step)
            x[r][c] = [a + b for a, b in zip(x[r][c], got)]
    for step in range(w - 1 if gather else 0):
        for r in range(w):
            ring.send(r, x[r][part(r + 1 - step)])
        for r in range(w):
            x[r][part(r - step)] = ring.recv(r)
    return x


def test_a_right_ring_all_reduce_passes_every_case(capsys):
    assert check_ring_all_reduce(ring_all_reduce)
    assert "8 of 8 checks pass" in capsys.readouterr().out


def test_a_ring_without_its_all_gather_is_told_so(capsys):
    assert not check_ring_all_reduce(lambda v, ring: ring_all_reduce(v, ring, gather=False))
    assert "the all-gather passes the sums on" in capsys.readouterr().out


def test_sending_whole_vectors_or_nothing_fails(capsys):
    def whole(vectors, ring):
        x, cur = [list(v) for v in vectors], [list(v) for v in vectors]
        for _ in range(len(vectors) - 1):
            for r in range(len(vectors)):
                ring.send(r, cur[r])
            for r in range(len(vectors)):
                cur[r] = ring.recv(r)
                x[r] = [a + b for a, b in zip(x[r], cur[r])]
        return x

    def no_talk(vectors, ring):
        return [[sum(col) for col in zip(*vectors)] for _ in vectors]
    assert not check_ring_all_reduce(whole)
    assert "never the whole vector" in capsys.readouterr().out
    assert not check_ring_all_reduce(no_talk)
    assert "2 (w − 1) = 2 from each rank" in capsys.readouterr().out


def test_uneven_chunks_send_more_than_the_formula(capsys):
    def ceil_chunks(w, P):                    # chunks of ceil(P / w): the last ones short or empty
        size = -(-P // w)
        edge = [min(c * size, P) for c in range(w + 1)]
        return lambda c: slice(edge[c % w], edge[c % w + 1])
    assert not check_ring_all_reduce(lambda v, ring: ring_all_reduce(v, ring, chunks=ceil_chunks))
    assert "differ by at most one" in capsys.readouterr().out


@pytest.mark.parametrize("w", [1, 2, 3, 4, 7])
def test_the_drawn_schedule_is_a_ring_all_reduce(w):
    states = ring_steps(w)
    assert len(states) == 2 * (w - 1) + 1
    mid, _ = states[w - 1]                                    # after the reduce-scatter
    assert all(mid[r][(r + 1) % w] == frozenset(range(w)) for r in range(w))
    final, sends = states[-1]
    assert sends is None and all(h == frozenset(range(w)) for row in final for h in row)
    for r in range(w):                                        # each phase sends every chunk but one
        sent = [s[r] for _, s in states[:-1]]
        assert len(set(sent[:w - 1])) == len(set(sent[w - 1:])) == w - 1


def test_the_ring_picture_draws():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minillm.course.ring import draw_ring_all_reduce

    fig, ax = plt.subplots()
    draw_ring_all_reduce(ax, 3)
    assert len(ax.patches) == 5 * 9                           # 5 panels of 3 ranks × 3 chunks
    plt.close(fig)
