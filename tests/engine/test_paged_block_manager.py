"""The PagedBlockManager (kvserve._C.PagedBlockManager) through its bindings: an exact trace, the
invariants after random operations, and the errors bad arguments raise. The exhaustive traces and
the randomized KV check live in tests/cpp/test_paged_block_manager.cpp."""

import random

import pytest

import kvserve  # noqa: F401  (loads libtorch before the extension)
from kvserve._C import BlockCopy, PagedBlockManager


def test_groups_with_a_sliding_window():
    """A full-attention group and a local group of window 6: the local table gives back block 0
    once the next query (position 9) no longer sees it, and reserves a long prefill chunk by
    chunk."""
    m = PagedBlockManager(num_blocks=40, block_size=4, group_windows=[0, 6])
    assert (m.num_groups(), m.group_window(0), m.group_window(1)) == (2, 0, 6)
    m.allocate(1, list(range(9)))
    m.mark_computed(1, 9)
    assert m.block_table(1, 1) == [4, 5, 6]
    m.append_slots(1, [50])
    assert m.block_table(1, 1) == [0, 5, 6] and m.block_table(1) == [1, 2, 3]
    assert m.num_live_blocks(1, 1) == 2 and m.ref_count(4) == 0
    m.allocate(2, list(range(100, 140)), num_scheduled=8)
    assert m.num_live_blocks(2, 0) == 10 and m.num_live_blocks(2, 1) == 2
    m.mark_computed(2, 8)
    assert m.can_reserve_prefill(2, 16)
    m.reserve_prefill(2, 16)
    assert m.num_live_blocks(2, 1) == 4
    with pytest.raises(ValueError, match="outside the sequence's 40 tokens"):
        m.reserve_prefill(2, 41)
    with pytest.raises(ValueError, match="reserved up to position 16"):
        m.mark_computed(2, 20)
    m.check_invariants()
    with pytest.raises(ValueError, match="one window >= 0 per group"):
        PagedBlockManager(num_blocks=8, group_windows=[])


def test_trace_with_prefix_hit_fork_copy_and_free():
    m = PagedBlockManager(num_blocks=10, block_size=4)
    prompt = list(range(10))
    assert m.allocate(1, prompt) == 0
    assert m.block_table(1) == [1, 2, 3]
    m.mark_computed(1, 10)
    assert m.num_cached_blocks() == 2
    assert m.allocate(2, prompt) == 8  # two full blocks; the last two tokens are recomputed
    assert m.block_table(2) == [1, 2, 4]
    assert m.num_computed_tokens(2) == 8
    assert [m.ref_count(b) for b in range(5)] == [0, 2, 2, 1, 1]
    assert (m.prefix_cache_queries(), m.prefix_cache_hits()) == (20, 8)

    m.fork(2, 3)
    copies = m.append_slots(3, [99])  # block 4 is shared and half full: copy before writing
    assert copies == [BlockCopy(src=4, dst=5)]
    assert repr(copies[0]) == "BlockCopy(src=4, dst=5)"
    assert m.block_table(3) == [1, 2, 5] and m.num_tokens(3) == 11
    assert m.append_slots(2, [98]) == []  # block 4 is sequence 2's alone now
    m.check_invariants()

    for seq_id in (3, 2, 1):
        m.free(seq_id)
    # Uncached blocks at the head, cached ones at the tail, each sequence's last block first.
    assert m.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    assert m.num_free_blocks() == m.num_usable_blocks() == 9
    assert m.usage() == 0.0 and m.num_sequences() == 0
    m.check_invariants()


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
@pytest.mark.parametrize("block_size", [1, 3])
def test_random_operations_keep_the_invariants(block_size, enable_prefix_caching):
    rng = random.Random(block_size)
    m = PagedBlockManager(num_blocks=20, block_size=block_size,
                          enable_prefix_caching=enable_prefix_caching)
    prefixes = [[rng.randrange(4) for _ in range(9)] for _ in range(2)]
    live, next_id = [], 0
    for _ in range(600):
        op = rng.random()
        if not live or op < 0.3:
            prompt = rng.choice(prefixes)[: rng.randrange(10)] + [rng.randrange(4)]
            if m.can_allocate(prompt):
                m.allocate(next_id, prompt)
                live.append(next_id)
                next_id += 1
        elif op < 0.7:
            seq_id = rng.choice(live)
            if m.num_computed_tokens(seq_id) < m.num_tokens(seq_id):
                m.mark_computed(seq_id, m.num_tokens(seq_id))
            elif m.can_append_slots(seq_id, 1):
                m.append_slots(seq_id, [rng.randrange(4)])
        elif op < 0.8:
            m.fork(rng.choice(live), next_id)
            live.append(next_id)
            next_id += 1
        else:
            m.free(live.pop(rng.randrange(len(live))))
        m.check_invariants()
    if enable_prefix_caching:
        assert m.prefix_cache_hits() > 0 and m.num_evictions() > 0
    for seq_id in live:
        m.free(seq_id)
    m.check_invariants()
    assert m.num_free_blocks() == m.num_usable_blocks()


def test_errors_name_the_problem_and_change_nothing():
    m = PagedBlockManager(num_blocks=4, block_size=4)
    m.allocate(1, [1, 2, 3, 4, 5])
    with pytest.raises(IndexError, match="unknown sequence id 7"):
        m.block_table(7)
    with pytest.raises(IndexError, match="unknown sequence id 7"):
        m.append_slots(7, [1])
    with pytest.raises(IndexError, match="unknown sequence id 7"):
        m.free(7)
    with pytest.raises(IndexError, match=r"block id 4 is outside \[0, 4\)"):
        m.ref_count(4)
    with pytest.raises(ValueError, match="sequence id 1 is already allocated"):
        m.allocate(1, [1])
    with pytest.raises(ValueError, match="empty prompt"):
        m.allocate(2, [])
    with pytest.raises(ValueError, match="token ids must be non-negative, got -2"):
        m.allocate(2, [1, -2])
    with pytest.raises(ValueError, match="token ids must be non-negative"):
        m.append_slots(1, [-3])
    with pytest.raises(ValueError, match="token ids must be non-negative"):
        m.append_slots(1, [-1, 5])  # a pending token (-1) only ends the appended tokens
    with pytest.raises(ValueError, match="cannot set 6"):
        m.mark_computed(1, 6)
    with pytest.raises(ValueError, match="num_new_tokens must be >= 0"):
        m.can_append_slots(1, -1)
    with pytest.raises(RuntimeError, match=r"sequence 2 needs 3 free KV cache blocks \(1 free\)"):
        m.allocate(2, list(range(9)))
    with pytest.raises(RuntimeError, match="not enough free KV cache blocks"):
        m.append_slots(1, list(range(8)))
    with pytest.raises(TypeError):
        m.allocate(2, [2**31])  # token ids are int32
    assert m.free_block_ids() == [3] and m.num_sequences() == 1 and m.num_tokens(1) == 5
    m.check_invariants()


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_blocks=1), "num_blocks must be in"),
    (dict(num_blocks=4, block_size=0), "block_size must be >= 1"),
    (dict(num_blocks=4, watermark=1.0), r"watermark must be in \[0, 1\)"),
    (dict(num_blocks=4, watermark=-0.5), r"watermark must be in \[0, 1\)"),
])
def test_constructor_rejects_bad_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PagedBlockManager(**kwargs)


def test_state_slots_beside_the_blocks():
    """A model with state-space layers: a slot per sequence from allocate to free, n - 1 more kept
    for its forks (each queued as a copy of the parent's state), slots reused last-freed first,
    and an admission refused while too few are free."""
    from kvserve._C import StateCopy

    m = PagedBlockManager(num_blocks=20, block_size=4, enable_prefix_caching=False,
                          num_state_slots=3)
    assert (m.num_state_slots(), m.num_free_state_slots()) == (3, 3)
    m.allocate(1, [5, 6, 7], num_states=2)  # its own slot and one for a fork
    assert m.state_slot(1) == 0 and m.num_free_state_slots() == 1
    assert not m.can_allocate([1, 2], num_states=2) and m.can_allocate([1, 2])
    with pytest.raises(RuntimeError, match="needs 2 free state slots \\(1 free\\)"):
        m.allocate(2, [1, 2], num_states=2)
    m.check_invariants()
    m.fork(1, 10)
    assert m.state_slot(10) == 1 and m.take_state_copies() == [StateCopy(0, 1)]
    assert m.take_state_copies() == []
    m.fork(1, 11)  # nothing kept: the last free slot
    assert m.state_slot(11) == 2 and m.num_free_state_slots() == 0
    with pytest.raises(RuntimeError, match="no state slot is free"):
        m.fork(1, 12)
    assert not m.has_sequence(12)
    m.free(11)  # its queued copy goes with it: the slot may go to a stranger
    assert m.take_state_copies() == [] and m.num_free_state_slots() == 1
    m.allocate(3, [9])
    assert m.state_slot(3) == 2  # the last freed, handed out first
    for seq in (1, 10, 3):
        m.free(seq)
    assert m.num_free_state_slots() == 3 and m.num_sequences() == 0
    m.check_invariants()
    plain = PagedBlockManager(num_blocks=8)
    plain.allocate(1, [1, 2])
    assert plain.state_slot(1) == -1 and plain.num_state_slots() == 0
    with pytest.raises(ValueError, match="prefix caching with state slots needs state snapshots"):
        PagedBlockManager(num_blocks=8, num_state_slots=2)
    with pytest.raises(ValueError, match="num_state_snapshots must be >= 0, and > 0 only with"):
        PagedBlockManager(num_blocks=8, num_state_snapshots=2)
    with pytest.raises(ValueError, match="and a first group of full attention"):
        PagedBlockManager(num_blocks=8, num_state_slots=2, num_state_snapshots=1,
                          group_windows=[6, 0])
    with pytest.raises(ValueError, match="num_state_slots must be in"):
        PagedBlockManager(num_blocks=8, enable_prefix_caching=False, num_state_slots=-1)
    with pytest.raises(ValueError, match="num_states must be >= 1"):
        m.allocate(4, [1], num_states=0)



def test_state_backups_for_speculative_steps():
    """With state_backups each sequence slot has a backup slot after the snapshots'; restoring
    queues the copy back and sets the computed tokens back (its hashed blocks stay cached)."""
    from kvserve._C import StateCopy

    m = PagedBlockManager(num_blocks=8, block_size=2, num_state_slots=2, num_state_snapshots=1,
                          state_backups=True)
    assert m.num_state_pool_slots() == 5
    m.allocate(1, [5, 6, 7])
    m.allocate(2, [8, 9])
    assert m.back_up_state(2) == StateCopy(1, 4) and m.back_up_state(1) == StateCopy(0, 3)
    m.append_slots(1, [], 3)  # a verified token and two draft slots
    m.append_slots(1, [10, 11], 1)
    m.mark_computed(1, 5)
    m.restore_state(1, 2)
    assert m.take_state_copies() == [StateCopy(3, 0)]
    m.check_invariants()
    m.mark_computed(1, 5)  # recomputed
    with pytest.raises(ValueError, match="cannot go back to 6"):
        m.restore_state(1, 6)
    plain = PagedBlockManager(num_blocks=8, block_size=2, num_state_slots=2,
                              enable_prefix_caching=False)
    plain.allocate(1, [5])
    assert plain.num_state_pool_slots() == 2
    with pytest.raises(RuntimeError, match="has no backup slot"):
        plain.back_up_state(1)

def test_state_snapshots_serve_prefix_hits_from_the_step_after():
    """Prefix caching with state slots: snapshot_state plans the copy of a sequence's state at a
    block boundary into a snapshot slot (after the step's forward); once committed it serves
    hits, which end only at a block with a snapshot and queue its copy into the new sequence's
    slot. A sequence admitted in the planning step sees none (its state is not written yet); a
    step that did not run gives its slots back; the least recently used snapshot makes room."""
    from kvserve._C import StateCopy

    m = PagedBlockManager(num_blocks=40, block_size=4, num_state_slots=3, num_state_snapshots=2)
    assert (m.num_state_pool_slots(), m.num_state_snapshots()) == (5, 2)
    prompt = list(range(10, 23))  # 13 tokens: boundaries at 4, 8, 12
    assert m.allocate(1, prompt) == 0
    m.mark_computed(1, 12)  # the scheduler's chunk, ended at the last boundary
    assert m.snapshot_state(1, 12) == StateCopy(0, 3)
    assert m.snapshot_state(1, 12) is None  # one a step
    assert m.snapshot_state(1, 10) is None  # not a boundary
    assert m.allocate(2, prompt + [99]) == 0  # the same step: the state is not written yet
    m.check_invariants()
    m.commit_state_snapshots()
    assert m.num_cached_states() == 1
    m.free(2)
    assert m.allocate(3, prompt + [98]) == 12
    assert m.take_state_copies() == [StateCopy(3, m.state_slot(3))]
    # No snapshot at 8: a prompt that shares two blocks only gets no hit.
    assert m.allocate(4, prompt[:9] + [77, 78]) == 0
    m.free(4)
    # A running sequence: planned before its step, ready when marked computed after it.
    m.mark_computed(1, 13)
    for token in (50, 51, 52):
        m.append_slots(1, [token])
        planned = m.snapshot_state(1, m.num_tokens(1))
        m.mark_computed(1, m.num_tokens(1))
    assert planned == StateCopy(0, 4)
    m.commit_state_snapshots()
    assert m.num_cached_states() == 2
    assert m.allocate(5, prompt + [50, 51, 52, 7]) == 16
    assert m.take_state_copies() == [StateCopy(4, m.state_slot(5))]
    m.free(5)
    # Planned, then the step did not run: the slot comes back.
    m.snapshot_state(3, 12)
    m.discard_state_snapshots()
    m.check_invariants()
    # A third snapshot takes the least recently used one's slot (the hit at 16 used it last).
    other = list(range(200, 209))
    m.free(3)
    m.allocate(6, other)
    m.mark_computed(6, 8)
    assert m.snapshot_state(6, 8) == StateCopy(m.state_slot(6), 3)
    m.commit_state_snapshots()
    assert m.num_cached_states() == 2
    assert m.allocate(7, prompt + [1]) == 0  # the snapshot at 12 is gone
    m.free(7)
    assert m.allocate(8, prompt + [50, 51, 52, 8]) == 16
    m.check_invariants()
    # A prompt sharing blocks with the cache past its hit: its next chunk should end where they
    # end (snapshot_boundary), so that the state there is saved for the next such prompt.
    for seq in (1, 6, 8):
        m.free(seq)
    assert m.allocate(9, other[:8] + [5] * 5) == 8  # from the snapshot at 8
    assert m.snapshot_boundary(9) == 0
    m.mark_computed(9, 12)  # no snapshot planned: block 3 cached without a state
    assert m.allocate(10, other[:8] + [5] * 4 + [6] * 3) == 8
    assert m.snapshot_boundary(10) == 12  # where it parts from seq 9
    m.mark_computed(10, 12)
    assert m.snapshot_boundary(10) == 0
